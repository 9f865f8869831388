"""`guess_number`: find a secret integer by guessing, told "higher" or "lower" after each guess.

Interactive by nature: the answer cannot be written in one turn without luck, so the policy has to
use the observations (binary search takes ceil(log2(high - low + 1)) guesses: 7 for 1..100).

The task source `guess_number` (`data.<split>.kind`) makes the examples: the secret of index i is
drawn uniformly from [low, high] by a generator seeded with (seed, i) and is the example's
`answer`; the prompt states the range and the protocol. The environment reads the secret from the
example, not from the episode's seed: the G samples of a group chase the same number, so their
group advantages compare strategies, not luck.

Protocol: a guess is `<guess>N</guess>` (the turn ends at "</guess>"). Observations (exact):
"higher" (the secret is higher than N), "lower", "out of range: the number is between {low} and
{high}", "invalid guess: write one integer, e.g. <guess>{midpoint}</guess>". A correct guess ends
the episode (done, no observation); so do a turn without a guess tag and the `max_guesses`-th
wrong guess. Reward parts: correct (1.0 / 0.0) and turns_used (model turns the episode took,
the final one included; weight it negatively to reward short searches).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from reasoning_rl import config_groups, registries
from reasoning_rl.data import tasks
from reasoning_rl.data.tasks import Example
from reasoning_rl.environments.base import Turn
from reasoning_rl.errors import ConfigError

NAME = "guess_number"
TASK = "guess_number"
STOP_STRING = "</guess>"
GUESS = re.compile(r"<guess>(.*?)</guess>", re.DOTALL)
# Declared (default, range, meaning) in the config schema, which also checks them.
SETTINGS = config_groups.ENVIRONMENTS[NAME]
PROMPT = ("I am thinking of an integer between {low} and {high} (both included). Find it. Write "
          "one guess per turn as <guess>N</guess>; after each guess I answer higher (the number is "
          "higher than N), lower, or stop when you are right.")


@dataclasses.dataclass(frozen=True)
class GuessNumberSource:
  """Endless examples: the secret of index i uniform in [low, high], from a generator seeded with
  (seed, i) (every index independent of the others)."""

  seed: int = 0
  low: int = 1
  high: int = 100
  kind: str = TASK

  def example(self, index: int) -> Example:
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
      raise ValueError(f"example index must be an integer >= 0, got {index!r}")
    index = int(index)
    secret = int(np.random.default_rng([self.seed, index]).integers(self.low, self.high + 1))
    return Example(uid=f"{TASK}/{self.seed}/{self.low}-{self.high}/{index}",
                   prompt=PROMPT.format(low=self.low, high=self.high), answer=str(secret),
                   task=TASK, metadata={"low": self.low, "high": self.high,
                                        "source_index": index})


@tasks.register_source(TASK, summary="find a secret integer in [low, high] by guessing (the "
                       "guess_number environment's task)")
def _guess_number_source(values, field) -> GuessNumberSource:
  if values["high"] <= values["low"]:  # one setting against another: the declarations cannot
    raise ConfigError(f"config.{field}.high={values['high']!r}: must be an integer above low "
                      f"({values['low']})")
  return GuessNumberSource(seed=values["seed"], low=values["low"], high=values["high"])


class GuessNumberEnvironment:
  """The guessing game (module docstring). Settings: max_guesses."""

  name = NAME
  turn_stop_strings = (STOP_STRING,)

  def __init__(self, settings: Mapping[str, Any] | None = None, *,
               field: str = "environment.settings"):
    self.settings = SETTINGS.resolve(settings, field=field, floats=True)
    self.max_guesses = self.settings["max_guesses"]

  def reset(self, example: Example, *, seed: int) -> "GuessNumberEpisode":
    del seed  # the secret is the example's, the same for every sample of its group
    try:
      secret, low, high = int(example.answer), int(example.metadata["low"]), int(
          example.metadata["high"])
    except (KeyError, TypeError, ValueError):
      raise ConfigError(f"environment.name='guess_number': example {example.uid!r} is not a "
                        "guessing task (it needs answer = the secret and metadata low / high); "
                        "set data.train.kind and data.eval.kind to 'guess_number'") from None
    return GuessNumberEpisode(secret, low, high, self.max_guesses)

  def finish(self, episode: "GuessNumberEpisode") -> Turn:
    return episode.finish()


class GuessNumberEpisode:
  """One game: the secret, the range, the turns so far."""

  def __init__(self, secret: int, low: int, high: int, max_guesses: int):
    self.secret, self.low, self.high, self.max_guesses = secret, low, high, max_guesses
    self.turns = 0
    self.guesses = 0
    self.outcome: Turn | None = None
    self._lock = threading.Lock()

  def step(self, model_text: str) -> Turn:
    with self._lock:
      if self.outcome is not None:
        return self.outcome
      self.turns += 1
      match = GUESS.search(model_text)
      if match is None:
        return self._end(False, {"guess": None, "verdict": "no_guess"})
      self.guesses += 1
      text = match.group(1).strip()
      if not re.fullmatch(r"[+-]?\d{1,30}", text):
        midpoint = (self.low + self.high) // 2
        verdict = f"invalid guess: write one integer, e.g. <guess>{midpoint}</guess>"
        info = {"guess": None, "verdict": "invalid"}
      else:
        guess = int(text)
        info = {"guess": guess}
        if guess == self.secret:
          return self._end(True, dict(info, verdict="correct"))
        if not self.low <= guess <= self.high:
          verdict = f"out of range: the number is between {self.low} and {self.high}"
          info["verdict"] = "out_of_range"
        else:
          verdict = info["verdict"] = "higher" if guess < self.secret else "lower"
      if self.guesses >= self.max_guesses:
        return self._end(False, dict(info, out_of_guesses=True))
      return Turn(verdict, False, info=info)

  def finish(self) -> Turn:
    with self._lock:
      return self.outcome if self.outcome is not None else self._end(False, {"verdict": "ended"})

  def _end(self, correct: bool, info: dict[str, Any]) -> Turn:
    self.outcome = Turn(None, True, reward_parts={"correct": float(correct),
                                                  "turns_used": float(self.turns)},
                        info={**info, "guesses": self.guesses})
    return self.outcome


def build(settings: Mapping[str, Any] | None, *, field: str) -> GuessNumberEnvironment:
  return GuessNumberEnvironment(settings, field=field)


registries.ENVIRONMENTS.add(
    NAME, build, summary="find a secret integer by guessing, told higher / lower each turn "
    "(data kind guess_number)", options=SETTINGS.names())

__all__ = ["GuessNumberEnvironment", "GuessNumberEpisode", "GuessNumberSource", "NAME",
           "PROMPT", "STOP_STRING"]
