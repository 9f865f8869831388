"""The contract between a multi-turn rollout and an environment (a tool, a game).

It mirrors the gym-style reset / step loop (Brockman et al. 2016, "OpenAI Gym") as tool-integrated
RL uses it (ToRL, Li et al. 2025, "ToRL: Scaling Tool-Integrated RL"; ReTool, Feng et al. 2025,
"ReTool: Reinforcement Learning for Strategic Tool Use in LLMs"):

    episode = environment.reset(example, seed=s)       # one episode per sample
    turn = episode.step(model_text)                    # the model's text of this turn only
    ... until turn.done, or the rollout ends it:  turn = environment.finish(episode)

What every environment promises (`sampler.multiturn` relies on it):
- Determinism: the observations and the outcome depend on (example, seed, model texts) only, so a
  resumed run regenerates the same episodes. Observations hold no wall-clock text; the one
  exception is a timeout, which is reported in `info["timed_out"]`.
- `step` never raises for anything the model wrote: crashes, syntax errors, timeouts and huge
  outputs become observations.
- `step` and `finish` may run on worker threads, different episodes at once.
- `info` is JSON-safe (it goes into the rollout records).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # only for annotations: environments do not need the data layer to load
  from reasoning_rl.data.tasks import Example


@dataclasses.dataclass(frozen=True)
class Turn:
  """The environment's answer to one model turn.

  observation: the environment's message text; None iff done.
  done: the episode is over (its outcome is in reward_parts).
  reward_parts: the episode's outcome when done (e.g. {"correct": 1.0}); empty before.
  info: JSON-safe facts about this turn for the rollout records (tool call, exit status,
    timed_out, seconds, truncated, …).
  """

  observation: str | None
  done: bool
  reward_parts: Mapping[str, float] = dataclasses.field(default_factory=dict)
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if (self.observation is None) != self.done:
      raise ValueError(f"Turn: observation must be None iff done (done={self.done}, "
                       f"observation={self.observation!r})")


class Episode(Protocol):
  """One sample's episode: answers the model's turns."""

  def step(self, model_text: str) -> Turn:
    """Answers one model turn (`model_text`: this turn's text only)."""
    ...


class Environment(Protocol):
  """A kind of episode, with its settings (built by `environments.build_environment`).

  name: the registry name; turn_stop_strings: strings that end a model turn on the host (e.g.
  "</python>"), kept in the turn's text.
  """

  name: str
  turn_stop_strings: tuple[str, ...]

  def reset(self, example: "Example", *, seed: int) -> Episode:
    """A new episode on `example`; `seed` fixes whatever the episode draws at random."""
    ...

  def finish(self, episode: Episode) -> Turn:
    """The outcome of an episode the rollout ends itself (turn limit, token budget, the model
    stopped): a Turn with done=True and its reward_parts."""
    ...
