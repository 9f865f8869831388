"""Off-policy corrections and masks of the policy loss (docs/off_policy.md): the sampler importance
weights (`algo.is_correction`), the sequence rejections that compose with them
(`algo.rejection`), and DPPO's divergence masks (`algo.loss_type` ``dppo-tv`` / ``dppo-kl``,
registered by `reasoning_rl.rl.losses` after the other loss types).

Notation, per valid token t of sequence i: μ the behaviour policy (the sampler's log-probs,
``behavior_logprobs``), π_old the trainer's recomputation (``old_logprobs``), π_θ the policy being
trained, and ``ρ_t = π_old(y_t) / μ(y_t)`` the train/inference ratio.

Importance weights (``is_correction``), ``w_t = ρ_t`` bounded as follows:

- ``token-truncate``: ``clip(w_t, C_low, C)`` — truncated importance sampling (IMPALA, Espeholt
  et al. 2018, arXiv:1802.01561; TIS, Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training", blog) with the optional floor ``C_low``
  (``is_threshold_low``, default 0 = no floor; NVIDIA NeMo-RL PR #2886, "support TIS lower
  bound", clamps the TIS weight to ``[min, max]`` the same way);
- ``token-mask``: ``w_t`` where ``w_t ≤ C``, else 0;
- ``sequence-truncate``: ``clip(W_i, C_low, C)`` on every token of sequence i,
  ``W_i = Π_t w_t`` (formed in log space);
- ``sequence-mask``: ``W_i`` where ``W_i ≤ C``, else 0 (both sequence modes and ``token-mask``:
  Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
  Training-Inference Mismatch", blog);
- ``icepop``: ``w_t`` where ``α ≤ w_t ≤ β``, else 0 — IcePop's double-sided token masking
  (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
  Model" (Ring-1T), arXiv:2510.18855, §IcePop; α = 0.5, β = 5 there; ``icepop_low`` /
  ``icepop_high``). A token outside the band gets no policy gradient at all;
- ``none``: weight 1.

Rejection (``rejection``), a 0/1 mask per sequence multiplied into the weighted ``pg`` (so it
composes with any ``is_correction``, as verl's ``rollout_rs`` does with its ``rollout_is``
weights; verl, "Rollout Correction", docs/algo/rollout_corr.md, Y. Li 2025):

- ``seq-geo-mean``: reject sequence i when its geometric-mean ratio
  ``exp((1/n_i) Σ_t log ρ_t)`` leaves ``[lower, upper]`` (verl ``rollout_rs="seq_mean_k1"``, the
  "geometric RS" of Liu, Li et al. 2025, part 3: unlike ``W_i`` it does not grow with length);
- ``seq-mean-k3``: reject sequence i when ``(1/n_i) Σ_t k3_t > threshold`` with Schulman's
  ``k3_t = ρ_t − 1 − log ρ_t`` (an unbiased, non-negative per-token estimate of KL(μ‖π_old)
  under μ; verl ``rollout_rs="seq_mean_k3"``). ``log ρ`` is clamped to [−20, 20] for this
  statistic only (verl clamps the same way), so a far-off token rejects its sequence instead of
  overflowing.

A rejected token keeps its KL and entropy terms and its place in the loss's denominators (it
counts as a token with policy-gradient weight 0, like ``token-mask``).

DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
arXiv:2602.04879, "divergence proximal policy optimization"; as in verl's ``dppo_tv`` /
``dppo_kl`` losses, prime-rl's former default loss and SkyRL PR #1037), per token with
``p = π_θ(y_t)``, ``p_old = π_old(y_t)`` and the token ratio ``r_t = p / p_old``:
``pg = −A·r_t`` except where the token left the trust region in the direction its advantage
pushes, where ``pg = 0`` (no gradient):

- ``dppo-tv`` (Binary-TV): A > 0 and ``p − p_old > δ_high``; A < 0 and ``p − p_old < −δ_low``;
- ``dppo-kl`` (Binary-KL): A > 0, ``p > p_old`` and ``D > δ_high``; A < 0, ``p < p_old`` and
  ``D > δ_low``, with the divergence of the two Bernoulli distributions "this token / any other"
  ``D = p_old log(p_old/p) + (1 − p_old) log((1 − p_old)/(1 − p))``.

δ_low, δ_high are ``algo.epsilon_low`` / ``epsilon_high`` (the paper's runs: 0.15 for TV, 0.05
for KL). The gradient of a kept token is ``−A·r_t·∇log p``, PPO's inside its clip range.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from reasoning_rl import registries
from reasoning_rl.rl import stats as stats_lib
from reasoning_rl.rl.policy_term import PolicyTerm, stop_gradient
from reasoning_rl.rl.stats import array_namespace, float_dtype

# ----------------------------------------------------------------------------- importance weights


@dataclasses.dataclass(frozen=True)
class ImportanceMode:
  """How a sampler importance weight is bounded: per token or per sequence (the product of its
  token weights); truncated (to [C_low, C]) or masked to 0 above C; ``band``: masked to 0 outside
  [icepop_low, icepop_high] (IcePop)."""

  per_sequence: bool
  mask: bool
  band: bool = False


_THRESHOLDS = ("algo.is_threshold", "algo.is_threshold_low")
registries.IS_CORRECTIONS.add("none", None, summary="weight 1; the sampler mismatch is still "
                            "reported when the sampler's log-probs are there")
registries.IS_CORRECTIONS.add(
    "token-truncate", ImportanceMode(per_sequence=False, mask=False),
    summary="clip(w_t, C_low, C) (IMPALA, Espeholt et al. 2018; TIS, Yao et al. 2025; floor: "
    "NeMo-RL #2886)", options=_THRESHOLDS)
registries.IS_CORRECTIONS.add(
    "token-mask", ImportanceMode(per_sequence=False, mask=True),
    summary="w_t where w_t <= C, else 0 (Liu, Li et al. 2025)", options=("algo.is_threshold",))
registries.IS_CORRECTIONS.add(
    "sequence-truncate", ImportanceMode(per_sequence=True, mask=False),
    summary="clip(W_i, C_low, C), W_i = Π_t w_t, on every token (Liu, Li et al. 2025)",
    options=_THRESHOLDS)
registries.IS_CORRECTIONS.add(
    "sequence-mask", ImportanceMode(per_sequence=True, mask=True),
    summary="W_i where W_i <= C, else 0, on every token (Liu, Li et al. 2025)",
    options=("algo.is_threshold",))
registries.IS_CORRECTIONS.add(
    "icepop", ImportanceMode(per_sequence=False, mask=True, band=True),
    summary="w_t where icepop_low <= w_t <= icepop_high, else 0: double-sided token masking "
    "(Ring-1T's IcePop, Ling Team 2025, arXiv:2510.18855)",
    options=("algo.icepop_low", "algo.icepop_high"))


def _clean_log_ratio(old_logprobs: Any, behavior_logprobs: Any, mask: Any):
  """(xp, valid, log ρ zeroed at masked positions, without gradient)."""
  xp = array_namespace(old_logprobs, behavior_logprobs, mask)
  valid = xp.asarray(mask) > 0
  dtype = float_dtype(xp, xp.asarray(old_logprobs).dtype, xp.asarray(behavior_logprobs).dtype)
  log_ratio = xp.where(valid, xp.asarray(old_logprobs).astype(dtype)
                       - xp.asarray(behavior_logprobs).astype(dtype), 0)
  return xp, valid, stop_gradient(xp, log_ratio)


def importance_weights(old_logprobs: Any, behavior_logprobs: Any, mask: Any,
                       is_correction: str = "token-truncate", is_threshold: float = 2.0, *,
                       is_threshold_low: float = 0.0, icepop_low: float = 0.5,
                       icepop_high: float = 5.0) -> tuple[Any, stats_lib.Stats]:
  """Sampler importance weights ``[B, T]`` and their stats (module docstring: the modes).

  ``old_logprobs``: the trainer's recomputation of π_old; ``behavior_logprobs``: the sampler's
  log-probs. Values at masked positions are ignored; weights there are 0. The weights carry no
  gradient. Stats (``reasoning_rl.rl.stats`` convention): ``tis/abs_log_diff`` (mean and
  ``/max`` of ``|logp_old - logp_behavior|`` over valid tokens) always; unless ``none``:
  ``tis/weight`` (mean weight applied), ``tis/capped_token_frac`` (valid tokens whose weight
  exceeded the upper bound, i.e. was truncated or masked; for sequence modes every token of such
  a sequence) and ``tis/capped_seq_frac`` (non-empty sequences with at least one such token);
  with a floor (``is_threshold_low > 0`` on a truncating mode, or ``icepop``):
  ``tis/floored_token_frac`` (weights below the lower bound); for the masking modes
  ``tis/masked_token_frac`` / ``tis/masked_seq_frac`` (tokens whose weight was set to 0, and
  the non-empty sequences holding one).
  """
  mode = registries.IS_CORRECTIONS.get(is_correction).impl
  xp, valid, log_weight = _clean_log_ratio(old_logprobs, behavior_logprobs, mask)
  row_valid = xp.any(valid, axis=-1)
  stats: stats_lib.Stats = {
      "tis/abs_log_diff": stats_lib.mean_stat(xp.abs(log_weight), valid),
      "tis/abs_log_diff/max": stats_lib.max_stat(xp.abs(log_weight), valid),
  }
  if mode is None:
    return xp.where(valid, 1.0, 0.0).astype(log_weight.dtype), stats
  if mode.per_sequence:
    log_weight = xp.sum(log_weight, axis=-1, keepdims=True) + xp.zeros_like(log_weight)
  if mode.band:
    low, high = icepop_low, icepop_high
  else:
    low, high = (0.0 if mode.mask else is_threshold_low), is_threshold
  log_high = math.log(high)
  capped = valid & (log_weight > log_high)
  floored = valid & (log_weight < math.log(low)) if low > 0 else None
  # exp of the clipped log weight: no overflow however far the sampler drifted.
  bounded = xp.minimum(log_weight, log_high)
  if floored is not None:
    bounded = xp.maximum(bounded, math.log(low))
  weight = xp.exp(bounded)
  if mode.mask:
    masked = capped if floored is None else capped | floored
    weight = xp.where(masked, 0.0, weight)
    stats.update({"tis/masked_token_frac": stats_lib.mean_stat(masked, valid),
                  "tis/masked_seq_frac": stats_lib.mean_stat(xp.any(masked, axis=-1),
                                                             row_valid)})
  weight = xp.where(valid, weight, 0.0)
  stats.update({
      "tis/weight": stats_lib.mean_stat(weight, valid),
      "tis/capped_token_frac": stats_lib.mean_stat(capped, valid),
      "tis/capped_seq_frac": stats_lib.mean_stat(xp.any(capped, axis=-1), row_valid),
  })
  if floored is not None:
    stats["tis/floored_token_frac"] = stats_lib.mean_stat(floored, valid)
  return weight, stats


# ----------------------------------------------------------------------------- rejection

# verl's SAFETY_BOUND: exp(20) ≈ 5e8 keeps k3 finite in float32.
_K3_LOG_BOUND = 20.0


def _seq_geo_mean(log_ratio, valid, xp, *, geo_low, geo_high, k3_threshold):
  """Rejects rows whose mean log ρ leaves [log lower, log upper]."""
  del k3_threshold
  tokens = xp.maximum(xp.sum(valid, axis=-1), 1).astype(log_ratio.dtype)
  mean_log = xp.sum(log_ratio, axis=-1) / tokens
  reject = (mean_log < math.log(geo_low)) | (mean_log > math.log(geo_high))
  row_valid = xp.any(valid, axis=-1)
  geo = xp.exp(xp.clip(mean_log, -_K3_LOG_BOUND, _K3_LOG_BOUND))
  return reject, {"rejection/seq_geo_ratio/min": stats_lib.min_stat(geo, row_valid),
                  "rejection/seq_geo_ratio/max": stats_lib.max_stat(geo, row_valid)}


def _seq_mean_k3(log_ratio, valid, xp, *, geo_low, geo_high, k3_threshold):
  """Rejects rows whose mean k3 = ρ − 1 − log ρ exceeds the threshold."""
  del geo_low, geo_high
  bounded = xp.clip(log_ratio, -_K3_LOG_BOUND, _K3_LOG_BOUND)
  k3 = xp.where(valid, xp.expm1(bounded) - bounded, 0)
  tokens = xp.maximum(xp.sum(valid, axis=-1), 1).astype(log_ratio.dtype)
  mean_k3 = xp.sum(k3, axis=-1) / tokens
  row_valid = xp.any(valid, axis=-1)
  return mean_k3 > k3_threshold, {"rejection/seq_k3": stats_lib.mean_stat(mean_k3, row_valid),
                                  "rejection/seq_k3/max": stats_lib.max_stat(mean_k3, row_valid)}


registries.OFF_POLICY_REJECTIONS.add(
    "none", None, summary="no sequence is rejected")
registries.OFF_POLICY_REJECTIONS.add(
    "seq-geo-mean", _seq_geo_mean,
    summary="reject a sequence whose geometric-mean ratio exp(mean_t log π_old/μ) leaves "
    "[lower, upper] (verl rollout_rs seq_mean_k1; Liu, Li et al. 2025)",
    options=("algo.rejection_geo_low", "algo.rejection_geo_high"))
registries.OFF_POLICY_REJECTIONS.add(
    "seq-mean-k3", _seq_mean_k3,
    summary="reject a sequence whose mean k3 = ρ − 1 − log ρ, ρ = π_old/μ (an estimate of "
    "KL(μ‖π_old)), exceeds the threshold (verl rollout_rs seq_mean_k3)",
    options=("algo.rejection_k3_threshold",))


def rejection_mask(old_logprobs: Any, behavior_logprobs: Any, mask: Any, rejection: str = "none",
                   *, geo_low: float = 0.999, geo_high: float = 1.001,
                   k3_threshold: float = 0.01) -> tuple[Any, stats_lib.Stats]:
  """``keep [B, T]`` (1 where a valid token's sequence was not rejected, else 0; no gradient) and
  the stats: ``rejection/token_frac`` (valid tokens in rejected sequences),
  ``rejection/seq_frac`` (rejected non-empty sequences) and the statistic each choice tests
  (``rejection/seq_geo_ratio/min|max`` or ``rejection/seq_k3`` and ``/max``). Module docstring:
  the choices and their sources."""
  test = registries.OFF_POLICY_REJECTIONS.get(rejection).impl
  xp, valid, log_ratio = _clean_log_ratio(old_logprobs, behavior_logprobs, mask)
  if test is None:
    return xp.where(valid, 1.0, 0.0).astype(log_ratio.dtype), {}
  row_valid = xp.any(valid, axis=-1)
  reject, stats = test(log_ratio, valid, xp, geo_low=geo_low, geo_high=geo_high,
                       k3_threshold=k3_threshold)
  reject = reject & row_valid
  rejected_tokens = valid & reject[:, None]
  stats.update({"rejection/token_frac": stats_lib.mean_stat(rejected_tokens, valid),
                "rejection/seq_frac": stats_lib.mean_stat(reject, row_valid)})
  return xp.where(valid & ~reject[:, None], 1.0, 0.0).astype(log_ratio.dtype), stats


# ----------------------------------------------------------------------------- DPPO


def _log_one_minus_exp(logp: Any, xp: Any) -> Any:
  """log(1 − p) from log p, floored at log 1e-8 (p = 1 would give log 0)."""
  return xp.log(xp.maximum(-xp.expm1(logp), 1e-8))


def _dppo(logp, logp_old, adv, valid, *, epsilon_low, epsilon_high, dual_clip, xp,
          divergence: str) -> PolicyTerm:
  del valid, dual_clip  # dual_clip is refused with dppo by the option checks
  ratio = xp.exp(logp - logp_old)
  fixed_logp = stop_gradient(xp, logp)  # the mask carries no gradient
  p, p_old = xp.exp(fixed_logp), xp.exp(logp_old)
  if divergence == "tv":
    too_high, too_low = p - p_old > epsilon_high, p - p_old < -epsilon_low
  else:
    binary_kl = (p_old * (logp_old - fixed_logp) + (1 - p_old) * (
        _log_one_minus_exp(logp_old, xp) - _log_one_minus_exp(fixed_logp, xp)))
    too_high = (p > p_old) & (binary_kl > epsilon_high)
    too_low = (p < p_old) & (binary_kl > epsilon_low)
  masked_high, masked_low = (adv > 0) & too_high, (adv < 0) & too_low
  pg = xp.where(masked_high | masked_low, 0.0, -adv * ratio)
  return PolicyTerm(pg, {"clip_frac/low": masked_low, "clip_frac/high": masked_high})


def dppo_tv(logp, logp_old, adv, valid, **options) -> PolicyTerm:
  """DPPO Binary-TV (module docstring); `reasoning_rl.rl.losses` registers it as ``dppo-tv``."""
  return _dppo(logp, logp_old, adv, valid, divergence="tv", **options)


def dppo_kl(logp, logp_old, adv, valid, **options) -> PolicyTerm:
  """DPPO Binary-KL (module docstring); `reasoning_rl.rl.losses` registers it as ``dppo-kl``."""
  return _dppo(logp, logp_old, adv, valid, divergence="kl", **options)


# Loss types without a ratio the dual clip could bound.
NO_DUAL_CLIP = ("cispo", "dppo-tv", "dppo-kl")
