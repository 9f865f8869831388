"""Environments for multi-turn rollouts: the model acts (runs code, guesses), the environment
answers, over several turns of one sample (`sampler.multiturn` drives them).

- `base`: the contract (`Turn`, `Episode`, `Environment`): gym-style reset / step, deterministic,
  never raising for the model's text, thread-safe.
- `python_tool`: `<python>` blocks run in the code sandbox; the task's verifier judges the final
  turn (ToRL, Li et al. 2025; ReTool, Feng et al. 2025).
- `calculator`: exact arithmetic after "=" (GSM8K's calculator; a tiny debug model plays it).
- `guess_number`: find a secret integer from higher / lower answers (with its task source).
- `formatting`: an observation as the exact text appended after the model's turn (inline / chat).

`build_environment(name, settings)` looks the name up in `registries.ENVIRONMENTS` and builds it,
checking its settings; importing this package registers the built-in environments (and the
`guess_number` task source).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reasoning_rl import registries
from reasoning_rl.environments import calculator, guess_number, python_tool
from reasoning_rl.environments.base import Environment, Episode, Turn
from reasoning_rl.environments.formatting import (OBSERVATION_FORMATS, format_observation,
                                                  observation_formatter)


def build_environment(name: str, settings: Mapping[str, Any] | None = None, *,
                      field: str = "environment") -> Environment:
  """The environment `name` of `registries.ENVIRONMENTS` with its `settings` checked.

  field: the config section; errors name `config.<field>.name` and `config.<field>.settings.<x>`.

  Raises:
    ConfigError: an unknown name, an unknown setting, or a setting of the wrong type or range.
  """
  choice = registries.ENVIRONMENTS.get(name, field=f"{field}.name")
  return choice.impl(settings, field=f"{field}.settings")


__all__ = ["Environment", "Episode", "OBSERVATION_FORMATS", "Turn", "build_environment",
           "calculator", "format_observation", "guess_number", "observation_formatter",
           "python_tool"]
