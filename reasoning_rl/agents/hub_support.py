"""What the hub adapters (verifiers_hub, openenv_hub) share: their errors, the factory mark the
trainer's agent loader reads, and reading an `module:attr` setting.

An agent entry (`config.agent.entry`) names an async function
`run(client: openai.AsyncOpenAI, example: dict) -> float | dict[str, float]`. A hub adapter needs
settings (which environment, its arguments) before it can be one, so its entry names a factory
instead, marked `takes_agent_settings`: the loader calls it once with the plain dict of the
`config.agent` section and uses what it returns as the agent function.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from reasoning_rl.errors import ConfigError, ReasoningRLError

F = TypeVar("F", bound=Callable[..., Any])


class HubEpisodeError(ReasoningRLError):
  """A hub environment's episode failed (its harness crashed, a model call failed, scoring did
  not run): there is no reward to train on. The message carries the environment's own error."""


def takes_agent_settings(factory: F) -> F:
  """Marks `factory(settings: Mapping) -> agent function` for the trainer's agent loader."""
  factory.takes_agent_settings = True
  return factory


def import_object(path: str, field: str) -> Any:
  """The object `path` ("package.module:attribute") names; ConfigError naming `field` if it
  cannot be imported."""
  module_name, sep, attribute = str(path).partition(":")
  if not sep or not module_name or not attribute:
    raise ConfigError(f"{field}: {path!r} is not 'package.module:attribute'; set it to the "
                      "import path of the object")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ConfigError(f"{field}: cannot import {module_name!r} ({e}); install the package that "
                      "provides it or fix the path") from e
  try:
    return getattr(module, attribute)
  except AttributeError:
    raise ConfigError(f"{field}: module {module_name!r} has no {attribute!r}; fix the "
                      "attribute name") from None


def client_headers(client: Any) -> dict[str, str]:
  """The extra headers an `openai.AsyncOpenAI` client sends on every request (its
  default_headers argument), without the SDK's own and its auth: what a second HTTP client
  must repeat to reach the same session of the trainer's server."""
  sdk_headers = {"accept", "content-type", "user-agent", "authorization"}
  return {name: value for name, value in dict(client.default_headers).items()
          if isinstance(value, str) and name.lower() not in sdk_headers
          and not name.lower().startswith("x-stainless")}


def example_fields(example: Any) -> dict[str, Any]:
  """The fields of one example an adapter plays: a mapping as it is, or the `metadata` of the
  trainer's `data.tasks.Example` (a task of `data.train.kind='agent'` is its task dict there; a
  JSONL row's extra keys are there too)."""
  if isinstance(example, Mapping):
    return dict(example)
  metadata = getattr(example, "metadata", None)
  if isinstance(metadata, Mapping):
    return dict(metadata)
  raise TypeError(f"an example is a dict of the task's fields or a task example with metadata, "
                  f"got {type(example).__name__}")
