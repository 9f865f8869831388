"""From the rollout record (`rl.rollout_columns.RolloutColumns`) to the fixed-shape arrays of the
training step: its samples become the batch's rows, in order (sample g·G + s → row g·G + s).

Shapes never depend on the data: every row is `prompt (left-padded to prompt_length)` +
`completion (right-padded to completion_length)`, and a batch always has `num_rows` rows (rows
without a group are fully masked and contribute nothing), so the step compiles once.

Advantages are not computed here: they are the loop's own stage before batching
(`rl.advantages.batch_advantages`, kept in the record as `advantages`), so what the rollout
records show is what the loss uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from reasoning_rl.rl.rollout_columns import RolloutColumns


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


def routing_rows(rollouts: RolloutColumns, num_rows: int, prompt_length: int,
                 completion_length: int) -> np.ndarray:
  """The record's experts laid out as `pad_rows` lays out its tokens: [num_rows,
  prompt_length + completion_length, L_sparse, k], prompts left-padded (their last
  prompt_length tokens kept), completions right-padded, zeros elsewhere."""
  if rollouts.experts is None:
    raise ValueError("the rollouts have no recorded experts, which a mixture-of-experts batch "
                     "needs (algo.routing_replay, routing metrics): sample them with the engine "
                     "backend, which records them")
  experts = rollouts.experts
  out = np.zeros((num_rows, prompt_length + completion_length, *experts.values.shape[1:]),
                 experts.values.dtype)
  prompt_lengths = rollouts.prompt_tokens.lengths
  for row, routed in enumerate(experts.rows()):
    prompt = int(prompt_lengths[row // rollouts.group_size])
    completion = int(rollouts.completion_ids.lengths[row])
    kept_prompt = routed[:prompt][-prompt_length:]
    kept_completion = routed[prompt:prompt + completion][:completion_length]
    out[row, prompt_length - len(kept_prompt):prompt_length] = kept_prompt
    out[row, prompt_length:prompt_length + len(kept_completion)] = kept_completion
  return out


# Sampling settings under which the sampler draws from the model's own distribution.
UNTRUNCATED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# The batch's per-row sampling settings [B] that `algo.truncated_ratio` reads, in the order
# `reasoning_rl.sampler.sampling.truncated_logprobs` takes them.
TRUNCATION_FIELDS = tuple(f"sampling_{name}" for name in UNTRUNCATED)


def build_batch(rollouts: RolloutColumns, *, num_groups: int, group_size: int,
                prompt_length: int, completion_length: int, pad_id: int,
                with_rewards: bool = False, with_behavior_logprobs: bool = False,
                truncation: bool = False, with_routing: bool = False) -> dict[str, np.ndarray]:
  """The arrays of `TrainStep` for the record's first `num_groups` groups.

  Advantages are the record's (`RolloutColumns.advantages`, the advantage stage's), or zeros
  where it has none: PPO's step computes its own (GAE from its value head), and the batch then
  carries the sequence rewards. A record with per-token advantages (`token_advantages`, on-policy
  distillation's, `rl.distillation`) gives advantages [R, completion_length] instead, each row's
  right-padded with zeros (the loss takes [B] or [B, T] alike).

  Returns numpy arrays: tokens, attention_mask [R, prompt_length + completion_length],
  completion_mask [R, completion_length], advantages [R] (or [R, completion_length]) and, if
  asked, rewards [R] (PPO's value targets) and behavior_logprobs [R, completion_length] (the
  sampler's log-probs, for importance correction); R = num_groups · G. Missing groups (dynamic
  sampling came up short) are fully masked rows.

  With `truncation` (`algo.truncated_ratio`, docs/off_policy.md) the batch also holds each row's
  sampling settings, sampling_temperature, sampling_top_p, sampling_min_p [R] float32 and
  sampling_top_k [R] int32 (fully masked rows: temperature 1, no filter), and behavior_logprobs
  are always there and are the sampler's log-probs under the distribution it drew from (a greedy
  group's: the model's own, the point mass having no log-prob to correct with).

  With `with_routing` (mixture-of-experts models) the batch also holds recorded_experts
  [R, prompt_length + completion_length, L_sparse, k]: each token's experts as the sampler chose
  them, laid out like `tokens` (0 at padding).
  """
  if rollouts.group_size != group_size and rollouts.num_groups:
    raise ValueError(f"the rollouts have groups of {rollouts.group_size} samples, expected "
                     f"{group_size}")
  if rollouts.num_groups > num_groups:
    rollouts = rollouts.take_groups(range(num_groups))
  rows, present = num_groups * group_size, rollouts.num_samples
  if rollouts.token_advantages is not None:
    advantages = np.zeros((rows, completion_length), np.float32)
    for row, values in enumerate(rollouts.token_advantages.rows()):
      values = values[:completion_length]
      advantages[row, :len(values)] = values
  else:
    advantages = np.zeros(rows, np.float32)
    if rollouts.advantages is not None:
      advantages[:present] = rollouts.advantages
  prompts = rollouts.prompt_tokens.rows()
  tokens, attention, completion_mask = pad_rows(
      [prompts[row // group_size] for row in range(present)], rollouts.completion_ids.rows(),
      num_rows=rows, prompt_length=prompt_length, completion_length=completion_length,
      pad_id=pad_id,
      loss_masks=rollouts.loss_mask.rows() if rollouts.loss_mask is not None else None)
  batch = {"tokens": tokens, "attention_mask": attention, "completion_mask": completion_mask,
           "advantages": advantages}
  if with_rewards:
    rewards = np.zeros(rows, np.float32)
    rewards[:present] = rollouts.rewards
    batch["rewards"] = rewards
  if truncation:
    if rollouts.sampling is None and present:
      raise ValueError("the rollouts have no recorded sampling settings, which truncation=True "
                       "(algo.truncated_ratio) needs: collect them with "
                       "loop.rollouts.RolloutCollector, which records them")
    for name, untruncated in UNTRUNCATED.items():
      values = np.full(rows, untruncated, np.int32 if name == "top_k" else np.float32)
      if present:
        values[:present] = np.repeat(rollouts.sampling[name], group_size)
      batch[f"sampling_{name}"] = values
    # a greedy group's behaviour log-probs are the model's own
    greedy = np.repeat(rollouts.sampling["temperature"] <= 0, group_size) if present else []
    behavior_rows = [model if g else warped for model, warped, g in zip(
        rollouts.logprobs.rows(), rollouts.sampling_logprobs.rows(), greedy)]
  else:
    behavior_rows = rollouts.logprobs.rows()
  if with_routing:
    batch["recorded_experts"] = routing_rows(rollouts, rows, prompt_length, completion_length)
  if with_behavior_logprobs or truncation:
    behavior = np.zeros((rows, completion_length), np.float32)
    for row, logprobs in enumerate(behavior_rows):
      logprobs = logprobs[:completion_length]
      behavior[row, :len(logprobs)] = logprobs
    batch["behavior_logprobs"] = behavior
  return batch
