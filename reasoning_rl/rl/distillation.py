"""On-policy distillation (OPD): a teacher's per-token verdict on the student's own samples, used as
a per-token advantage in the policy-gradient loss (docs/distillation.md).

The student samples completions y ~ μ (its sampler); a frozen teacher π_T scores every sampled
token y_t in its context (prompt and y_<t), as sampled. The per-token reverse KL

  k_t = log μ(y_t | s_t) − log π_T(y_t | s_t)

is a one-sample estimate of KL(μ(· | s_t) ‖ π_T(· | s_t)) at the student's own state s_t (Agarwal
et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
GKD, arXiv:2306.13649, with the reverse KL as divergence; the Qwen3 technical report,
arXiv:2505.09388, "Strong-to-Weak Distillation"; Thinking Machines, "On-Policy Distillation",
2025). Minimising the student's reverse KL to the teacher by policy gradient takes −k_t as the
reward of token t; with a discount γ the advantage of token t sums the later tokens' rewards, and
γ = 0 (the Thinking Machines recipe's per-token form) keeps each token's own:

  A^distill_t = −c · Σ_{k ≥ t} γ^(k−t) · k_k      (c = teacher.kl_coef, γ = teacher.discount)

It goes into the loss as any advantage does, through the importance-sampled surrogate
(`rl.losses.policy_loss`, [B, T] advantages): alone, or added to the verifiable-reward advantage
of the sequence (the group estimator's, broadcast over its tokens) with weight w
(`teacher.reward_weight`, prime-rl's adv_tau):

  A_t = w · A_seq + A^distill_t      (w = 0: distillation alone)

μ is the student's sampler log-prob of the model's own, untempered distribution
(`RolloutColumns.logprobs`), so the teacher's (also untempered) and the student's distributions are
compared whatever the rollout's temperature. Tokens outside the loss mask (a multi-turn episode's
observations, not the model's choices) get k_t = 0.

Pure functions of numpy arrays and the rollout record; the teacher's forward is `rl.teacher`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from reasoning_rl.config_schema import sourced, values_of
from reasoning_rl.rl.rollout_columns import Ragged, RolloutColumns


@dataclasses.dataclass(frozen=True)
class DistillationSettings:
  """`config.teacher`, the typed view (docs/config.md): `path` empty = off."""

  path: str = sourced("teacher.path")
  kl_coef: float = sourced("teacher.kl_coef")
  reward_weight: float = sourced("teacher.reward_weight")
  discount: float = sourced("teacher.discount")
  max_batch: int = sourced("teacher.max_batch")

  @classmethod
  def from_config(cls, config) -> "DistillationSettings":
    return cls(**values_of(cls, config))

  @property
  def enabled(self) -> bool:
    return bool(self.path)


def reverse_kl(student_logprobs, teacher_logprobs, mask=None) -> np.ndarray:
  """k_t = log μ(y_t) − log π_T(y_t) per token (float64), 0 where `mask` is 0."""
  k = np.asarray(student_logprobs, np.float64) - np.asarray(teacher_logprobs, np.float64)
  return k if mask is None else np.where(np.asarray(mask) > 0, k, 0.0)


def discounted_sums(values, discount: float) -> np.ndarray:
  """G_t = Σ_{k ≥ t} γ^(k−t) · v_k over one sequence (γ = 0: the values themselves)."""
  values = np.asarray(values, np.float64)
  if discount == 0:
    return values.copy()
  out = np.zeros_like(values)
  running = 0.0
  for t in range(len(values) - 1, -1, -1):
    running = values[t] + discount * running
    out[t] = running
  return out


def token_advantages(rollouts: RolloutColumns, *, kl_coef: float, reward_weight: float,
                     discount: float) -> Ragged:
  """A_t = reward_weight · A_seq + A^distill_t for every completion token of every sample
  (module docstring), float32, one row per sample. A_seq is the record's `advantages` (the
  advantage stage's); a record without them contributes only the distillation term."""
  if rollouts.teacher_logprobs is None:
    raise ValueError("the rollouts carry no teacher log-probs: score them with rl.teacher."
                     "Teacher (teacher.path) before computing distillation advantages")
  masks = rollouts.loss_mask.rows() if rollouts.loss_mask is not None else None
  rows = []
  for s, (student, teacher) in enumerate(zip(rollouts.logprobs.rows(),
                                             rollouts.teacher_logprobs.rows())):
    k = reverse_kl(student, teacher, None if masks is None else masks[s])
    advantage = -kl_coef * discounted_sums(k, discount)
    if rollouts.advantages is not None and reward_weight:
      advantage = advantage + reward_weight * float(rollouts.advantages[s])
    rows.append(advantage)
  return Ragged.from_rows(rows, np.float32)


def distillation_metrics(rollouts: RolloutColumns) -> dict[str, float]:
  """Means over the model's own completion tokens (loss mask 1) of the step's samples:
  teacher/reverse_kl (k_t, the per-token reverse-KL estimate), teacher/logprob (log π_T(y_t)),
  teacher/student_logprob (log μ(y_t)); teacher/tokens counts them."""
  if rollouts.teacher_logprobs is None or not rollouts.num_samples:
    return {}
  student = rollouts.logprobs.values.astype(np.float64)
  teacher = rollouts.teacher_logprobs.values.astype(np.float64)
  keep = (rollouts.loss_mask.values > 0 if rollouts.loss_mask is not None
          else np.ones(len(student), bool))
  count = int(keep.sum())
  mean = lambda x: float(x[keep].mean()) if count else 0.0  # noqa: E731
  return {"teacher/reverse_kl": mean(student - teacher), "teacher/logprob": mean(teacher),
          "teacher/student_logprob": mean(student), "teacher/tokens": count}
