"""Guess the number as an OpenEnv environment (`openenv.core.Environment`).

reset(target=..., max_guesses=...) opens an episode; each step takes a GuessAction. A right guess
ends it with reward +1; a wrong one scores -0.25 and says "higher" or "lower"; the episode also
ends after max_guesses guesses. `app` serves it the way an OpenEnv space does (create_app).
"""

from __future__ import annotations

import uuid
from typing import Any

from openenv.core import Action, Environment, Observation, State, create_app

__all__ = ["GuessAction", "GuessObservation", "GuessEnvironment", "app"]

RIGHT = 1.0
WRONG = -0.25


class GuessAction(Action):
  guess: int


class GuessObservation(Observation):
  feedback: str


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):

  def __init__(self, low: int = 1, high: int = 10):
    super().__init__()
    self.low, self.high = low, high
    self._state = State()
    self.target = low
    self.max_guesses = 3

  def reset(self, seed: int | None = None, episode_id: str | None = None, target: int = 7,
            max_guesses: int = 3, **unused: Any) -> GuessObservation:
    self.target, self.max_guesses = int(target), int(max_guesses)
    self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
    return GuessObservation(feedback=f"I am thinking of a number from {self.low} to {self.high}. "
                            f"You have {self.max_guesses} guesses. Reply with a number.")

  def step(self, action: GuessAction, timeout_s: float | None = None,
           **unused: Any) -> GuessObservation:
    self._state.step_count += 1
    if action.guess == self.target:
      return GuessObservation(feedback="Right!", reward=RIGHT, done=True)
    hint = "higher" if action.guess < self.target else "lower"
    out_of_guesses = self._state.step_count >= self.max_guesses
    return GuessObservation(feedback=f"Wrong, {hint}.", reward=WRONG, done=out_of_guesses)

  @property
  def state(self) -> State:
    return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="rrl_openenv_guess")
