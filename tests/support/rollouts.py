"""Rollout records (`RolloutColumns`) written by hand, built the way the collector builds them:
through `RolloutColumns.of_group` from `Completion`s and `Reward`s."""

from __future__ import annotations

import types

from reasoning_rl.rl.rollout_columns import RolloutColumns
from reasoning_rl.sampler.api import Completion
from reasoning_rl.verifiers.rewards import Reward


def sampling_settings(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0):
  """What `of_group` reads of a `SamplingParams`."""
  return types.SimpleNamespace(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)


def group(rewards, completions, *, position=0, prompt=(5, 6, 7), logprobs=None,
          sampling_logprobs=None, truncated=None, parts=None, responses=None, status="ok",
          sampling=None, loss_masks=None, experts=None, episodes=None, policy_version=0
          ) -> RolloutColumns:
  """One group of len(rewards) samples. `completions`: per sample its token ids, or an int n
  (tokens 1..n). `logprobs` default −0.5 per token; `parts` default {"correct": rewards}."""
  size = len(rewards)
  ids = [list(range(1, c + 1)) if isinstance(c, int) else list(c) for c in completions]
  logprobs = logprobs or [[-0.5] * len(i) for i in ids]
  parts = parts if parts is not None else {"correct": list(rewards)}
  samples = [Completion(
      prompt_id=position, sample_index=s, prompt_tokens=list(prompt), completion_ids=ids[s],
      logprobs=list(logprobs[s]),
      sampling_logprobs=None if sampling_logprobs is None else list(sampling_logprobs[s]),
      finish_reason="length" if truncated and truncated[s] else "stop_id",
      truncated=bool(truncated[s]) if truncated else False, policy_version=policy_version,
      loss_mask=None if loss_masks is None else list(loss_masks[s]),
      turns=None if episodes is None else episodes[s]["turns"],
      episode_end=None if episodes is None else episodes[s]["episode_end"],
      reward_parts=None if episodes is None else episodes[s]["environment_parts"],
      experts=None if experts is None else experts[s]) for s in range(size)]
  scores = [Reward(total=float(rewards[s]), parts={k: v[s] for k, v in parts.items()},
                   verifier_version="test") for s in range(size)]
  return RolloutColumns.of_group(position, samples, responses or [f"r{s}" for s in range(size)],
                                 status=status, rewards=scores, sampling=sampling)


def record(*groups: RolloutColumns) -> RolloutColumns:
  """The groups as one record (their group size: the first's)."""
  return RolloutColumns.concat(groups, group_size=groups[0].group_size)
