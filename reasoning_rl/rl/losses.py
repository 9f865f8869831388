"""The policy-gradient losses of GRPO / PPO, GSPO and CISPO, with their KL and IS terms.

Notation, per valid token (``mask > 0``) of sequence ``i``: ``A`` the advantage of the token's
sequence (or of the token itself, for PPO with a value model), ``m`` the mask, the token ratio
``r_t = exp(logp_t - logp_old_t)``, ``clip(x) = clip(x, 1 - ε_low, 1 + ε_high)`` and ``sg`` the
stop-gradient. ``loss_type`` picks the policy-gradient term ``pg`` of each token:

- ``ppo`` (default): the clipped surrogate of PPO (Schulman et al. 2017, "Proximal Policy
  Optimization Algorithms", arXiv:1707.06347) with separate bounds (Yu et al. 2025, "DAPO",
  arXiv:2503.14476, "clip-higher": ε_high > ε_low leaves more room to raise unlikely tokens):
  ``pg = max(-A·r_t, -A·clip(r_t))``; GRPO's ε = 0.2 on both sides, DAPO's (0.2, 0.28).
- ``gspo`` (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071):
  one length-normalised ratio per sequence ``s_i = exp(Σ_t m·(logp - logp_old) / Σ_t m)`` and
  ``pg = max(-A_i·s_i, -A_i·clip(s_i))`` on every token of the sequence; needs advantages
  ``[B]``. The paper clips at (ε_low, ε_high) = (3e-4, 4e-4), far tighter than PPO's (pass them
  explicitly), and averages over sequences: ``seq-mean-token-mean`` gives exactly its
  ``(1/G) Σ_i`` objective.
- ``gspo-token`` (same paper, its token-level variant):
  ``s_{i,t} = sg(s_i)·exp(logp_t - sg(logp_t))``, equal to ``s_i`` in value with gradient
  ``s_i·∇logp_t``, in the same clipped form with the token's own advantage (``[B]`` or
  ``[B, T]``). With one advantage per sequence it equals ``gspo`` in value and gradient under
  every aggregation.
- ``cispo`` (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, CISPO): REINFORCE with a clipped,
  stop-gradient importance weight, ``pg = -sg(clip(r_t))·A·logp_t``, so no token loses its
  gradient. The paper normalises by the total token count (``loss_agg="token-mean"``) and tunes
  only ε_high, setting ε_low so large that the weight has no floor: ``epsilon_low=1`` (allowed
  for ``cispo`` only) gives the floor 0, i.e. none.

- Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
  Learning", AAAI, arXiv:1912.09729), for ``A < 0`` only, with ``c > 1``:
  ``pg = min(pg, -A·c)``, which bounds the loss of a token whose ratio has exploded. It applies
  to ``ppo`` (on ``r_t``) and to both GSPO forms (on ``s_i``); ``cispo`` has no ratio in its
  loss (its weight is already at most ``1 + ε_high``), so ``dual_clip`` is refused there.
- Importance correction against the sampler (``is_correction``, below): ``pg ← w·pg``.
- KL to the frozen reference with Schulman's estimators (J. Schulman 2020, "Approximating KL
  Divergence", http://joschu.net/blog/kl-approx.html), ``x = logp_ref - logp``:
  ``k1 = -x``, ``k2 = x²/2``, ``k3 = exp(x) - x - 1`` (GRPO's choice, DeepSeekMath eq. 4).
- Optional entropy bonus ``-entropy_coef · H`` with ``H`` the per-token entropy.
- per-token loss ``ℓ = pg + β·KL - entropy_coef·H``.

Importance correction against the sampler
-----------------------------------------
π_old (``old_logprobs``) is the trainer's own recomputation; the sampler's log-probs
(``behavior_logprobs``) differ from it through numerics (sampler kernels, precision) and, with
asynchronous rollouts, staleness. The decoupled objective of Hilton et al. 2022 ("Batch
size-invariance for policy optimization", arXiv:2110.00641) multiplies ``pg`` by a bounded weight
``w_t = exp(logp_old_t - logp_behavior_t)`` (``is_correction``: token / sequence truncation or
masking, IcePop's band) and by a 0/1 sequence rejection (``rejection``: geometric-mean ratio or
mean k3 out of bounds), both defined, with their sources, in :mod:`reasoning_rl.rl.off_policy`
(which also registers DPPO's loss types ``dppo-tv`` / ``dppo-kl``). Weights and masks are
constants (no gradient), formed in log space, so a huge ratio truncates (or masks) instead of
overflowing.

Truncated ratio: a sampled token that was in π_old's kept set and left π_θ's
(``left_kept_set``, docs/off_policy.md) has ratio 0 and no gradient.

Aggregation over the mask m (``loss_agg``):

- ``token-mean`` (DAPO): ``Σ_{b,t} ℓ·m / N_tok``, N_tok the number of valid tokens.
- ``seq-mean-token-mean`` (GRPO): ``(1/N_seq) Σ_b [Σ_t ℓ·m / Σ_t m]``.
- ``seq-mean-token-sum-norm`` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783):
  ``(1/N_seq) Σ_b [Σ_t ℓ·m / L]``, L the padded completion length (default ``T``; pass the
  generation budget ``max_new_tokens`` as ``max_completion_length`` so L does not depend on
  how a batch happened to be padded).

N_seq counts only sequences with at least one valid token: a fully masked row (padding added
to fill a device or micro-batch) contributes 0 to the loss and is *not* counted, so padding
never dilutes the loss. Masked positions are replaced by 0 before any arithmetic, so garbage
(even inf / NaN) at padded positions never reaches the loss, the metrics or the gradient.

Micro-batches (gradient accumulation) and exactness
---------------------------------------------------
N_seq and N_tok are properties of the whole batch. A micro-batch computing its own would
weight its rows differently from the full batch. So the step computes them once with
:func:`loss_normalizers` on the full batch's mask and passes them to every micro-batch's
``policy_loss(..., num_sequences=..., num_tokens=...)`` (and a fixed
``max_completion_length``). Then the micro-batch losses (and gradients) *sum* to the full-batch
loss (and gradient): accumulate with ``+``, not with a mean. Per-row quantities (``Σ_t m`` in
``seq-mean-token-mean``) are local to a row and need nothing. Each micro-batch's metrics are
combined with :func:`reasoning_rl.rl.stats.merge`.

All functions accept numpy arrays (evaluated eagerly, float64 if given) or jax arrays
(jittable; string / float options must be static). Inputs in low precision are promoted to at
least float32 before any arithmetic.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from reasoning_rl import registries
from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import stats as stats_lib
# off_policy registers the importance corrections and the rejections; DPPO's loss types are
# registered below, after the others
from reasoning_rl.rl import off_policy
from reasoning_rl.rl.off_policy import NO_DUAL_CLIP, importance_weights, rejection_mask
from reasoning_rl.rl.policy_term import PolicyTerm, stop_gradient
from reasoning_rl.rl.stats import array_namespace, float_dtype

__all__ = ["PolicyTerm", "aggregate_loss", "importance_weights", "kl_penalty", "loss_normalizers",
           "policy_loss", "rejection_mask", "token_entropy", "truncation_mismatch_stats"]


def _is_zero(x: Any) -> bool:
  return isinstance(x, (int, float)) and x == 0


def token_entropy(logits: jax.Array) -> jax.Array:
  """Entropy ``H = -Σ_v p_v log p_v`` of ``softmax(logits)`` over the last axis, in float32.

  ``logits [..., vocab] -> [...]``. Entries of ``-inf`` (masked-out vocabulary) contribute 0,
  with finite gradients. This materialises ``[..., vocab]``; for a large vocabulary the step
  should call it on chunks of the time axis.
  """
  logits = jnp.asarray(logits)
  logits = logits.astype(float_dtype(jnp, logits.dtype))
  logp = jax.nn.log_softmax(logits, axis=-1)
  probs = jnp.exp(logp)
  # p·log p → 0 where p = 0; the where keeps log p = -inf out of the product and its gradient.
  safe_logp = jnp.where(probs > 0, logp, 0.0)
  return -jnp.sum(probs * safe_logp, axis=-1)


def kl_penalty(logprobs: Any, ref_logprobs: Any, estimator: str = "k3") -> Any:
  """Per-token estimate of KL(π‖π_ref) from tokens sampled by π (Schulman 2020).

  With ``x = ref_logprobs - logprobs``: ``k1 = -x`` (unbiased, can be negative),
  ``k2 = x²/2`` (biased, low variance), ``k3 = exp(x) - x - 1`` (unbiased, non-negative).
  ``k3`` is computed as ``expm1(x) - x`` to avoid cancellation when ``x`` is small.
  """
  estimate = registries.KL_ESTIMATORS.get(estimator).impl
  return estimate(ref_logprobs - logprobs, array_namespace(logprobs, ref_logprobs))


# Each KL estimator: (x = logp_ref - logp, xp) -> per-token estimate.


@registries.KL_ESTIMATORS.register("k1", summary="−x: unbiased, can be negative (Schulman 2020)")
def _kl_k1(x: Any, xp: Any) -> Any:
  del xp
  return -x


@registries.KL_ESTIMATORS.register("k2", summary="x²/2: biased, low variance (Schulman 2020)")
def _kl_k2(x: Any, xp: Any) -> Any:
  del xp
  return 0.5 * x * x


@registries.KL_ESTIMATORS.register(
    "k3", summary="exp(x) − x − 1: unbiased, >= 0 (Schulman 2020; GRPO's choice)")
def _kl_k3(x: Any, xp: Any) -> Any:
  return xp.expm1(x) - x  # expm1: no cancellation when x is small


def loss_normalizers(mask: Any) -> dict[str, Any]:
  """Whole-batch denominators to pass to every micro-batch's loss call.

  Returns ``{"num_sequences": rows with ≥ 1 valid token, "num_tokens": valid tokens}`` as
  scalars of the mask's array type; splat them into :func:`policy_loss` or
  :func:`aggregate_loss` (``**loss_normalizers(full_mask)``).
  """
  xp = array_namespace(mask)
  valid = xp.asarray(mask) > 0
  return {
      "num_sequences": xp.sum(xp.any(valid, axis=-1), dtype=xp.int32),
      "num_tokens": xp.sum(valid, dtype=xp.int32),
  }


def aggregate_loss(per_token: Any, mask: Any, loss_agg: str = "seq-mean-token-mean", *,
                   num_sequences: Any = None, num_tokens: Any = None,
                   max_completion_length: Optional[int] = None) -> Any:
  """Reduces a ``[B, T]`` per-token loss to a scalar (module docstring: formulas, papers).

  Args:
    per_token: ``[B, T]`` loss per token; values at masked positions are ignored.
    mask: ``[B, T]``, nonzero = valid token.
    loss_agg: ``token-mean``, ``seq-mean-token-mean`` or ``seq-mean-token-sum-norm``.
    num_sequences: N_seq override (whole-batch count of non-empty rows, for micro-batches);
      default: counted in this batch. Used by the two ``seq-mean`` aggregations.
    num_tokens: N_tok override (whole-batch valid-token count); used by ``token-mean``.
    max_completion_length: L of ``seq-mean-token-sum-norm``; default ``T``.
  Denominators are clamped to ≥ 1, so an all-masked batch gives 0.
  """
  aggregate = registries.LOSS_AGGREGATIONS.get(loss_agg).impl
  if max_completion_length is not None and not max_completion_length > 0:
    raise ConfigError(
        f"max_completion_length={max_completion_length!r} must be a positive token count "
        "(the generation budget, max_new_tokens)")
  xp = array_namespace(per_token, mask)
  valid = xp.asarray(mask) > 0
  masked = xp.where(valid, per_token, 0)
  defaults = loss_normalizers(valid)
  return aggregate(
      masked, valid, xp,
      num_tokens=defaults["num_tokens"] if num_tokens is None else num_tokens,
      num_sequences=defaults["num_sequences"] if num_sequences is None else num_sequences,
      length=valid.shape[-1] if max_completion_length is None else max_completion_length)


# Each aggregation: (masked per-token loss [B, T], valid [B, T], xp, *, num_tokens,
# num_sequences, length) -> scalar; the counts are whole-batch (micro-batching above).


@registries.LOSS_AGGREGATIONS.register(
    "seq-mean-token-mean", summary="mean over sequences of each one's token mean (GRPO)")
def _seq_mean_token_mean(masked, valid, xp, *, num_tokens, num_sequences, length):
  del num_tokens, length
  tokens_per_row = xp.sum(valid, axis=-1).astype(masked.dtype)
  per_row = xp.sum(masked, axis=-1) / xp.maximum(tokens_per_row, 1)
  return xp.sum(per_row) / xp.maximum(num_sequences, 1).astype(masked.dtype)


@registries.LOSS_AGGREGATIONS.register(
    "token-mean", summary="every valid token of the batch weighs the same (DAPO)")
def _token_mean(masked, valid, xp, *, num_tokens, num_sequences, length):
  del valid, num_sequences, length
  return xp.sum(masked) / xp.maximum(num_tokens, 1).astype(masked.dtype)


@registries.LOSS_AGGREGATIONS.register(
    "seq-mean-token-sum-norm",
    summary="token sums / a constant length L, mean over sequences (Dr. GRPO, Liu et al. 2025)",
    options=("rollout.max_new_tokens",))
def _seq_mean_token_sum_norm(masked, valid, xp, *, num_tokens, num_sequences, length):
  del valid, num_tokens
  per_row = xp.sum(masked, axis=-1) / length
  return xp.sum(per_row) / xp.maximum(num_sequences, 1).astype(masked.dtype)

_stop_gradient = stop_gradient


def _check_options(loss_type, beta, ref_logprobs, kl_estimator, epsilon_low, epsilon_high,
                   dual_clip, loss_agg, is_correction, is_threshold, behavior_logprobs,
                   entropy_coef, entropy, rejection, bounds) -> None:
  for choices, name in ((registries.LOSS_TYPES, loss_type),
                        (registries.KL_ESTIMATORS, kl_estimator),
                        (registries.LOSS_AGGREGATIONS, loss_agg),
                        (registries.IS_CORRECTIONS, is_correction)):
    choices.get(name)
  if loss_type == "cispo":
    if not 0 <= epsilon_low <= 1:
      raise ConfigError(f"epsilon_low={epsilon_low!r} must be in [0, 1] for cispo (weight floor "
                        "1 - ε_low; 1 removes the floor, as MiniMax-M1 does)")
  elif not 0 <= epsilon_low < 1:
    raise ConfigError(f"epsilon_low={epsilon_low!r} must be in [0, 1) (ratio floor 1 - ε_low)")
  if not epsilon_high >= 0:
    raise ConfigError(f"epsilon_high={epsilon_high!r} must be >= 0 (ratio ceiling 1 + ε_high)")
  if dual_clip is not None and not dual_clip > 1:
    raise ConfigError(
        f"dual_clip={dual_clip!r} must be > 1 (Ye et al. use 3) or None to disable it")
  if dual_clip is not None and loss_type in NO_DUAL_CLIP:
    raise ConfigError(f"dual_clip={dual_clip!r} does not apply to loss_type={loss_type!r} (its "
                      "loss has no clipped ratio to bound): set None")
  if not is_threshold > 0:
    raise ConfigError(f"is_threshold={is_threshold!r} must be > 0 (the bound C of the sampler "
                      "importance weight)")
  if not 0 <= bounds["is_threshold_low"] < is_threshold:
    raise ConfigError(f"is_threshold_low={bounds['is_threshold_low']!r} must be in [0, "
                      f"is_threshold={is_threshold!r}) (the floor of the truncated weight)")
  if not 0 <= bounds["icepop_low"] < bounds["icepop_high"]:
    raise ConfigError(f"icepop_low={bounds['icepop_low']!r}, icepop_high="
                      f"{bounds['icepop_high']!r}: need 0 <= icepop_low < icepop_high")
  if not 0 < bounds["geo_low"] <= 1 <= bounds["geo_high"]:
    raise ConfigError(f"rejection_geo_low={bounds['geo_low']!r}, rejection_geo_high="
                      f"{bounds['geo_high']!r}: need 0 < lower <= 1 <= upper")
  if not bounds["k3_threshold"] > 0:
    raise ConfigError(f"rejection_k3_threshold={bounds['k3_threshold']!r} must be > 0")
  registries.OFF_POLICY_REJECTIONS.get(rejection)
  if rejection != "none" and behavior_logprobs is None:
    raise ConfigError(f"rejection={rejection!r} needs behavior_logprobs (the sampler's "
                      "log-probs of the completion tokens); pass them or set rejection='none'")
  if is_correction != "none" and behavior_logprobs is None:
    raise ConfigError(f"is_correction={is_correction!r} needs behavior_logprobs (the sampler's "
                      "log-probs of the completion tokens); pass them or set is_correction='none'")
  if ref_logprobs is None and not _is_zero(beta):
    raise ConfigError(
        f"beta={beta!r} needs ref_logprobs (the frozen reference's log-probs); pass them or "
        "set beta=0")
  if entropy is None and not _is_zero(entropy_coef):
    raise ConfigError(
        f"entropy_coef={entropy_coef!r} needs entropy (per-token, e.g. from token_entropy); "
        "pass it or set entropy_coef=0")


def truncation_mismatch_stats(full_logprobs: Any, truncated_logprobs: Any,
                              behavior_logprobs: Any, mask: Any) -> stats_lib.Stats:
  """How far each estimator's π is from what the sampler drew with (docs/off_policy.md).

  ``behavior_logprobs`` are log μ^W, the sampler's log-probs under the distribution it drew from
  (temperature, top-k / top-p / min-p); ``full_logprobs`` log π (full softmax) and
  ``truncated_logprobs`` log π^W (the same truncation rebuilt on the trainer's logits). Per valid
  token: ``mismatch/full/abs_log_diff`` = mean |log π − log μ^W| and ``mismatch/full/ratio/max``
  = max π/μ^W (what the full-softmax ratio takes for the sampler's probability, against what it
  was); ``mismatch/truncated/...`` the same with π^W, which differs from μ^W only by numerics (and
  staleness) when the truncation is rebuilt faithfully. No gradient.
  """
  xp = array_namespace(full_logprobs, truncated_logprobs, behavior_logprobs, mask)
  valid = xp.asarray(mask) > 0
  dtype = float_dtype(xp, xp.asarray(full_logprobs).dtype, xp.asarray(behavior_logprobs).dtype)
  behavior = xp.where(valid, xp.asarray(behavior_logprobs).astype(dtype), 0)
  stats: stats_lib.Stats = {}
  for name, logprobs in (("full", full_logprobs), ("truncated", truncated_logprobs)):
    log_ratio = _stop_gradient(xp, xp.where(valid, xp.asarray(logprobs).astype(dtype), 0)
                               - behavior)
    stats[f"mismatch/{name}/abs_log_diff"] = stats_lib.mean_stat(xp.abs(log_ratio), valid)
    stats[f"mismatch/{name}/ratio/max"] = stats_lib.max_stat(xp.exp(log_ratio), valid)
  return stats


def _clipped_surrogate(ratio: Any, adv: Any, epsilon_low: float, epsilon_high: float,
                       dual_clip: Optional[float], xp: Any) -> tuple[Any, dict[str, Any]]:
  """``max(-A·ρ, -A·clip(ρ))`` then the dual clip; also returns where each bound binds."""
  pg = xp.maximum(-adv * ratio, -adv * xp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high))
  flags = {"clip_frac/low": (adv < 0) & (ratio < 1 - epsilon_low),
           "clip_frac/high": (adv > 0) & (ratio > 1 + epsilon_high)}
  if dual_clip is not None:
    dual_bound = -adv * dual_clip
    flags["clip_frac/dual"] = (adv < 0) & (pg > dual_bound)
    pg = xp.where(flags["clip_frac/dual"], dual_bound, pg)
  return pg, flags


# Each loss type: (logp, logp_old, adv [B, T], valid, *, epsilon_low, epsilon_high, dual_clip,
# xp) -> PolicyTerm, on inputs already zeroed at masked positions (module docstring: formulas).
_CLIP_OPTIONS = ("algo.epsilon_low", "algo.epsilon_high", "algo.dual_clip")


@registries.LOSS_TYPES.register(
    "ppo", summary="clipped token ratio, max(−A·r, −A·clip(r)) (Schulman et al. 2017; "
    "clip-higher: Yu et al. 2025)", options=_CLIP_OPTIONS)
def _ppo(logp, logp_old, adv, valid, *, epsilon_low, epsilon_high, dual_clip, xp) -> PolicyTerm:
  del valid
  pg, flags = _clipped_surrogate(xp.exp(logp - logp_old), adv, epsilon_low, epsilon_high,
                                 dual_clip, xp)
  return PolicyTerm(pg, flags)


def _gspo(logp, logp_old, adv, valid, *, epsilon_low, epsilon_high, dual_clip, xp,
          token_level: bool) -> PolicyTerm:
  tokens_per_row = xp.sum(valid, axis=-1, keepdims=True).astype(logp.dtype)
  seq_ratio = xp.exp(xp.sum(logp - logp_old, axis=-1, keepdims=True)
                     / xp.maximum(tokens_per_row, 1))
  if token_level:  # value s_i, gradient s_i·∇logp_t
    surrogate_ratio = _stop_gradient(xp, seq_ratio) * xp.exp(logp - _stop_gradient(xp, logp))
  else:
    surrogate_ratio = seq_ratio + xp.zeros_like(logp)
  pg, flags = _clipped_surrogate(surrogate_ratio, adv, epsilon_low, epsilon_high, dual_clip, xp)
  row_valid = xp.any(valid, axis=-1)
  metrics = {"seq_ratio/mean": stats_lib.mean_stat(seq_ratio[:, 0], row_valid),
             "seq_ratio/min": stats_lib.min_stat(seq_ratio[:, 0], row_valid),
             "seq_ratio/max": stats_lib.max_stat(seq_ratio[:, 0], row_valid)}
  return PolicyTerm(pg, flags, per_sequence=not token_level, metrics=metrics,
                    sequence_ratio=True)


@registries.LOSS_TYPES.register(
    "gspo", summary="length-normalised sequence ratio, clipped per sequence (Zheng et al. 2025, "
    "GSPO); advantages [B]", options=_CLIP_OPTIONS)
def _gspo_sequence(logp, logp_old, adv, valid, **options) -> PolicyTerm:
  return _gspo(logp, logp_old, adv, valid, token_level=False, **options)


@registries.LOSS_TYPES.register(
    "gspo-token", summary="GSPO's value with a per-token gradient path s_i·∇logp_t (Zheng et "
    "al. 2025)", options=_CLIP_OPTIONS)
def _gspo_token(logp, logp_old, adv, valid, **options) -> PolicyTerm:
  return _gspo(logp, logp_old, adv, valid, token_level=True, **options)


@registries.LOSS_TYPES.register(
    "cispo", summary="REINFORCE with a clipped stop-gradient IS weight, −sg(clip(r))·A·logp "
    "(MiniMax 2025, CISPO)", options=("algo.epsilon_low", "algo.epsilon_high"))
def _cispo(logp, logp_old, adv, valid, *, epsilon_low, epsilon_high, dual_clip,
           xp) -> PolicyTerm:
  del valid, dual_clip  # refused with cispo by the option checks
  ratio = xp.exp(logp - logp_old)
  pg = -_stop_gradient(xp, xp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)) * adv * logp
  return PolicyTerm(pg, {"clip_frac/low": ratio < 1 - epsilon_low,
                         "clip_frac/high": ratio > 1 + epsilon_high})


registries.LOSS_TYPES.add(
    "dppo-tv", off_policy.dppo_tv, summary="−A·r, masked where π_θ − π_old at the token leaves "
    "[−δ_low, δ_high] in the advantage's direction (DPPO Binary-TV, Qi et al. 2026, "
    "arXiv:2602.04879)", options=("algo.epsilon_low", "algo.epsilon_high"))
registries.LOSS_TYPES.add(
    "dppo-kl", off_policy.dppo_kl, summary="−A·r, masked where the binary KL of π_old and π_θ at "
    "the token exceeds δ in the advantage's direction (DPPO Binary-KL, Qi et al. 2026)",
    options=("algo.epsilon_low", "algo.epsilon_high"))


def policy_loss(logprobs: Any, old_logprobs: Any, advantages: Any, mask: Any, *,
                loss_type: str = "ppo", ref_logprobs: Any = None, beta: float = 0.0,
                kl_logprobs: Any = None, kl_estimator: str = "k3", epsilon_low: float = 0.2,
                epsilon_high: float = 0.2,
                dual_clip: Optional[float] = None, loss_agg: str = "seq-mean-token-mean",
                behavior_logprobs: Any = None, is_correction: str = "none",
                is_threshold: float = 2.0, is_threshold_low: float = 0.0,
                icepop_low: float = 0.5, icepop_high: float = 5.0, rejection: str = "none",
                rejection_geo_low: float = 0.999, rejection_geo_high: float = 1.001,
                rejection_k3_threshold: float = 0.01, left_kept_set: Any = None,
                entropy: Any = None, entropy_coef: float = 0.0,
                num_sequences: Any = None, num_tokens: Any = None,
                max_completion_length: Optional[int] = None) -> tuple[Any, stats_lib.Stats]:
  """Policy-gradient loss with KL, sampler-IS and entropy terms (module docstring: formulas).

  Args:
    logprobs: ``[B, T]`` log π(token) under the current parameters (the differentiable input).
    old_logprobs: ``[B, T]`` log π_old(token), fixed over the μ inner updates: the trainer's
      own recomputation (not the sampler's log-probs; those go to ``behavior_logprobs``).
    advantages: ``[B]`` per sequence (GRPO family) or ``[B, T]`` per token (PPO with GAE; not
      for ``gspo``).
    mask: ``[B, T]``, nonzero = completion token that counts.
    loss_type: ``ppo``, ``gspo``, ``gspo-token``, ``cispo``, ``dppo-tv`` or ``dppo-kl``
      (:mod:`reasoning_rl.rl.off_policy`).
    ref_logprobs: ``[B, T]`` frozen reference log-probs; required when ``beta != 0``; when given
      with ``beta == 0`` the KL is still reported as a metric.
    beta: KL weight β.
    kl_logprobs: ``[B, T]`` the policy's log-probs the KL compares with ``ref_logprobs`` (with
      gradient); default ``logprobs``. A step whose ratio uses the sampler's truncated π^W passes
      the full softmax's here, so that both sides of the KL are the same kind of distribution
      (at θ = θ_ref the KL is then exactly 0; docs/off_policy.md).
    kl_estimator: ``k1``, ``k2`` or ``k3``.
    epsilon_low, epsilon_high: clip range ``[1 - ε_low, 1 + ε_high]`` of the ratio (``ppo``),
      of the sequence ratio (GSPO) or of the importance weight (``cispo``).
    dual_clip: c > 1 for dual-clip PPO / GSPO, or None (must be None for ``cispo``).
    loss_agg: ``seq-mean-token-mean``, ``token-mean`` or ``seq-mean-token-sum-norm``.
    behavior_logprobs: ``[B, T]`` log-probs of the policy that actually sampled the tokens
      (the sampler); needed unless ``is_correction == "none"``, when they are only reported.
    is_correction: ``none``, ``token-truncate``, ``token-mask``, ``sequence-truncate``,
      ``sequence-mask`` or ``icepop`` (:func:`importance_weights`).
    is_threshold: C of the importance correction (2.0 as in Yao et al. 2025).
    is_threshold_low: floor of the truncating corrections' weight (0 = none).
    icepop_low, icepop_high: IcePop's band [α, β].
    rejection: ``none``, ``seq-geo-mean`` or ``seq-mean-k3`` (:func:`rejection_mask`), with its
      bounds ``rejection_geo_low`` / ``rejection_geo_high`` or ``rejection_k3_threshold``;
      composes with ``is_correction``.
    left_kept_set: ``[B, T]`` booleans, the truncated ratio's tokens that were in π_old's kept set
      and are not in π_θ's (docs/off_policy.md): their ratio is 0 — ``π_θ^W(y) = 0`` — and they
      get no gradient; with a sequence ratio (GSPO) their whole sequence's ratio is 0. Their
      ``logprobs`` must be finite (the rebuild's, with the token kept).
    entropy: ``[B, T]`` per-token entropy (e.g. :func:`token_entropy` of the logits); reported
      as a metric and, with ``entropy_coef``, used as a bonus. Gradient flows through it.
    entropy_coef: weight of the entropy bonus (subtracted from the loss).
    num_sequences, num_tokens, max_completion_length: whole-batch denominators for
      micro-batching; see the module docstring and :func:`loss_normalizers`.

  Returns:
    ``(loss, stats)``: the scalar loss and a stats dict (``reasoning_rl.rl.stats``
    convention; per-token means over valid tokens unless noted):
    ``pg_loss`` (pg term after the importance correction), ``clip_frac`` (= low + high),
    ``clip_frac/low``, ``clip_frac/high``: for ``ppo`` and ``gspo-token`` the tokens whose
    gradient the floor cuts (A < 0 and ratio < 1 - ε_low) or the ceiling cuts (A > 0 and
    ratio > 1 + ε_high); for ``gspo`` the same per non-empty *sequence*, on ``s_i``; for
    ``cispo`` the tokens whose weight was clipped (below the floor / above the ceiling,
    whatever the sign of A: their gradient is kept, only bounded); for DPPO the tokens its
    trust-region mask zeroes (A < 0 / A > 0);
    ``ratio/mean``, ``ratio/min``, ``ratio/max`` (token ratio ``r_t``), ``approx_kl`` (k3
    estimate of KL(π_old‖π): r - 1 - log r); for GSPO ``seq_ratio/mean|min|max`` (``s_i`` per
    non-empty sequence); with ``dual_clip``: ``clip_frac/dual`` (per sequence for ``gspo``);
    with ``ref_logprobs``: ``kl``; with ``entropy``: ``entropy``; with ``behavior_logprobs``:
    the ``tis/...`` stats of :func:`importance_weights` and, with a rejection, the
    ``rejection/...`` stats of :func:`rejection_mask`; with ``left_kept_set``:
    ``truncation/left_token_frac`` (valid tokens that left the kept set; ``approx_kl`` then
    averages over the others, since KL(π_old‖π_θ) is infinite at such a token).
  """
  bounds = {"is_threshold_low": is_threshold_low, "icepop_low": icepop_low,
            "icepop_high": icepop_high, "geo_low": rejection_geo_low,
            "geo_high": rejection_geo_high, "k3_threshold": rejection_k3_threshold}
  _check_options(loss_type, beta, ref_logprobs, kl_estimator, epsilon_low, epsilon_high,
                 dual_clip, loss_agg, is_correction, is_threshold, behavior_logprobs,
                 entropy_coef, entropy, rejection, bounds)
  optional = [x for x in (ref_logprobs, kl_logprobs, behavior_logprobs, entropy, left_kept_set)
              if x is not None]
  xp = array_namespace(logprobs, old_logprobs, advantages, mask, *optional)
  mask = xp.asarray(mask)
  if mask.ndim != 2:
    raise ValueError(f"mask must have shape [B, T], got {tuple(mask.shape)}")
  named = {"logprobs": logprobs, "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs,
           "kl_logprobs": kl_logprobs,
           "behavior_logprobs": behavior_logprobs, "entropy": entropy,
           "left_kept_set": left_kept_set}
  for name, value in named.items():
    if value is not None and tuple(xp.shape(value)) != tuple(mask.shape):
      raise ValueError(
          f"{name} has shape {tuple(xp.shape(value))} but mask has {tuple(mask.shape)}; all "
          "per-token inputs must be [B, T] over the same completion positions")
  advantages = xp.asarray(advantages)
  if tuple(advantages.shape) not in (mask.shape[:1], tuple(mask.shape)):
    raise ValueError(
        f"advantages has shape {tuple(advantages.shape)}; expected [B] = {mask.shape[:1]} (one "
        f"per sequence) or [B, T] = {tuple(mask.shape)} (one per token)")
  if loss_type == "gspo" and advantages.ndim != 1:
    raise ValueError(
        f"loss_type='gspo' needs one advantage per sequence, shape [B] = {mask.shape[:1]}, got "
        f"{tuple(advantages.shape)}; use loss_type='gspo-token' for per-token advantages")

  valid = mask > 0
  row_valid = xp.any(valid, axis=-1)
  dtype = float_dtype(xp, *[xp.asarray(v).dtype for k, v in named.items()
                            if v is not None and k != "left_kept_set"], advantages.dtype)

  def clean(x: Any) -> Any:
    # Masked positions become 0 *before* any exp/log, so padding garbage cannot leak NaN
    # into the loss or (through 0·inf) into the gradient.
    return xp.where(valid, xp.asarray(x).astype(dtype), 0)

  logp, logp_old = clean(logprobs), clean(old_logprobs)
  adv = advantages.astype(dtype)
  adv = clean(adv[:, None] if adv.ndim == 1 else adv)

  left = None
  if left_kept_set is not None:
    left = valid & (xp.asarray(left_kept_set) > 0)
    # π_θ^W(y) = 0: the loss type sees ratio 1 without gradient (log π_θ := sg(log π_old), finite),
    # and its pg is zeroed below; log 0 never enters an exp, a log or a gradient.
    logp = xp.where(left, _stop_gradient(xp, logp_old), logp)
  log_ratio = logp - logp_old
  ratio = xp.exp(log_ratio)
  term = registries.LOSS_TYPES.get(loss_type).impl(
      logp, logp_old, adv, valid, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
      dual_clip=dual_clip, xp=xp)
  pg, flags = term.pg, dict(term.flags)
  kl_tokens = valid
  if left is not None:
    dropped = (xp.any(left, axis=-1, keepdims=True) & valid) if term.sequence_ratio else left
    pg = xp.where(dropped, 0.0, pg)
    flags = {name: flag & ~dropped for name, flag in flags.items()}
    ratio = xp.where(left, 0.0, ratio)
    kl_tokens = valid & ~left
    metrics_left = {"truncation/left_token_frac": stats_lib.mean_stat(left, valid)}
  metrics: stats_lib.Stats = dict(term.metrics)
  if left is not None:
    metrics.update(metrics_left)
  flags["clip_frac"] = flags["clip_frac/low"] | flags["clip_frac/high"]
  for name, flag in flags.items():
    if term.per_sequence:  # one ratio per sequence: count sequences
      metrics[name] = stats_lib.mean_stat(xp.any(flag & valid, axis=-1), row_valid)
    else:
      metrics[name] = stats_lib.mean_stat(flag, valid)

  if behavior_logprobs is not None:
    behavior = clean(behavior_logprobs)
    is_weight, is_stats = importance_weights(
        logp_old, behavior, valid, is_correction, is_threshold,
        is_threshold_low=is_threshold_low, icepop_low=icepop_low, icepop_high=icepop_high)
    if is_correction != "none":
      pg = pg * is_weight
    metrics.update(is_stats)
    if rejection != "none":
      keep, rejection_stats = rejection_mask(
          logp_old, behavior, valid, rejection, geo_low=rejection_geo_low,
          geo_high=rejection_geo_high, k3_threshold=rejection_k3_threshold)
      pg = pg * keep
      metrics.update(rejection_stats)

  per_token = pg
  if ref_logprobs is not None:
    kl = kl_penalty(logp if kl_logprobs is None else clean(kl_logprobs), clean(ref_logprobs),
                    kl_estimator)
    if not _is_zero(beta):
      per_token = per_token + beta * kl
    metrics["kl"] = stats_lib.mean_stat(kl, valid)
  if entropy is not None:
    token_entropies = clean(entropy)
    if not _is_zero(entropy_coef):
      per_token = per_token - entropy_coef * token_entropies
    metrics["entropy"] = stats_lib.mean_stat(token_entropies, valid)

  loss = aggregate_loss(per_token, valid, loss_agg, num_sequences=num_sequences,
                        num_tokens=num_tokens, max_completion_length=max_completion_length)
  metrics.update({
      "pg_loss": stats_lib.mean_stat(pg, valid),
      "ratio/mean": stats_lib.mean_stat(ratio, valid),
      "ratio/min": stats_lib.min_stat(ratio, valid),
      "ratio/max": stats_lib.max_stat(ratio, valid),
      "approx_kl": stats_lib.mean_stat(xp.expm1(log_ratio) - log_ratio, kl_tokens),
  })
  if xp is jnp:
    metrics = jax.lax.stop_gradient(metrics)
  return loss, metrics


# The built-in names (every registered name is accepted; these are the ones defined here).
KL_ESTIMATORS = registries.KL_ESTIMATORS.names()
LOSS_AGGREGATIONS = registries.LOSS_AGGREGATIONS.names()
LOSS_TYPES = registries.LOSS_TYPES.names()
IS_CORRECTIONS = registries.IS_CORRECTIONS.names()
