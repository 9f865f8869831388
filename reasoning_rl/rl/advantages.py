"""Group-relative advantage estimators for outcome rewards (docs/architecture.md §1).

Every prompt is sampled G times; its G scalar rewards form one *group*, and each completion's
advantage is measured against the rest of its group, so no value model is needed. With
``rewards`` of shape ``[P, G]`` (row p = the G completions of prompt p), ``mean_p`` and ``std_p``
the mean and standard deviation of row p:

``grpo``  (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, §4.1.2, outcome supervision)
    ``A = (r - mean_p) / (std_p + eps)``. The paper writes ``std`` without saying which; we use
    the **sample** standard deviation (Bessel-corrected, divisor G - 1), as TRL's GRPOTrainer
    (``torch.Tensor.std``, unbiased by default), verl and Tunix (``ddof=1``) do, so advantages
    match those implementations. (Population std would scale every advantage by
    ``sqrt((G-1)/G)``.)

``dr_grpo``  (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    arXiv:2503.20783, "Dr. GRPO")
    ``A = r - mean_p``. Dividing by ``std_p`` up-weights prompts that are nearly always solved or
    nearly always failed (a question-level difficulty bias), so Dr. GRPO drops it.

``rloo``  (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs", arXiv:2402.14740; after Kool et al. 2019)
    ``A_i = r_i - (1 / (G - 1)) Σ_{j≠i} r_j``: each sample's baseline is the mean of the *other*
    G - 1 rewards, which keeps the estimator unbiased. Equal to ``G / (G - 1) · (r_i - mean_p)``.
    Needs G ≥ 2.

``reinforce_pp``  (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models", arXiv:2501.03262, "REINFORCE++-baseline" for outcome rewards)
    ``a = r - mean_p`` (group baseline), then normalised with statistics of the **whole batch**:
    ``A = (a - mean(a)) / (std(a) + eps)``, mean and std over all P·G values (std again with the
    G·P - 1 divisor). ``mean(a)`` is 0 up to rounding when every group has G members; it is kept
    so the formula is the paper's. The paper normalises over tokens (each completion weighted
    by its length); this function sees one reward per completion, so each completion counts once.

Every estimator gives **exactly 0** to every member of a group whose rewards are all equal
(such a group carries no learning signal; DAPO's dynamic sampling drops them), never NaN and
never rounding noise, and a G = 1 group counts as all-equal (except for ``rloo``, which rejects
G = 1). The function is pure and works on numpy arrays (host-side, float64 if given) and jax
arrays (inside ``jit``; ``estimator`` and ``eps`` must then be static).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from reasoning_rl import registries
from reasoning_rl.errors import ConfigError
from reasoning_rl.rl.stats import array_namespace, float_dtype

def _sample_std(centered: Any, axis: Any, count: int, xp: Any) -> Any:
  """Bessel-corrected std of values whose mean is already subtracted (divisor max(n-1, 1))."""
  return xp.sqrt(xp.sum(centered * centered, axis=axis, keepdims=True) / max(count - 1, 1))


# Each estimator: (rewards [P, G] as floats, eps, xp) -> advantages [P, G] (formulas above).


@registries.ADVANTAGE_ESTIMATORS.register(
    "grpo", summary="(r − group mean) / (group std + eps) (Shao et al. 2024, DeepSeekMath)")
def _grpo(rewards: Any, eps: float, xp: Any) -> Any:
  centered = rewards - xp.mean(rewards, axis=1, keepdims=True)
  return centered / (_sample_std(centered, 1, rewards.shape[1], xp) + eps)


@registries.ADVANTAGE_ESTIMATORS.register(
    "dr_grpo", summary="r − group mean, no std division (Liu et al. 2025, Dr. GRPO)")
def _dr_grpo(rewards: Any, eps: float, xp: Any) -> Any:
  del eps
  return rewards - xp.mean(rewards, axis=1, keepdims=True)


@registries.ADVANTAGE_ESTIMATORS.register(
    "rloo", summary="r − mean of the other G − 1 rewards (Ahmadian et al. 2024, RLOO); G >= 2")
def _rloo(rewards: Any, eps: float, xp: Any) -> Any:
  del eps
  group_size = rewards.shape[1]
  others_mean = (xp.sum(rewards, axis=1, keepdims=True) - rewards) / (group_size - 1)
  return rewards - others_mean


@registries.ADVANTAGE_ESTIMATORS.register(
    "reinforce_pp",
    summary="r − group mean, then batch-normalised (Hu 2025, REINFORCE++-baseline)")
def _reinforce_pp(rewards: Any, eps: float, xp: Any) -> Any:
  centered = rewards - xp.mean(rewards, axis=1, keepdims=True)
  batch_centered = centered - xp.mean(centered)
  return batch_centered / (_sample_std(batch_centered, None, rewards.size, xp) + eps)


ESTIMATORS = registries.ADVANTAGE_ESTIMATORS.names()  # the built-in ones


def group_advantages(rewards: Any, *, estimator: str = "grpo", eps: float = 1e-6) -> Any:
  """Per-completion advantages from per-completion rewards grouped by prompt.

  Args:
    rewards: ``[num_prompts, G]`` scalar rewards; row p holds the G completions of prompt p.
      numpy or jax; integer rewards are promoted to floating point.
    estimator: one of ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp`` (module docstring has
      the formulas and their papers).
    eps: added to the standard deviation in ``grpo`` and ``reinforce_pp``.

  Returns:
    Advantages of the same shape as ``rewards`` (numpy in → numpy out, jax in → jax out).
    Rows whose rewards are all equal are exactly 0.

  Raises:
    ConfigError: unknown ``estimator``, negative ``eps``, or ``rloo`` with G = 1.
    ValueError: ``rewards`` is not 2-D, or (when concrete) holds a non-finite value.
  """
  compute = registries.ADVANTAGE_ESTIMATORS.get(estimator).impl
  if not eps >= 0:
    raise ConfigError(f"eps={eps!r} must be >= 0 (it is added to a standard deviation)")
  xp = array_namespace(rewards)
  rewards = xp.asarray(rewards)
  if rewards.ndim != 2:
    raise ValueError(
        f"rewards must have shape [num_prompts, G], got shape {tuple(rewards.shape)}; reshape "
        "the flat rewards to (num_prompts, G) with each prompt's G completions in one row")
  rewards = rewards.astype(float_dtype(xp, rewards.dtype))
  if not isinstance(rewards, jax.core.Tracer) and not bool(xp.all(xp.isfinite(rewards))):
    bad = np.argwhere(~np.isfinite(np.asarray(rewards)))[0].tolist()
    raise ValueError(
        f"rewards[{bad[0]}, {bad[1]}] is not finite; every verifier must return a finite reward "
        "(give failed or timed-out completions an explicit value such as 0)")
  group_size = rewards.shape[1]
  if estimator == "rloo" and group_size < 2:
    raise ConfigError(
        f"estimator='rloo' needs at least 2 completions per prompt (rewards.shape[1] = G = "
        f"{group_size}); sample G >= 2 completions per prompt or use estimator='dr_grpo'")

  advantages = compute(rewards, eps, xp)
  # Exact zeros for constant groups: the formulas give 0 only up to rounding of the mean.
  constant_group = xp.max(rewards, axis=1, keepdims=True) == xp.min(rewards, axis=1, keepdims=True)
  return xp.where(constant_group, xp.zeros_like(advantages), advantages)


def batch_advantages(rewards: Sequence[Sequence[float]], *, num_groups: int, group_size: int,
                     estimator: str) -> np.ndarray:
  """The loop's advantage stage, between scoring and batching: ``[num_groups, G]`` float32.

  ``rewards`` holds each scored group's G total rewards, at most ``num_groups`` of them (dynamic
  sampling may come up short); rows past them are 0, as are the fully masked rows they become.
  Rewards are taken at float32, the precision the batch carries them in, and the estimator runs
  in float64. These are the advantages the loss uses and the rollout records show.

  Raises:
    ValueError: a group does not hold ``group_size`` rewards.
    ConfigError: as ``group_advantages``.
  """
  rewards = list(rewards)[:num_groups]
  table = np.zeros((num_groups, group_size), np.float32)
  for g, group in enumerate(rewards):
    if len(group) != group_size:
      raise ValueError(f"group {g} has {len(group)} samples, expected {group_size}")
    table[g] = group
  advantages = np.zeros((num_groups, group_size), np.float32)
  if rewards:
    advantages[:len(rewards)] = np.asarray(
        group_advantages(table[:len(rewards)].astype(np.float64), estimator=estimator),
        np.float32)
  return advantages
