"""The clipped policy-gradient loss of GRPO / PPO and its variants (DESIGN §1 step 5, §3).

Per valid token (``mask > 0``), with ``A`` the advantage of the token's sequence (or of the
token itself, for PPO with a value model):

- ratio ``ρ = exp(logp - logp_old)``.
- PPO clip (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347)
  with separate bounds (Yu et al. 2025, "DAPO", arXiv:2503.14476, "clip-higher": ε_high > ε_low
  leaves more room to raise unlikely tokens):
  ``pg = max(-A·ρ, -A·clip(ρ, 1 - ε_low, 1 + ε_high))``.
- Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
  Learning", AAAI, arXiv:1912.09729), for ``A < 0`` only, with ``c > 1``:
  ``pg = min(pg, -A·c)``, which bounds the loss of a token whose ratio has exploded.
- Optional truncated importance sampling (TIS) for rollouts that were not sampled by π_old:
  the sampler's own log-probs ``logp_behavior`` give ``w = min(exp(logp_old - logp_behavior),
  C)``, a constant (no gradient), and ``pg ← w·pg``. This is the decoupled PPO objective of
  Hilton et al. 2022 ("Batch size-invariance for policy optimization", arXiv:2110.00641), with
  the weight truncated as in IMPALA (Espeholt et al. 2018, arXiv:1802.01561) and as Yao et al.
  2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", blog, TIS)
  use for sampler/trainer numerical mismatch and stale (asynchronous) rollouts. Pass
  ``old_logprobs`` = the trainer's recomputation (the proximal policy) and
  ``behavior_logprobs`` = the sampler's log-probs; if the trainer does not recompute, pass the
  sampler's log-probs as ``old_logprobs`` and leave ``behavior_logprobs`` unset.
- KL to the frozen reference with Schulman's estimators (J. Schulman 2020, "Approximating KL
  Divergence", http://joschu.net/blog/kl-approx.html), ``x = logp_ref - logp``:
  ``k1 = -x``, ``k2 = x²/2``, ``k3 = exp(x) - x - 1`` (GRPO's choice, DeepSeekMath eq. 4).
- Optional entropy bonus ``-entropy_coef · H`` with ``H`` the per-token entropy.
- per-token loss ``ℓ = pg + β·KL - entropy_coef·H``.

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

from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import stats as stats_lib
from reasoning_rl.rl.stats import array_namespace, float_dtype

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")


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
  if estimator not in KL_ESTIMATORS:
    raise ConfigError(f"kl_estimator={estimator!r} is unknown; use one of {KL_ESTIMATORS}")
  xp = array_namespace(logprobs, ref_logprobs)
  x = ref_logprobs - logprobs
  if estimator == "k1":
    return -x
  if estimator == "k2":
    return 0.5 * x * x
  return xp.expm1(x) - x


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
  if loss_agg not in LOSS_AGGREGATIONS:
    raise ConfigError(f"loss_agg={loss_agg!r} is unknown; use one of {LOSS_AGGREGATIONS}")
  if max_completion_length is not None and not max_completion_length > 0:
    raise ConfigError(
        f"max_completion_length={max_completion_length!r} must be a positive token count "
        "(the generation budget, max_new_tokens)")
  xp = array_namespace(per_token, mask)
  valid = xp.asarray(mask) > 0
  masked = xp.where(valid, per_token, 0)
  defaults = loss_normalizers(valid)
  if loss_agg == "token-mean":
    count = defaults["num_tokens"] if num_tokens is None else num_tokens
    return xp.sum(masked) / xp.maximum(count, 1).astype(masked.dtype)
  if loss_agg == "seq-mean-token-mean":
    tokens_per_row = xp.sum(valid, axis=-1).astype(masked.dtype)
    per_row = xp.sum(masked, axis=-1) / xp.maximum(tokens_per_row, 1)
  else:  # seq-mean-token-sum-norm
    length = valid.shape[-1] if max_completion_length is None else max_completion_length
    per_row = xp.sum(masked, axis=-1) / length
  count = defaults["num_sequences"] if num_sequences is None else num_sequences
  return xp.sum(per_row) / xp.maximum(count, 1).astype(masked.dtype)


def _check_options(beta, ref_logprobs, kl_estimator, epsilon_low, epsilon_high, dual_clip,
                   loss_agg, tis_cap, entropy_coef, entropy) -> None:
  if kl_estimator not in KL_ESTIMATORS:
    raise ConfigError(f"kl_estimator={kl_estimator!r} is unknown; use one of {KL_ESTIMATORS}")
  if loss_agg not in LOSS_AGGREGATIONS:
    raise ConfigError(f"loss_agg={loss_agg!r} is unknown; use one of {LOSS_AGGREGATIONS}")
  if not 0 <= epsilon_low < 1:
    raise ConfigError(f"epsilon_low={epsilon_low!r} must be in [0, 1) (ratio floor 1 - ε_low)")
  if not epsilon_high >= 0:
    raise ConfigError(f"epsilon_high={epsilon_high!r} must be >= 0 (ratio ceiling 1 + ε_high)")
  if dual_clip is not None and not dual_clip > 1:
    raise ConfigError(
        f"dual_clip={dual_clip!r} must be > 1 (Ye et al. use 3) or None to disable it")
  if not tis_cap > 0:
    raise ConfigError(f"tis_cap={tis_cap!r} must be > 0 (truncation of the importance weight)")
  if ref_logprobs is None and not _is_zero(beta):
    raise ConfigError(
        f"beta={beta!r} needs ref_logprobs (the frozen reference's log-probs); pass them or "
        "set beta=0")
  if entropy is None and not _is_zero(entropy_coef):
    raise ConfigError(
        f"entropy_coef={entropy_coef!r} needs entropy (per-token, e.g. from token_entropy); "
        "pass it or set entropy_coef=0")


def policy_loss(logprobs: Any, old_logprobs: Any, advantages: Any, mask: Any, *,
                ref_logprobs: Any = None, beta: float = 0.0, kl_estimator: str = "k3",
                epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                dual_clip: Optional[float] = None, loss_agg: str = "seq-mean-token-mean",
                behavior_logprobs: Any = None, tis_cap: float = 2.0,
                entropy: Any = None, entropy_coef: float = 0.0,
                num_sequences: Any = None, num_tokens: Any = None,
                max_completion_length: Optional[int] = None) -> tuple[Any, stats_lib.Stats]:
  """Clipped policy-gradient loss with KL, TIS and entropy terms (module docstring: formulas).

  Args:
    logprobs: ``[B, T]`` log π(token) under the current parameters (the differentiable input).
    old_logprobs: ``[B, T]`` log π_old(token), fixed over the μ inner updates.
    advantages: ``[B]`` per sequence (GRPO family) or ``[B, T]`` per token (PPO with GAE).
    mask: ``[B, T]``, nonzero = completion token that counts.
    ref_logprobs: ``[B, T]`` frozen reference log-probs; required when ``beta != 0``; when given
      with ``beta == 0`` the KL is still reported as a metric.
    beta: KL weight β.
    kl_estimator: ``k1``, ``k2`` or ``k3``.
    epsilon_low, epsilon_high: clip range ``[1 - ε_low, 1 + ε_high]`` of the ratio.
    dual_clip: c > 1 for dual-clip PPO, or None.
    loss_agg: ``seq-mean-token-mean``, ``token-mean`` or ``seq-mean-token-sum-norm``.
    behavior_logprobs: ``[B, T]`` log-probs of the policy that actually sampled the tokens,
      when it differs from π_old (async / stale sampler, sampler numerics); enables TIS.
    tis_cap: C, the truncation of the TIS weight (2.0 as in Yao et al. 2025).
    entropy: ``[B, T]`` per-token entropy (e.g. :func:`token_entropy` of the logits); reported
      as a metric and, with ``entropy_coef``, used as a bonus. Gradient flows through it.
    entropy_coef: weight of the entropy bonus (subtracted from the loss).
    num_sequences, num_tokens, max_completion_length: whole-batch denominators for
      micro-batching; see the module docstring and :func:`loss_normalizers`.

  Returns:
    ``(loss, stats)``: the scalar loss and a stats dict (``reasoning_rl.rl.stats``
    convention; per-token means over valid tokens unless noted):
    ``pg_loss`` (pg term after TIS), ``clip_frac`` (= low + high), ``clip_frac/low``
    (A < 0 and ρ < 1 - ε_low: gradient cut by the floor), ``clip_frac/high`` (A > 0 and
    ρ > 1 + ε_high), ``ratio/mean``, ``ratio/min``, ``ratio/max``, ``approx_kl`` (k3 estimate
    of KL(π_old‖π): ρ - 1 - log ρ); with ``dual_clip``: ``clip_frac/dual``; with
    ``ref_logprobs``: ``kl``; with ``entropy``: ``entropy``; with ``behavior_logprobs``:
    ``tis/weight`` (mean truncated weight), ``tis/clip_frac`` (share truncated),
    ``tis/ratio/max`` (largest untruncated weight).
  """
  _check_options(beta, ref_logprobs, kl_estimator, epsilon_low, epsilon_high, dual_clip,
                 loss_agg, tis_cap, entropy_coef, entropy)
  optional = [x for x in (ref_logprobs, behavior_logprobs, entropy) if x is not None]
  xp = array_namespace(logprobs, old_logprobs, advantages, mask, *optional)
  mask = xp.asarray(mask)
  if mask.ndim != 2:
    raise ValueError(f"mask must have shape [B, T], got {tuple(mask.shape)}")
  named = {"logprobs": logprobs, "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs,
           "behavior_logprobs": behavior_logprobs, "entropy": entropy}
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

  valid = mask > 0
  dtype = float_dtype(xp, *[xp.asarray(v).dtype for v in named.values() if v is not None],
                      advantages.dtype)

  def clean(x: Any) -> Any:
    # Masked positions become 0 *before* any exp/log, so padding garbage cannot leak NaN
    # into the loss or (through 0·inf) into the gradient.
    return xp.where(valid, xp.asarray(x).astype(dtype), 0)

  logp, logp_old = clean(logprobs), clean(old_logprobs)
  adv = advantages.astype(dtype)
  adv = clean(adv[:, None] if adv.ndim == 1 else adv)

  log_ratio = logp - logp_old
  ratio = xp.exp(log_ratio)
  pg_unclipped = -adv * ratio
  pg_clipped = -adv * xp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
  pg = xp.maximum(pg_unclipped, pg_clipped)
  metrics: stats_lib.Stats = {}
  if dual_clip is not None:
    dual_bound = -adv * dual_clip
    dual_active = (adv < 0) & (pg > dual_bound)
    pg = xp.where(dual_active, dual_bound, pg)
    metrics["clip_frac/dual"] = stats_lib.mean_stat(dual_active, valid)
  if behavior_logprobs is not None:
    raw_weight = xp.exp(logp_old - clean(behavior_logprobs))
    tis_weight = xp.minimum(raw_weight, tis_cap)
    if xp is jnp:
      tis_weight = jax.lax.stop_gradient(tis_weight)
    pg = pg * tis_weight
    metrics["tis/weight"] = stats_lib.mean_stat(tis_weight, valid)
    metrics["tis/clip_frac"] = stats_lib.mean_stat(raw_weight > tis_cap, valid)
    metrics["tis/ratio/max"] = stats_lib.max_stat(raw_weight, valid)

  per_token = pg
  if ref_logprobs is not None:
    kl = kl_penalty(logp, clean(ref_logprobs), kl_estimator)
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

  clipped_low = (adv < 0) & (ratio < 1 - epsilon_low)
  clipped_high = (adv > 0) & (ratio > 1 + epsilon_high)
  metrics.update({
      "pg_loss": stats_lib.mean_stat(pg, valid),
      "clip_frac": stats_lib.mean_stat(clipped_low | clipped_high, valid),
      "clip_frac/low": stats_lib.mean_stat(clipped_low, valid),
      "clip_frac/high": stats_lib.mean_stat(clipped_high, valid),
      "ratio/mean": stats_lib.mean_stat(ratio, valid),
      "ratio/min": stats_lib.min_stat(ratio, valid),
      "ratio/max": stats_lib.max_stat(ratio, valid),
      "approx_kl": stats_lib.mean_stat(xp.expm1(log_ratio) - log_ratio, valid),
  })
  if xp is jnp:
    metrics = jax.lax.stop_gradient(metrics)
  return loss, metrics
