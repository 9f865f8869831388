"""Rows for the segments of split agent episodes past their first (`agent.segment_rows`).

An agent episode whose chat template rewrote its history (`agent.history_mismatch = split`,
docs/agents.md) is several token sequences, segments, each with its own prompt: the model saw
each one as it wrote it, and no one sequence holds them all. The episode's reward and its
group-relative advantage are the episode's, computed over the G episodes of its prompt (one row
each, holding the episode's first segment, whose prompt the group shares,
`agents.collector.groups_of`). Every segment is then a training sequence of its own with that
advantage — as verl, slime and prime-rl train turns whose history was rewritten: each a sample
carrying the trajectory's advantage.

Fixed shapes: the step compiles once, so the other segments go into a fixed number E of rows
appended to the step's batch (`agent.segment_rows`), after its P·G rows: the batch has
P·G + E rows, rows no segment fills are fully masked (they train nothing, and the packed layout
drops them). Segments beyond E are counted (`episode/split_segments_dropped`), not trained.

Loss normalizers: a segment is a sequence like any other row. Under `seq-mean-token-mean` (and
Dr. GRPO's `seq-mean-token-sum-norm`) an episode of k segments counts as k sequences in the
denominator, each segment's token mean weighted like one episode's; under `token-mean` every
model token weighs the same, whichever segment holds it (`rl.losses.loss_normalizers` counts
rows with a trained token, and tokens).

What it costs: the padded layout computes E more rows of prompt + completion positions every
step, filled or not. The packed layout (the RL default) packs only the segments that exist, but
its N sequence slots and rows per micro-batch grow by the factor (P·G + E) / (P·G), activation
memory per micro-batch with them (the memory plan counts the rows, `config.batch_rows`); a
micro-batch that holds any sequence computes all its rows and one that holds none is skipped, so
unused rows cost at most that factor, less where the sequences fill the packed rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from reasoning_rl.rl import batching
from reasoning_rl.rl.rollout_columns import RolloutColumns


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentRows:
  """A step's segments outside the groups' rows: `rollouts` holds one group of one sample per
  segment (each has its own prompt), `episode_sample` [segments] the sample of the step's record
  (g·G + s) that is its episode's row, whose advantage it takes."""

  rollouts: RolloutColumns
  episode_sample: np.ndarray  # [segments] int64

  @classmethod
  def empty(cls) -> "SegmentRows":
    return cls(RolloutColumns.empty(1), np.zeros(0, np.int64))

  def __len__(self) -> int:
    return self.rollouts.num_samples

  def with_episode_advantages(self, advantages) -> "SegmentRows":
    """These segments with their episodes' advantages: `advantages` [S] are the step's record's
    (`RolloutColumns.advantages`, the advantage stage's)."""
    values = np.asarray(advantages, np.float32).reshape(-1)
    return dataclasses.replace(
        self, rollouts=self.rollouts.with_advantages(values[self.episode_sample]))

  def to_json(self) -> dict:
    return {"rollouts": self.rollouts.to_json(), "episode_sample": self.episode_sample.tolist()}

  @classmethod
  def from_json(cls, item: dict) -> "SegmentRows":
    return cls(RolloutColumns.from_json(item["rollouts"]),
               np.array(item["episode_sample"], np.int64))

  def __eq__(self, other) -> bool:
    return isinstance(other, SegmentRows) and self.to_json() == other.to_json()


def with_segment_rows(batch: dict, segments: SegmentRows | None, *, capacity: int,
                      **build_options) -> dict:
  """`batch` (`batching.build_batch`'s, of the step's record) with `capacity` rows appended
  holding `segments` (as many as fit, in order) laid out as build_batch lays out its rows, each
  with its own prompt; rows past the segments are fully masked. `build_options`: the
  build_batch keywords the step's batch was built with (lengths, pad id, optional arrays)."""
  segments = segments if segments is not None else SegmentRows.empty()
  rollouts = segments.rollouts
  if rollouts.num_samples and rollouts.advantages is None:
    raise ValueError("the segments have no advantages: give them their episodes' "
                     "(SegmentRows.with_episode_advantages) before building the batch")
  routed = build_options.pop("with_routing", False) and rollouts.num_samples > 0
  extra = batching.build_batch(rollouts, num_groups=capacity, group_size=1,
                               with_routing=routed, **build_options)
  out = {}
  for name, value in batch.items():
    if name not in extra:  # recorded experts of a step without segments: zeros
      extra[name] = np.zeros((capacity, *value.shape[1:]), value.dtype)
    out[name] = np.concatenate([value, extra[name]])
  return out


__all__ = ["SegmentRows", "with_segment_rows"]
