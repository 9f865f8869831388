"""A step's metrics row and rollout records, as pure functions of what the step produced.

Keys are the public metrics contract (docs/architecture.md lists them). Times are measured by the
caller and passed in; nothing here reads a clock, a device or a file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from reasoning_rl.loop.state import SampledBatch
from reasoning_rl.rl.distillation import distillation_metrics
from reasoning_rl.rl.rollout_columns import RolloutColumns
from reasoning_rl.sampler.api import array_to_json

# Keys of the step's own statistics that are promoted to the top level of the row.
TOP_LEVEL_STATS = ("loss", "kl", "entropy", "clip_frac", "skipped_update")


@dataclasses.dataclass(frozen=True)
class StepTimes:
  """Seconds of one RL step's phases (sampling and scoring come from the batch itself)."""

  train_s: float
  sync_s: float
  sample_ahead_s: float
  step_s: float
  compile_s: float = 0.0  # of step_s, lowering and compiling programs met for the first time


def rl_metrics(batch: SampledBatch, stats: Mapping[str, float], *, reward_parts: Sequence[str],
               policy_version: int, data_position: int) -> dict[str, Any]:
  """The deterministic part of an RL step's row (same config and seed → same numbers)."""
  rollouts = batch.rollouts
  rewards = rollouts.rewards if rollouts.num_samples else np.zeros(1)
  # the model's tokens: a multi-turn episode's observation tokens are not its response
  counts = rollouts.model_token_counts()
  lengths = counts if len(counts) else np.zeros(1, np.int64)
  truncated = rollouts.truncated if rollouts.num_samples else np.zeros(1, bool)
  scored = max(sum(batch.scoring.values()), 1)
  row = {key: stats.get(key, float("nan")) for key in TOP_LEVEL_STATS}
  row.update({
      "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
      "response_length/mean": float(lengths.mean()),
      "response_length/max": int(lengths.max()),
      "response_length/truncated_frac": float(truncated.mean()),
      "verifier/timeouts": batch.scoring["timeout"], "verifier/errors": batch.scoring["error"],
      "verifier/timeout_rate": batch.scoring["timeout"] / scored,
      "verifier/error_rate": batch.scoring["error"] / scored,
      "dynamic_sampling/groups_sampled": batch.groups_sampled,
      "dynamic_sampling/groups_kept": rollouts.num_groups,
      "policy_version": policy_version,
      "policy_lag": policy_version - 1 - batch.policy_version,
      "data_position": data_position,
  })
  if batch.agent is not None:  # agent rollouts: the parts the agents returned
    reward_parts = list(rollouts.parts) if rollouts.num_samples else []
    row.update({f"episode/{key}": value for key, value in batch.agent.items()})
  for name in reward_parts:
    values = rollouts.parts[name] if rollouts.num_samples else ()
    row[f"reward/{name}"] = float(np.mean(values)) if len(values) else 0.0
  row.update(batch.outcome)
  if rollouts.episodes:  # multi-turn: model turns and observation tokens per episode
    row["episode/turns_mean"] = float(np.mean([len(e["turns"]) for e in rollouts.episodes]))
    row["episode/observation_tokens_mean"] = float(np.mean(
        rollouts.completion_ids.lengths - counts))
  if batch.partial:  # partial rollouts: what the round carried over, and the tokens' lag
    row.update({f"rollout/partial/{key}": value for key, value in batch.partial.items()})
  # on-policy distillation (teacher.path): the student's reverse KL to the teacher per token
  row.update(distillation_metrics(rollouts))
  if batch.exact:  # rollout.exact_logprobs: repairs and the decode path's mismatch it removed
    row.update({f"sampler/exact_{key}": value for key, value in batch.exact.items()
                if not key.endswith("_s")})
  row.update({f"train/{key}": value for key, value in stats.items()
              if key not in TOP_LEVEL_STATS})
  return row


def rl_timing(batch: SampledBatch, times: StepTimes, *, asynchronous: bool) -> dict[str, float]:
  """`time/*` keys. With synchronous rollouts the batch was sampled inside this step."""
  sampled_now = 0.0 if asynchronous else batch.sample_s + batch.verify_s + batch.teacher_s
  exact = {f"time/exact_{key}": value for key, value in (batch.exact or {}).items()
           if key.endswith("_s")}  # parts of sample_s (rollout.exact_logprobs)
  if batch.rollouts.teacher_logprobs is not None:  # teacher.path: its forwards, after scoring
    exact["time/teacher_s"] = batch.teacher_s
  return {**exact,
      "time/sample_s": batch.sample_s, "time/verify_s": batch.verify_s,
      "time/train_s": times.train_s, "time/sync_s": times.sync_s,
      "time/sample_ahead_s": times.sample_ahead_s, "time/step_s": times.step_s,
      "time/compile_s": times.compile_s,
      # host time attributed to nothing above (batching, metrics): neither slice works
      "time/idle_s": max(0.0, times.step_s - sampled_now - times.train_s - times.sync_s
                         - times.sample_ahead_s),
  }


def rl_throughput(batch: SampledBatch, times: StepTimes, *, trained_tokens: int,
                  step_flops: Callable[..., float], peak_flops: float,
                  asynchronous: bool, computed_tokens: int | None = None) -> dict[str, float]:
  """Tokens/s and an RL-aware MFU that counts generation FLOPs as well as training FLOPs.

  `step_flops(prompts=, prompt_tokens=, generated_tokens=, trained_tokens=)` is the run's FLOP
  model (`reasoning_rl.flops`, shared with the dry-run planner); `peak_flops` is the whole slice's.
  `trained_tokens`: the batch's sequences' tokens; `computed_tokens`: the positions the step ran
  them in, fewer where packed rows share a prompt (`algo.shared_prompts`); the MFU counts those,
  the work done (default: `trained_tokens`).
  """
  generated = int(batch.rollouts.completion_ids.lengths.sum())
  prompts = int(batch.rollouts.prompt_tokens.lengths.sum())
  computed = trained_tokens if computed_tokens is None else computed_tokens
  flops = step_flops(prompts=batch.rollouts.num_groups, prompt_tokens=prompts,
                     generated_tokens=generated, trained_tokens=computed)
  seconds = (times.step_s if asynchronous
             else times.step_s + batch.sample_s + batch.verify_s + batch.teacher_s)
  row = {"throughput/generated_tokens_per_s": generated / max(batch.sample_s, 1e-9),
         "throughput/trained_tokens_per_s": trained_tokens / max(seconds, 1e-9),
         "throughput/rl_mfu": flops / max(seconds, 1e-9) / peak_flops}
  if batch.decode and batch.decode["slot_steps"]:
    # decode slot-steps with no sample to decode, e.g. waiting for a group's longest completion
    # (it depends on rollout.steps_per_call, hence a throughput figure, not a deterministic one)
    row["throughput/decode_idle_slot_frac"] = 1.0 - (batch.decode["live_slot_steps"]
                                                     / batch.decode["slot_steps"])
    # samples a short paged KV cache sent back to the queue (continued later: same tokens)
    row["throughput/decode_preempted_samples"] = batch.decode.get("preempted", 0)
  return row


# Decimal places of the per-token advantages in a rollout record: whitened advantages are O(1),
# so 1e-4 is far finer than anyone reads them, and a record of T tokens stays short.
TOKEN_ADVANTAGE_DECIMALS = 4


def _sequence_advantage(rollouts: RolloutColumns, sample: int, num_tokens: int
                        ) -> dict[str, Any]:
  """The record's `advantage` (and, per token, `token_advantages`) of sample `sample`."""
  if rollouts.token_advantages is None:
    advantages = rollouts.advantages
    return {"advantage": None if advantages is None else float(advantages[sample])}
  values = np.asarray(rollouts.token_advantages[sample][:num_tokens], np.float64)
  return {"advantage": float(values.mean()) if values.size else None,
          "token_advantages": [round(float(v), TOKEN_ADVANTAGE_DECIMALS) for v in values]}


def rollout_records(step: int, batch: SampledBatch, *, examples: Callable[[int], Any],
                    decode: Callable[[list[int]], str], verifier_version: str,
                    sampling: Mapping[str, Any], with_experts: bool = True
                    ) -> list[dict[str, Any]]:
  """One record per completion (the rollout-record contract in docs/architecture.md).

  `prompt` is the prompt as the policy saw it (the template's text); `task_prompt` is the task's
  own question, the text the verifiers were given, so a replay scores exactly what training did.
  `advantage` is the advantage stage's (`RolloutColumns.advantages`), the one the loss used. PPO
  has none there: its advantages are per token, GAE over the value head's predictions whitened
  over the batch, computed inside the step; the record then holds `token_advantages` (the step's,
  `RolloutColumns.token_advantages`: one per completion token, rounded to
  TOKEN_ADVANTAGE_DECIMALS places) and `advantage`, their mean (null for a completion without
  tokens). With neither, `advantage` is null. On-policy distillation (`teacher.path`) gives
  per-token advantages too (made before the step, `rl.distillation`), held the same way, and
  the record adds `teacher_logprobs`: the teacher's log-prob of each completion token, rounded
  likewise.

  Mixture-of-experts models (`with_experts`, `logging.rollout_experts`): `experts` holds the
  experts the sampler routed each prompt and completion token to (`sampler.api.array_to_json`:
  shape [tokens, sparse layers, k], dtype, base64 bytes).
  """
  rollouts, out = batch.rollouts, []
  counts = rollouts.model_token_counts()
  group_size = rollouts.group_size
  for g in range(rollouts.num_groups):
    position = int(rollouts.data_position[g])
    example = examples(position)
    prompt = decode(rollouts.prompt_tokens[g].tolist())
    for s in range(group_size):
      sample = g * group_size + s
      num_tokens = int(counts[sample])
      record = {
          "step": step, "prompt_id": position, "group_id": g, "sample_index": s,
          "prompt": prompt, "task_prompt": example.prompt,
          "completion": rollouts.responses[sample], "reward": float(rollouts.rewards[sample]),
          **_sequence_advantage(rollouts, sample, num_tokens),
          "num_tokens": num_tokens, "truncated": bool(rollouts.truncated[sample]),
          "policy_version": batch.policy_version, "verifier_version": verifier_version,
          "scoring_status": rollouts.status[g], "sampling": dict(sampling),
          "ground_truth": example.answer, "task": example.task,
          "metadata": dict(example.metadata), "tests": list(example.tests),
      }
      record.update({f"reward/{name}": float(values[sample])
                     for name, values in rollouts.parts.items()})
      if rollouts.teacher_logprobs is not None:
        record["teacher_logprobs"] = [round(float(v), TOKEN_ADVANTAGE_DECIMALS)
                                      for v in rollouts.teacher_logprobs[sample][:num_tokens]]
      if with_experts and rollouts.experts is not None:
        record["experts"] = array_to_json(rollouts.experts[sample])
      if rollouts.episodes is not None:  # multi-turn: every turn, and how the episode ended
        record.update(rollouts.episodes[sample])
        record["observation_tokens"] = int(rollouts.completion_ids.lengths[sample]) - num_tokens
      out.append(record)
  return out
