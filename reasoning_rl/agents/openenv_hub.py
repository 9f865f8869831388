"""OpenEnv environments (`openenv-core` 0.3: `openenv.core.Environment` with reset / step / state)
as reasoning_rl agents.

One agent call is one episode, played as a chat through the trainer's OpenAI-compatible client:

    observation = env.reset(**example)                 # the example's fields reset accepts
    messages = [system?, user: text(observation)]
    until done or max_turns:
      reply = chat(messages)                           # the trainer samples (and trains on) it
      observation = env.step(action(reply))            # the model's reply -> the env's Action
      reward += observation.reward
      messages += [assistant: reply, user: text(observation)]

Two ways to run the environment, both without docker:
  in_process  a fresh Environment instance per episode, driven directly (reset_async/step_async);
  server      the environment served by OpenEnv's own `create_app` (uvicorn on 127.0.0.1, on a
              thread of this process), each episode an OpenEnv WebSocket session through
              `GenericEnvClient` — the path a deployed OpenEnv space takes.

Settings (the `config.agent` section, as a plain dict; `agent_from_settings`):
  environment   "package.module:Name" of the Environment subclass (or a factory returning one).
  env_args      keyword arguments of that constructor/factory ({}).
  transport     "in_process" (default) or "server".
  action        optional "module:function" (reply text -> dict of the Action's fields). Default:
                a reply that is a JSON object is the action's fields; otherwise the whole reply
                is the value of the Action's one required field.
  observation   optional "module:function" (dict of the observation's fields -> message text).
                Default: the observation's one text field, else its fields as JSON.
  system_prompt optional text of a system message opening every episode.
  max_turns     model turns per episode at most (8).
  turn_tokens   max_tokens of each model turn's request (0 = none sent: the server's default,
                which lets one turn take what is left of the episode's token budget).
  model         the model name sent to the trainer's server ("policy").

A reply that does not make a valid Action is not sent to the environment: the validation error
goes back to the model as the next user message (it costs the turn, not the episode).

Return value: {"reward": sum of the step rewards} (one part: the trainer sums an agent's parts
into the reward, so nothing else is returned; the turns are in the rollout records).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import json
import socket
import threading
import typing
from collections.abc import Callable, Mapping
from typing import Any

import pydantic
import uvicorn
from openenv.core import Action, Environment, GenericEnvClient, Observation, create_app

from reasoning_rl.agents.hub_support import (HubEpisodeError, example_fields, import_object,
                                             takes_agent_settings)
from reasoning_rl.errors import ConfigError

FIELD = "config.agent"
TRANSPORTS = ("in_process", "server")
# Observation fields every OpenEnv observation has; they are not the message text.
BASE_OBSERVATION_FIELDS = frozenset(Observation.model_fields)


@dataclasses.dataclass(frozen=True)
class OpenEnvSettings:
  """The adapter's settings (module docstring), checked."""

  environment: str
  env_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  transport: str = "in_process"
  action: str | None = None
  observation: str | None = None
  system_prompt: str | None = None
  max_turns: int = 8
  turn_tokens: int = 0
  model: str = "policy"

  def __post_init__(self):
    if not self.environment:
      raise ConfigError(f"{FIELD}.environment: the OpenEnv Environment to run is required, as "
                        "'package.module:EnvironmentClass'")
    if not isinstance(self.env_args, Mapping):
      raise ConfigError(f"{FIELD}.env_args: must be a mapping of the environment's constructor "
                        f"arguments, got {type(self.env_args).__name__}")
    if self.transport not in TRANSPORTS:
      raise ConfigError(f"{FIELD}.transport: {self.transport!r} is not one of {TRANSPORTS}")
    if not isinstance(self.max_turns, int) or self.max_turns < 1:
      raise ConfigError(f"{FIELD}.max_turns: a positive integer, got {self.max_turns!r}")
    if (isinstance(self.turn_tokens, bool) or not isinstance(self.turn_tokens, int)
        or self.turn_tokens < 0):
      raise ConfigError(f"{FIELD}.turn_tokens: an integer >= 0 (0 = no limit per turn), got "
                        f"{self.turn_tokens!r}")
    if not isinstance(self.model, str) or not self.model:
      raise ConfigError(f"{FIELD}.model: a non-empty model name, got {self.model!r}")


def environment_types(factory: Any) -> tuple[type[Action], type[Observation]]:
  """The Action and Observation classes of an Environment subclass, read from its generic
  parameters (`Environment[MyAction, MyObservation, MyState]`)."""
  if isinstance(factory, type):
    for klass in factory.__mro__:
      for base in getattr(klass, "__orig_bases__", ()):
        if typing.get_origin(base) is Environment:
          action_type, observation_type, *_ = typing.get_args(base)
          if (isinstance(action_type, type) and issubclass(action_type, Action)
              and isinstance(observation_type, type) and issubclass(observation_type, Observation)):
            return action_type, observation_type
  raise ConfigError(f"{FIELD}.environment: {factory!r} does not declare its Action and "
                    "Observation types (subclass Environment[MyAction, MyObservation, MyState])")


def default_action(action_type: type[Action]) -> Callable[[str], dict[str, Any]]:
  """reply -> action fields: a JSON object reply as is, else the one required field's value."""
  required = [name for name, field in action_type.model_fields.items() if field.is_required()]

  def to_action(reply: str) -> dict[str, Any]:
    text = reply.strip()
    with contextlib.suppress(json.JSONDecodeError):
      fields = json.loads(text)
      if isinstance(fields, dict):
        return fields
    if len(required) != 1:
      raise ValueError(f"reply is not a JSON object of {action_type.__name__}'s fields "
                       f"{sorted(action_type.model_fields)}")
    return {required[0]: text}

  return to_action


def default_observation_text(fields: Mapping[str, Any]) -> str:
  """The observation's one text field, else all its fields as JSON (sorted keys)."""
  own = {k: v for k, v in fields.items() if k not in BASE_OBSERVATION_FIELDS}
  texts = [v for v in own.values() if isinstance(v, str)]
  if len(own) == 1 and len(texts) == 1:
    return texts[0]
  return json.dumps(own, sort_keys=True, default=str)


def accepted_kwargs(function: Callable[..., Any], example: Mapping[str, Any]) -> dict[str, Any]:
  """The example's fields `function` takes (all of them if it takes **kwargs), as OpenEnv's
  server filters a reset request."""
  parameters = inspect.signature(function).parameters
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
    return dict(example)
  return {k: v for k, v in example.items() if k in parameters}


class _InProcessSession:
  """One episode on a fresh Environment instance in this process."""

  def __init__(self, factory: Callable[[], Environment]):
    self._env = factory()

  async def reset(self, example: Mapping[str, Any]) -> tuple[dict, float | None, bool]:
    # As OpenEnv's server does: the fields that the method which will run takes.
    overridden = type(self._env).reset_async is not Environment.reset_async
    signature_of = self._env.reset_async if overridden else self._env.reset
    return _split(await self._env.reset_async(**accepted_kwargs(signature_of, example)))

  async def step(self, action: Action) -> tuple[dict, float | None, bool]:
    return _split(await self._env.step_async(action))

  async def close(self) -> None:
    self._env.close()


def _split(observation: Observation) -> tuple[dict, float | None, bool]:
  fields = observation.model_dump(exclude={"reward", "done", "metadata"})
  return fields, observation.reward, bool(observation.done)


class _ServerSession:
  """One episode as a WebSocket session of the local OpenEnv server."""

  def __init__(self, url: str):
    self._client = GenericEnvClient(base_url=url)

  async def reset(self, example: Mapping[str, Any]) -> tuple[dict, float | None, bool]:
    await self._client.connect()
    result = await self._client.reset(**example)
    return dict(result.observation), result.reward, bool(result.done)

  async def step(self, action: Action) -> tuple[dict, float | None, bool]:
    result = await self._client.step(action.model_dump(exclude={"metadata"}))
    return dict(result.observation), result.reward, bool(result.done)

  async def close(self) -> None:
    await self._client.close()


class LocalOpenEnvServer:
  """OpenEnv's `create_app` for an environment, served by uvicorn on 127.0.0.1 (a free port) on
  a daemon thread of this process."""

  def __init__(self, factory: Callable[[], Environment], action_type: type[Action],
               observation_type: type[Observation], max_sessions: int):
    app = create_app(factory, action_type, observation_type, max_concurrent_envs=max_sessions)
    self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._socket.bind(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
    self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                    name="openenv-server", daemon=True)
    self._thread.start()
    for _ in range(600):  # up to 30 s for uvicorn to start serving
      if self._server.started or not self._thread.is_alive():
        break
      threading.Event().wait(0.05)
    if not self._server.started:
      raise HubEpisodeError(f"the local OpenEnv server for {factory!r} did not start")

  def close(self) -> None:
    self._server.should_exit = True
    self._thread.join(timeout=30)
    self._socket.close()


class OpenEnvHubAgent:
  """An agent function (`await agent(client, example)`) playing one OpenEnv episode per call
  through the trainer's client (module docstring)."""

  def __init__(self, settings: OpenEnvSettings):
    self.settings = settings
    target = import_object(settings.environment, f"{FIELD}.environment")
    self.action_type, self.observation_type = environment_types(target)
    self._factory = functools.partial(target, **settings.env_args)
    try:
      probe = self._factory()
    except TypeError as e:
      raise ConfigError(f"{FIELD}.env_args: {settings.environment} does not take them ({e})") from e
    if not isinstance(probe, Environment):
      raise ConfigError(f"{FIELD}.environment: {settings.environment} made a "
                        f"{type(probe).__name__}, not an openenv Environment")
    concurrent = type(probe).SUPPORTS_CONCURRENT_SESSIONS
    probe.close()
    self.to_action = (import_object(settings.action, f"{FIELD}.action") if settings.action
                      else default_action(self.action_type))
    self.observation_text = (
        import_object(settings.observation, f"{FIELD}.observation") if settings.observation
        else default_observation_text)
    # An environment that cannot hold concurrent sessions gets one server session at a time;
    # the episodes queue for it (in process, every episode has its own instance).
    self._capacity = 64 if concurrent else 1
    self._server = (LocalOpenEnvServer(self._factory, self.action_type, self.observation_type,
                                       self._capacity)
                    if settings.transport == "server" else None)
    self._gates: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

  def close(self) -> None:
    """Stops the local server (transport "server"); in-process needs nothing."""
    if self._server is not None:
      self._server.close()

  def _session(self):
    if self._server is None:
      return _InProcessSession(self._factory), contextlib.nullcontext()
    loop = asyncio.get_running_loop()
    gate = self._gates.setdefault(loop, asyncio.Semaphore(self._capacity))
    return _ServerSession(self._server.url), gate

  def _action(self, reply: str) -> tuple[Action | None, str | None]:
    """The Action the reply makes, or (None, the reason it makes none)."""
    try:
      return self.action_type.model_validate(self.to_action(reply)), None
    except pydantic.ValidationError as e:
      reasons = "; ".join(f"{'.'.join(str(p) for p in error['loc']) or 'action'}: {error['msg']}"
                          for error in e.errors())
      return None, f"Invalid action: {reasons}"
    except (ValueError, TypeError) as e:
      return None, f"Invalid action: {e}"

  async def __call__(self, client: Any, example: Any) -> dict[str, float]:
    """One episode; `example` is a dict of reset's fields or a trainer Example whose metadata
    holds them (`hub_support.example_fields`)."""
    example = example_fields(example)
    session, gate = self._session()
    messages: list[dict[str, str]] = []
    if self.settings.system_prompt:
      messages.append({"role": "system", "content": self.settings.system_prompt})
    total, done, turns = 0.0, False, 0
    async with gate:
      try:
        fields, reward, done = await session.reset(example)
        total += reward or 0.0
        messages.append({"role": "user", "content": self.observation_text(fields)})
        while not done and turns < self.settings.max_turns:
          limit = ({"max_tokens": self.settings.turn_tokens} if self.settings.turn_tokens
                   else {})
          completion = await client.chat.completions.create(model=self.settings.model,
                                                            messages=messages, **limit)
          reply = completion.choices[0].message.content or ""
          turns += 1
          messages.append({"role": "assistant", "content": reply})
          action, problem = self._action(reply)
          if action is None:
            messages.append({"role": "user", "content": problem})
            continue
          fields, reward, done = await session.step(action)
          total += reward or 0.0
          if not done:
            messages.append({"role": "user", "content": self.observation_text(fields)})
      finally:
        await session.close()
    return {"reward": float(total)}


def make_agent(environment: str, env_args: Mapping[str, Any] | None = None, **settings: Any
               ) -> OpenEnvHubAgent:
  """The agent function for OpenEnv environment `environment` (module docstring for the other
  settings: transport, action, observation, system_prompt, max_turns, turn_tokens, model)."""
  return OpenEnvHubAgent(OpenEnvSettings(environment=environment, env_args=dict(env_args or {}),
                                         **settings))


@takes_agent_settings
def agent_from_settings(settings: Mapping[str, Any]) -> OpenEnvHubAgent:
  """`make_agent` from the plain dict of `config.agent` (the keys the module docstring lists;
  other keys of the section are the trainer's and are ignored)."""
  names = {f.name for f in dataclasses.fields(OpenEnvSettings)}
  chosen = {k: v for k, v in settings.items() if k in names and v is not None}
  return OpenEnvHubAgent(OpenEnvSettings(**{"environment": "", **chosen}))
