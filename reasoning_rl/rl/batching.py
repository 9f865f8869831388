"""From scored groups of completions to the fixed-shape arrays of the training step.

Shapes never depend on the data: every row is `prompt (left-padded to prompt_length)` +
`completion (right-padded to completion_length)`, and a batch always has `num_rows` rows (rows
without a group are fully masked and contribute nothing), so the step compiles once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from reasoning_rl.rl.advantages import group_advantages


@dataclasses.dataclass
class ScoredGroup:
  """The G completions of one prompt with their rewards.

  Attributes:
    prompt_tokens: the prompt as prefilled.
    completion_ids, logprobs: per sample; logprobs are the sampler's (unscaled model distribution).
    rewards: total reward per sample.
    parts: per reward part, the unweighted value per sample.
    truncated: per sample.
  """

  prompt_tokens: list[int]
  completion_ids: list[list[int]]
  logprobs: list[list[float]]
  rewards: list[float]
  parts: dict[str, list[float]]
  truncated: list[bool]

  @property
  def size(self) -> int:
    return len(self.rewards)

  @property
  def has_signal(self) -> bool:
    """False when every sample got the same reward: group-relative advantages are all zero."""
    return len(set(self.rewards)) > 1


def group_outcome_fractions(groups: Sequence[ScoredGroup], part: str | None = "correct"):
  """Shares of groups where every sample passed / failed.

  Pass and fail are read from the `part` reward part (1 = pass) when groups carry it, otherwise
  from the total reward (> 0 = pass).
  """
  if not groups:
    return {"groups/all_pass_frac": 0.0, "groups/all_fail_frac": 0.0}
  all_pass = all_fail = 0
  for group in groups:
    values = group.parts.get(part) if part else None
    passed = [v >= 1.0 for v in values] if values is not None else [r > 0 for r in group.rewards]
    all_pass += all(passed)
    all_fail += not any(passed)
  return {"groups/all_pass_frac": all_pass / len(groups),
          "groups/all_fail_frac": all_fail / len(groups)}


def build_batch(groups: Sequence[ScoredGroup], *, num_groups: int, group_size: int,
                prompt_length: int, completion_length: int, pad_id: int, estimator: str,
                with_behavior_logprobs: bool = False):
  """Arrays for `TrainStep` plus the advantage of every sample.

  Returns (batch, advantages [num_groups, G]) where batch holds numpy arrays: tokens,
  attention_mask [R, prompt_length + completion_length], completion_mask [R, completion_length],
  advantages [R], rewards [R] (for PPO) and, if asked, behavior_logprobs [R, completion_length];
  R = num_groups · G. Missing groups (dynamic sampling came up short) are fully masked rows.
  """
  rows = num_groups * group_size
  width = prompt_length + completion_length
  tokens = np.full((rows, width), pad_id, np.int32)
  attention = np.zeros((rows, width), np.int32)
  completion_mask = np.zeros((rows, completion_length), np.int32)
  behavior = np.zeros((rows, completion_length), np.float32)
  rewards = np.zeros((num_groups, group_size), np.float32)
  for g, group in enumerate(groups[:num_groups]):
    if group.size != group_size:
      raise ValueError(f"group {g} has {group.size} samples, expected {group_size}")
    rewards[g] = group.rewards
  advantages = np.zeros((num_groups, group_size), np.float32)
  if groups:
    present = min(len(groups), num_groups)
    advantages[:present] = np.asarray(
        group_advantages(rewards[:present].astype(np.float64), estimator=estimator),
        np.float32)
  for g, group in enumerate(groups[:num_groups]):
    prompt = group.prompt_tokens[-prompt_length:]
    for s in range(group_size):
      row = g * group_size + s
      completion = group.completion_ids[s][:completion_length]
      tokens[row, prompt_length - len(prompt):prompt_length] = prompt
      attention[row, prompt_length - len(prompt):prompt_length] = 1
      tokens[row, prompt_length:prompt_length + len(completion)] = completion
      attention[row, prompt_length:prompt_length + len(completion)] = 1
      completion_mask[row, :len(completion)] = 1
      behavior[row, :len(completion)] = group.logprobs[s][:len(completion)]
  batch = {"tokens": tokens, "attention_mask": attention, "completion_mask": completion_mask,
           "advantages": advantages.reshape(-1), "rewards": rewards.reshape(-1)}
  if with_behavior_logprobs:
    batch["behavior_logprobs"] = behavior
  return batch, advantages
