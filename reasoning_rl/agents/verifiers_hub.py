"""Environments of Prime Intellect's verifiers hub (`verifiers` 0.4, its `verifiers.v1` stack) as
reasoning_rl agents.

A verifiers environment is a taskset (rows -> typed tasks with @reward / @metric scoring), the
seat(s) that play it and a harness per seat (the program that talks to the model). verifiers never
lets a harness reach the model directly: every model call goes to a per-rollout interception
server, which forwards it to the configured endpoint and records it on the trace. This adapter
points that endpoint at the trainer's server — the base URL, API key and extra headers of the
client the trainer hands the agent — so every token the environment's model calls produce is
sampled (and trained on) by the trainer, and runs one episode of one task per agent call:

    agent = make_agent("my-taskset", {"taskset": {"some_knob": 1}})
    examples = agent.examples()              # the taskset's tasks, as the trainer's dataset
    parts = await agent(client, examples[0]) # {"reward": total, <reward name>: score, ...}

Settings (the `config.agent` section, as a plain dict; `agent_from_settings`):
  env_id    the taskset's id, as `vf-eval` takes it: an installed package (`gsm8k-v1`,
            `owner/name@version` -> `name`) exporting a Taskset (and optionally an Env / Harness).
  env_args  the environment's config (`EnvConfig` fields: `taskset: {...}` knobs, `id` of a
            paired Env, `agent: {harness: {...}, runtime: {...}, max_turns: ...}`, ...).
  model     the model name the harness sends (the trainer's server accepts any); "policy".

The seat's runtime defaults to `subprocess` (verifiers' own default is a remote Prime sandbox);
only local runtimes are accepted, so nothing but the trainer's server is ever the model endpoint.
Note that verifiers' stock harnesses (bash, null, ...) install their program with `uv` from PyPI
the first time they run; a harness that runs in-process (as the test environment's does) needs
nothing.

Return value: the episode's reward parts, {<reward function>: weight x score} (a seat's
functions as "<seat>/<name>" when several seats play). The trainer sums an agent's parts into the
reward, so they sum to the environment's own total (verifiers' `trace.reward`); @metric values are
not rewards and are not returned. An environment with no reward function gives {"reward": 0}.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Mapping
from typing import Any

import pydantic

import verifiers.v1 as vf
from verifiers.v1.runtimes import runtime_is_local

from reasoning_rl.agents.hub_support import (HubEpisodeError, client_headers, example_fields,
                                             takes_agent_settings)
from reasoning_rl.errors import ConfigError

ENV_ID_FIELD = "config.agent.env_id"
ENV_ARGS_FIELD = "config.agent.env_args"
MODEL_FIELD = "config.agent.model"
# verifiers reads an endpoint's API key from an environment variable its client config names
# (`_api_key_variable`).
API_KEY_PREFIX = "REASONING_RL_AGENT_API_KEY_"
TOTAL_PART = "reward"


def load_environment(env_id: str, env_args: Mapping[str, Any] | None = None) -> vf.Env:
  """The verifiers environment `env_id` with `env_args`, as `vf.load_environment` builds it, its
  seats on a local runtime (subprocess unless env_args pins a local one). ConfigError naming the
  setting when the id is unknown or the arguments do not validate."""
  if not isinstance(env_id, str) or not env_id:
    raise ConfigError(f"{ENV_ID_FIELD}: the verifiers environment's id is required (e.g. "
                      "'gsm8k-v1', an installed package exporting a verifiers Taskset)")
  if env_args is not None and not isinstance(env_args, Mapping):
    raise ConfigError(f"{ENV_ARGS_FIELD}: must be a mapping of the environment's config fields, "
                      f"got {type(env_args).__name__}")
  raw = _with_local_runtimes(dict(env_args or {}), env_id)
  try:
    config = vf.resolve_env_config(raw)
  except pydantic.ValidationError as e:
    error = e.errors()[0]
    where = ".".join(str(p) for p in error["loc"])
    raise ConfigError(f"{ENV_ARGS_FIELD}.{where}: {error['msg']} (environment {env_id!r})") from e
  except (ImportError, TypeError, ValueError, AttributeError) as e:
    # The taskset imported (above): what fails here is a plugin the arguments name (a harness,
    # a judge) or verifiers' own checks of their values.
    raise ConfigError(f"{ENV_ARGS_FIELD}: {_first_line(e)} (environment {env_id!r})") from e
  try:
    env = vf.load_environment(config)
  except (ImportError, TypeError, ValueError, AttributeError) as e:
    raise ConfigError(f"{ENV_ID_FIELD}: verifiers environment {env_id!r} cannot be built with "
                      f"these env_args: {_first_line(e)}") from e
  for seat, spec in _seats(env.config).items():
    if not runtime_is_local(spec.runtime):
      raise ConfigError(f"{ENV_ARGS_FIELD}.{seat}.runtime: {spec.runtime.type!r} is remote; "
                        "use a local runtime (subprocess, docker, podman, apptainer) so the "
                        "environment's model calls reach the trainer's server only")
    if spec.client is not None:
      raise ConfigError(f"{ENV_ARGS_FIELD}.{seat}.client: a seat pinned to its own endpoint "
                        f"({spec.client.base_url}) would not be trained; remove the pin")
  return env


def _seats(config: vf.EnvConfig) -> dict[str, vf.AgentConfig]:
  return {name: value for name, value in config if isinstance(value, vf.AgentConfig)}


def _with_local_runtimes(raw: dict[str, Any], env_id: str) -> dict[str, Any]:
  """`raw` with the taskset id set and every seat that pins no runtime on `subprocess`."""
  taskset = raw.get("taskset") or {}
  if not isinstance(taskset, Mapping):
    raise ConfigError(f"{ENV_ARGS_FIELD}.taskset: must be a mapping of the taskset's knobs")
  if taskset.get("id", env_id) != env_id:
    raise ConfigError(f"{ENV_ARGS_FIELD}.taskset.id: {taskset['id']!r} disagrees with "
                      f"{ENV_ID_FIELD} ({env_id!r}); set the id in one place")
  raw["taskset"] = {**taskset, "id": env_id}
  try:
    vf.taskset_config_type(env_id)  # imports the taskset: is env_id one?
  except (ImportError, TypeError, ValueError, AttributeError) as e:
    raise _not_an_environment(env_id, e) from e
  try:
    config_type = vf.env_config_type(env_id, raw.get("id") or "")
  except (ImportError, TypeError, ValueError, AttributeError) as e:
    raise ConfigError(f"{ENV_ARGS_FIELD}.id: {_first_line(e)} (environment {env_id!r})") from e
  for name, field in config_type.model_fields.items():
    if isinstance(field.default, vf.AgentConfig):
      seat = dict(raw.get(name) or {})
      seat.setdefault("runtime", {"type": "subprocess"})
      raw[name] = seat
  return raw


def _not_an_environment(env_id: str, error: BaseException) -> ConfigError:
  if isinstance(error, ModuleNotFoundError):
    return ConfigError(f"{ENV_ID_FIELD}: verifiers environment {env_id!r} is not importable "
                       f"({_first_line(error)}); install its package or fix the id")
  return ConfigError(f"{ENV_ID_FIELD}: {env_id!r} is not a verifiers environment "
                     f"({_first_line(error)}); name a package exporting a verifiers Taskset")


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def task_for(env: vf.Env, example: Mapping[str, Any]) -> vf.Task:
  """The environment's task for one example: the task data fields (`examples()` writes them; a
  trainer Example carries them as its metadata, `hub_support.example_fields`)."""
  task_type = type(env.taskset).task_type()
  try:
    data = task_type.data_type().model_validate(example_fields(example))
  except pydantic.ValidationError as e:
    error = e.errors()[0]
    raise ConfigError(f"example field {'.'.join(str(p) for p in error['loc'])}: {error['msg']} "
                      f"(a {task_type.__name__} needs the fields of "
                      f"{task_type.data_type().__name__}; build the dataset with "
                      "VerifiersHubAgent.examples())") from e
  return task_type(data, env.taskset.config.task)


def reward_parts(episode: vf.Episode) -> dict[str, float]:
  """The episode's reward parts (module docstring): each @reward function's weighted score, so
  that their sum — what the trainer trains on — is the environment's own total. HubEpisodeError
  when the episode failed or a reward was not scored."""
  if not episode.ok or not episode.traces:
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    errors += [f"{e.type}: {e.message}" for t in episode.traces for e in t.errors]
    raise HubEpisodeError(f"verifiers episode of {episode.env.id or 'the environment'} failed: "
                          f"{'; '.join(errors) or 'no trace completed'}")
  parts: dict[str, float] = {}
  for trace in episode.traces:
    for name, reward in trace.rewards.items():
      if reward is None:
        raise HubEpisodeError(f"verifiers episode of {episode.env.id}: {name!r} was not scored")
      key = name if len(episode.traces) == 1 else f"{trace.agent.name}/{name}"
      parts[key] = float(reward.value)
  return parts or {TOTAL_PART: 0.0}


class VerifiersHubAgent:
  """An agent function (`await agent(client, example)`) running one verifiers episode per call
  on the trainer's server (module docstring)."""

  def __init__(self, env_id: str, env_args: Mapping[str, Any] | None = None, *,
               model: str = "policy"):
    if not isinstance(model, str) or not model:
      raise ConfigError(f"{MODEL_FIELD}: a non-empty model name, got {model!r}")
    self.env = load_environment(env_id, env_args)
    self.model = model
    self._serving = _SharedServing(self.env)

  def examples(self) -> list[dict[str, Any]]:
    """The taskset's tasks as JSON-safe dicts (one per task, in load order): the dataset whose
    rows this agent takes. Refused for an infinite taskset."""
    if not self.env.taskset.bounded:
      raise ConfigError(f"{ENV_ARGS_FIELD}.taskset: {self.env.config.taskset.id!r} is infinite; "
                        "bound it (a taskset knob that limits its size)")
    return [task.data.model_dump(mode="json", exclude_none=True) for task in self.env.taskset]

  async def __call__(self, client: Any, example: Mapping[str, Any]) -> dict[str, float]:
    task = task_for(self.env, example)
    # One attempt: verifiers' episode retries (env.config.retries) are left to the trainer, whose
    # server would otherwise see a failed attempt's model calls as part of the episode.
    with _api_key_variable(client.api_key or "EMPTY") as variable:
      endpoint = vf.EvalClientConfig(base_url=str(client.base_url).rstrip("/"),
                                     api_key_var=variable, headers=client_headers(client))
      async with self._serving.hold():
        episode = await self.env.run_episode(task, vf.ModelContext(model=self.model,
                                                                    client=endpoint))
    return reward_parts(episode)


_key_users: dict[str, int] = {}


@contextlib.contextmanager
def _api_key_variable(api_key: str):
  """The name of an environment variable holding `api_key` while an episode runs: verifiers
  reads an endpoint's key from a variable its client config names. One variable per distinct key
  (episodes may get keys of their own), removed when its last episode ends. Names contain
  "API_KEY", so verifiers' subprocess runtime keeps them from the harness's processes."""
  variable = f"{API_KEY_PREFIX}{hashlib.sha256(api_key.encode()).hexdigest()[:16]}"
  _key_users[variable] = _key_users.get(variable, 0) + 1
  os.environ[variable] = api_key
  try:
    yield variable
  finally:
    _key_users[variable] -= 1
    if not _key_users[variable]:
      del _key_users[variable]
      os.environ.pop(variable, None)


class _SharedServing:
  """One `env.serving()` (interception servers, shared tool servers) held while any episode of
  the environment runs: the env keeps what serving() opens on itself, so concurrent episodes
  must share one, entered by the first and left by the last."""

  def __init__(self, env: vf.Env):
    self._env = env
    self._users = 0
    self._loop: asyncio.AbstractEventLoop | None = None
    self._lock: asyncio.Lock | None = None
    self._context: contextlib.AbstractAsyncContextManager | None = None

  @contextlib.asynccontextmanager
  async def hold(self):
    loop = asyncio.get_running_loop()
    if self._loop is not loop:
      if self._users:
        raise RuntimeError("a verifiers hub agent runs episodes on one event loop at a time")
      self._loop, self._lock = loop, asyncio.Lock()
    async with self._lock:
      if self._users == 0:
        self._context = self._env.serving()
        await self._context.__aenter__()
      self._users += 1
    try:
      yield
    finally:
      async with self._lock:
        self._users -= 1
        if self._users == 0:
          context, self._context = self._context, None
          await context.__aexit__(None, None, None)


def make_agent(env_id: str, env_args: Mapping[str, Any] | None = None, *,
               model: str = "policy") -> VerifiersHubAgent:
  """The agent function for verifiers environment `env_id` (module docstring)."""
  return VerifiersHubAgent(env_id, env_args, model=model)


@takes_agent_settings
def agent_from_settings(settings: Mapping[str, Any]) -> VerifiersHubAgent:
  """`make_agent` from the plain dict of `config.agent` (keys env_id, env_args, model)."""
  return make_agent(settings.get("env_id", ""), settings.get("env_args") or {},
                    model=settings.get("model") or "policy")
