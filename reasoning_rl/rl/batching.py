"""From scored groups of completions to the fixed-shape arrays of the training step.

Shapes never depend on the data: every row is `prompt (left-padded to prompt_length)` +
`completion (right-padded to completion_length)`, and a batch always has `num_rows` rows (rows
without a group are fully masked and contribute nothing), so the step compiles once.

Advantages are not computed here: they are the loop's own stage before batching
(`rl.advantages.batch_advantages`), so what the rollout records show is what the loss uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class ScoredGroup:
  """The G completions of one prompt with their rewards.

  Attributes:
    prompt_tokens: the prompt as prefilled.
    completion_ids, logprobs: per sample; logprobs are the sampler's (unscaled model distribution).
    rewards: total reward per sample.
    parts: per reward part, the unweighted value per sample.
    truncated: per sample.
    sampling_logprobs: per sample, the sampler's log-probs under the distribution it drew from
      (temperature, top-k / top-p / min-p; docs/off_policy.md), or None when not recorded.
    sampling: the settings the group was sampled with (temperature, top_p, top_k, min_p), or None
      when not recorded; `build_batch(..., truncation=True)` needs both.
    loss_masks: per sample, 1 for each token the model chose and 0 for each environment-observation
      token of a multi-turn episode (`sampler.multiturn`); None when every token is the model's.
      Observation tokens stay in the sequence (attended to) but out of the loss, KL and counts.
    experts: mixture-of-experts models: per sample, the experts the sampler routed each prompt and
      completion token to, [len(prompt) + len(completion), L_sparse, k] (`Completion.experts`);
      None when not recorded.
  """

  prompt_tokens: list[int]
  completion_ids: list[list[int]]
  logprobs: list[list[float]]
  rewards: list[float]
  parts: dict[str, list[float]]
  truncated: list[bool]
  sampling_logprobs: list[list[float]] | None = None
  sampling: dict | None = None
  loss_masks: list[list[int]] | None = None
  experts: list[np.ndarray] | None = None

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


def pad_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
             num_rows: int, prompt_length: int, completion_length: int, pad_id: int,
             loss_masks: Sequence[Sequence[int] | None] | None = None):
  """(tokens, attention_mask [R, P + T], completion_mask [R, T]) for prompt/completion pairs.

  Prompts are left-padded (their last `prompt_length` tokens kept), completions right-padded
  (their first `completion_length` kept); rows past the pairs are padding, fully masked.
  `loss_masks` (per completion, or None): where given, completion_mask holds it instead of 1s, so
  observation tokens are attended to (attention 1) but not trained on.
  """
  width = prompt_length + completion_length
  tokens = np.full((num_rows, width), pad_id, np.int32)
  attention = np.zeros((num_rows, width), np.int32)
  completion_mask = np.zeros((num_rows, completion_length), np.int32)
  for row, (prompt, completion) in enumerate(zip(prompts, completions)):
    prompt = list(prompt)[-prompt_length:]
    completion = list(completion)[:completion_length]
    tokens[row, prompt_length - len(prompt):prompt_length] = prompt
    attention[row, prompt_length - len(prompt):prompt_length + len(completion)] = 1
    tokens[row, prompt_length:prompt_length + len(completion)] = completion
    mask = loss_masks[row] if loss_masks is not None else None
    completion_mask[row, :len(completion)] = 1 if mask is None else list(mask)[:len(completion)]
  return tokens, attention, completion_mask


def routing_rows(groups: Sequence[ScoredGroup], num_rows: int, prompt_length: int,
                 completion_length: int) -> np.ndarray:
  """The groups' recorded experts laid out as `pad_rows` lays out their tokens: [num_rows,
  prompt_length + completion_length, L_sparse, k], prompts left-padded (their last
  prompt_length tokens kept), completions right-padded, zeros elsewhere."""
  routed = [(g, e) for g, group in enumerate(groups) for e in (group.experts or [None])]
  missing = [g for g, experts in routed if experts is None]
  if missing:
    raise ValueError(f"group {missing[0]} has no recorded experts, which a mixture-of-experts "
                     "batch needs (algo.routing_replay, routing metrics): sample it with the "
                     "engine backend, which records them")
  sample = routed[0][1]
  out = np.zeros((num_rows, prompt_length + completion_length, *sample.shape[1:]), sample.dtype)
  row = 0
  for group in groups:
    prompt = len(group.prompt_tokens)
    for completion, experts in zip(group.completion_ids, group.experts):
      kept_prompt = experts[:prompt][-prompt_length:]
      kept_completion = experts[prompt:prompt + len(completion)][:completion_length]
      out[row, prompt_length - len(kept_prompt):prompt_length] = kept_prompt
      out[row, prompt_length:prompt_length + len(kept_completion)] = kept_completion
      row += 1
  return out


# Sampling settings under which the sampler draws from the model's own distribution.
UNTRUNCATED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# The batch's per-row sampling settings [B] that `algo.truncated_ratio` reads, in the order
# `reasoning_rl.sampler.sampling.truncated_logprobs` takes them.
TRUNCATION_FIELDS = tuple(f"sampling_{name}" for name in UNTRUNCATED)


def build_batch(groups: Sequence[ScoredGroup], advantages: np.ndarray | None, *, num_groups: int,
                group_size: int, prompt_length: int, completion_length: int, pad_id: int,
                with_rewards: bool = False, with_behavior_logprobs: bool = False,
                truncation: bool = False, with_routing: bool = False) -> dict[str, np.ndarray]:
  """The arrays of `TrainStep` for the scored groups and their advantages.

  `advantages` [num_groups, G]: the advantage stage's (`rl.advantages.batch_advantages`), or None
  where the step computes its own (PPO's GAE from its value head: the batch then carries zeros,
  which the step replaces, and the sequence rewards).

  Returns numpy arrays: tokens, attention_mask [R, prompt_length + completion_length],
  completion_mask [R, completion_length], advantages [R] and, if asked, rewards [R] (PPO's value
  targets) and behavior_logprobs [R, completion_length] (the sampler's log-probs, for importance
  correction); R = num_groups · G. Missing groups (dynamic sampling came up short) are fully
  masked rows.

  With `truncation` (`algo.truncated_ratio`, docs/off_policy.md) the batch also holds each row's
  sampling settings, sampling_temperature, sampling_top_p, sampling_min_p [R] float32 and
  sampling_top_k [R] int32 (fully masked rows: temperature 1, no filter), and behavior_logprobs
  are always there and are the sampler's log-probs under the distribution it drew from (a greedy
  group's: the model's own, the point mass having no log-prob to correct with).

  With `with_routing` (mixture-of-experts models) the batch also holds recorded_experts
  [R, prompt_length + completion_length, L_sparse, k]: each token's experts as the sampler chose
  them, laid out like `tokens` (0 at padding).
  """
  groups = list(groups[:num_groups])
  rows = num_groups * group_size
  rewards = np.zeros((num_groups, group_size), np.float32)
  for g, group in enumerate(groups):
    if group.size != group_size:
      raise ValueError(f"group {g} has {group.size} samples, expected {group_size}")
    rewards[g] = group.rewards
  if advantages is None:
    advantages = np.zeros((num_groups, group_size), np.float32)
  elif np.shape(advantages) != (num_groups, group_size):
    raise ValueError(f"advantages have shape {np.shape(advantages)}, expected "
                     f"{(num_groups, group_size)} (rl.advantages.batch_advantages)")
  tokens, attention, completion_mask = pad_rows(
      [g.prompt_tokens for g in groups for _ in range(group_size)],
      [ids for g in groups for ids in g.completion_ids], num_rows=rows,
      prompt_length=prompt_length, completion_length=completion_length, pad_id=pad_id,
      loss_masks=[mask for g in groups
                  for mask in (g.loss_masks or [None] * group_size)])
  batch = {"tokens": tokens, "attention_mask": attention, "completion_mask": completion_mask,
           "advantages": np.asarray(advantages, np.float32).reshape(-1)}
  if with_rewards:
    batch["rewards"] = rewards.reshape(-1)
  if truncation:
    settings = {name: np.full(rows, value, np.int32 if name == "top_k" else np.float32)
                for name, value in UNTRUNCATED.items()}
    behavior_rows = []
    for g, group in enumerate(groups):
      if group.sampling is None or group.sampling_logprobs is None:
        raise ValueError(f"group {g} has no recorded sampling settings / sampling log-probs, "
                         "which truncation=True (algo.truncated_ratio) needs: collect it with "
                         "loop.rollouts.RolloutCollector, which records them")
      for name, values in settings.items():
        values[g * group_size:(g + 1) * group_size] = group.sampling.get(name, UNTRUNCATED[name])
      greedy = group.sampling["temperature"] <= 0
      behavior_rows += group.logprobs if greedy else group.sampling_logprobs
    for name, values in settings.items():
      batch[f"sampling_{name}"] = values
  if with_routing:
    batch["recorded_experts"] = routing_rows(groups, rows, prompt_length, completion_length)
  if with_behavior_logprobs or truncation:
    behavior = np.zeros((rows, completion_length), np.float32)
    for row, logprobs in enumerate(behavior_rows if truncation
                                   else (lp for g in groups for lp in g.logprobs)):
      logprobs = logprobs[:completion_length]
      behavior[row, :len(logprobs)] = logprobs
    batch["behavior_logprobs"] = behavior
  return batch
