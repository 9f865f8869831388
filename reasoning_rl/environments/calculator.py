"""`calculator`: the model writes an arithmetic expression and "="; the environment writes the value.

The calculator of GSM8K's solutions (Cobbe et al. 2021, "Training Verifiers to Solve Math Word
Problems", §3: during sampling, when the model writes "=" after an expression, the calculator's
result is inserted in place of the model's own) and Toolformer's calculator calls (Schick et al.
2023), as a multi-turn environment: a model turn ends at "="; the expression right before it (the
longest run of digits, spaces, + - * / and parentheses that parses) is evaluated exactly
(`verifiers.logic.evaluate_arithmetic`, no Python `eval`), and the observation is its value,
appended right after the "=" (use `environment.observation_format = "raw"`), so the model goes on
from a correct intermediate result. A turn that ends otherwise (a stop id, the turn budget) ends
the episode.

The answer usually spans turns ("<answer>3+4=" · "7" · "</answer>"), and the calculator's values
are computed, not claimed: the verifiers read the whole conversation (`scores_conversation`).

Observations: the value as an integer ("12", "-3") or a reduced fraction ("7/2"); "error" for
text before "=" that is not an expression (and for division by zero). Deterministic: the value
depends on the model's text only.

It spells everything with digits and "+-*= " plus "error", so a tiny random model of the
character-level debug vocabulary (`data.debug_vocab`) plays it too (configs/debug_calculator.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from reasoning_rl import config_groups, registries
from reasoning_rl.environments.base import Turn
from reasoning_rl.verifiers.logic import InvalidExpression, evaluate_arithmetic

NAME = "calculator"
STOP_STRING = "="
ERROR = "error"
_EXPRESSION_TAIL = re.compile(r"[0-9+\-*/() ]*$")

# Declared (default, range, meaning) in the config schema, which also checks them.
SETTINGS = config_groups.ENVIRONMENTS[NAME]


def calculate(model_text: str) -> str:
  """The observation for a turn that ended at "=": the value of the expression before it."""
  before = model_text[:-len(STOP_STRING)] if model_text.endswith(STOP_STRING) else model_text
  tail = _EXPRESSION_TAIL.search(before).group(0)
  # the longest suffix that parses: "<answer>12+3" → "12+3"; "4)*2" → ")*2" fails, "*2" fails,
  # "2" parses — so trim from the left until something parses
  for start in range(len(tail)):
    candidate = tail[start:].strip()
    if not candidate:
      break
    try:
      value, _ = evaluate_arithmetic(candidate)
    except InvalidExpression:
      continue
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
  return ERROR


class CalculatorEpisode:
  def __init__(self, max_calls: int):
    self.max_calls = max_calls
    self.calls = 0

  def step(self, model_text: str) -> Turn:
    if not model_text.endswith(STOP_STRING) or self.calls >= self.max_calls:
      return Turn(None, True, {}, {"calls": self.calls})
    self.calls += 1
    observation = calculate(model_text)
    return Turn(observation, False, {}, {"calls": self.calls, "error": observation == ERROR})


class CalculatorEnvironment:
  """See the module docstring; `max_calls` bounds the calculator calls of one episode."""

  name = NAME
  turn_stop_strings = (STOP_STRING,)
  scores_conversation = True

  def __init__(self, max_calls: int):
    self.max_calls = max_calls

  def reset(self, example, *, seed: int) -> CalculatorEpisode:
    del example, seed  # nothing random, nothing hidden
    return CalculatorEpisode(self.max_calls)

  def finish(self, episode: CalculatorEpisode) -> Turn:
    return Turn(None, True, {}, {"calls": episode.calls})


def build(settings: Mapping[str, Any] | None, *, field: str = "environment.settings"
          ) -> CalculatorEnvironment:
  return CalculatorEnvironment(**SETTINGS.resolve(settings, field=field, floats=True))


registries.ENVIRONMENTS.add(
    NAME, build, summary="exact arithmetic after '=' (GSM8K's calculator, Cobbe et al. 2021; "
    "Toolformer, Schick et al. 2023); the verifiers read the whole conversation",
    options=SETTINGS.names())

__all__ = ["CalculatorEnvironment", "NAME", "calculate"]
