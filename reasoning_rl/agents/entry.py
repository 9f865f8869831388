"""Loading `config.agent.entry`: the agent function a run plays its episodes with.

An entry names either
  - the agent itself: `async def run(client, example) -> float | dict[str, float]`, or
  - a factory marked `takes_agent_settings` (`agents.hub_support`; the hub adapters'
    `agent_from_settings`): called once with the `config.agent` section as a plain dict, it
    returns the agent (an async function, or an object whose `__call__` is async).

The hub settings of `config.agent` (env_id, environment, env_args, …; docs/agent_hubs.md) are read
only by such a factory: an entry that is the agent itself takes none, so setting one is refused
rather than ignored.

The run builds its agent in two places, the training data (`data.train.kind='agent'`: the agent's
`examples()`) and the rollout collector; both ask `load_agent` with the same settings and get the
same object, so the factory runs once per process and settings (an OpenEnv `server` transport,
say, starts one server).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any

from reasoning_rl import config_schema
from reasoning_rl.agents.hub_support import import_object
from reasoning_rl.errors import ConfigError
from reasoning_rl.plain_data import plain

FIELD = "config.agent.entry"
# The hub adapters' settings of `config.agent` (docs/agent_hubs.md), whose schema defaults mean
# "not set"; every other agent.* field is the trainer's own (collector.AgentSettings, the server's),
# so a trainer setting added later is never mistaken for a hub one.
HUB_SETTINGS = ("env_id", "environment", "env_args", "transport", "action", "observation",
                "system_prompt", "max_turns", "turn_tokens", "model")
HUB_DEFAULTS = {name: config_schema.FIELDS[f"agent.{name}"].default for name in HUB_SETTINGS}

_loaded: dict[tuple[str, str], Callable] = {}


def import_entry(entry: str) -> Any:
  """The object `module:name` names (ConfigError naming config.agent.entry)."""
  return import_object(entry, f"{FIELD}={entry!r}")


def is_async_callable(value: Any) -> bool:
  """An async function, or an object whose `__call__` is one (a hub adapter's agent)."""
  return (asyncio.iscoroutinefunction(value)
          or asyncio.iscoroutinefunction(getattr(value, "__call__", None)))


def load_entry(entry: str, settings: Mapping[str, Any] | None = None) -> Callable:
  """The agent function `entry` names: the function itself, or what its `takes_agent_settings`
  factory returns for `settings` (the `config.agent` section; the factory is called once per
  distinct entry and settings in this process). ConfigError naming the field when the entry
  cannot be loaded, is not async, or is given hub settings it does not read."""
  settings = dict(plain(settings) if settings is not None else {})
  key = (entry, json.dumps(settings, sort_keys=True, default=repr))
  if key in _loaded:
    return _loaded[key]
  target = import_entry(entry)
  if getattr(target, "takes_agent_settings", False):
    agent = target(settings)
    if not is_async_callable(agent):
      raise ConfigError(f"{FIELD}={entry!r}: the factory returned {type(agent).__name__}, not an "
                        "agent (an async function `run(client, example)`)")
  else:
    hub = {name: value for name, value in settings.items()
           if name in HUB_DEFAULTS and value != HUB_DEFAULTS[name]}
    if hub:
      name = sorted(hub)[0]
      raise ConfigError(f"config.agent.{name}={hub[name]!r}: only a hub adapter's entry (a "
                        f"factory marked takes_agent_settings) reads it, and {entry!r} is not "
                        "one; unset it or name such a factory")
    agent = target
    if not is_async_callable(agent):
      raise ConfigError(f"{FIELD}={entry!r}: must be an async function "
                        "`async def run(client, example) -> float | dict`")
  _loaded[key] = agent
  return agent


def load_agent(config) -> Callable:
  """The run's agent: `load_entry` of `config.agent.entry` with the `config.agent` section."""
  return load_entry(config.agent.entry, plain(config.agent))


def agent_examples(config) -> list:
  """The run's agent's own tasks (`examples()`, a hub taskset): the data of
  `data.train.kind='agent'`. ConfigError when no entry is set or its agent has no tasks."""
  if not config.agent.entry:
    raise ConfigError("config.data.train.kind='agent': the examples come from the agent "
                      "(config.agent.entry), and none is set; set it or choose another kind")
  agent = load_agent(config)
  examples = getattr(agent, "examples", None)
  if not callable(examples):
    raise ConfigError(f"config.data.train.kind='agent': the agent of config.agent.entry="
                      f"{config.agent.entry!r} has no examples() (only a hub taskset's agent "
                      "brings its own tasks); give data.train a task source")
  return list(examples())


__all__ = ["agent_examples", "import_entry", "is_async_callable", "load_agent", "load_entry"]
