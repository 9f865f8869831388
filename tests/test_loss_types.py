"""GSPO, GSPO-token, CISPO and the sampler importance corrections against a float64 reference.

The reference below is written independently of `reasoning_rl.rl.losses`: whole-array numpy in
float64, importance weights formed with `exp` directly (the module works in log space), and the
gradient with respect to the current log-probs derived by hand from each paper's formula.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.rl import stats
from reasoning_rl.rl.off_policy import NO_DUAL_CLIP
from reasoning_rl.rl.losses import (IS_CORRECTIONS, LOSS_AGGREGATIONS, LOSS_TYPES,
                                    importance_weights, policy_loss)

# ---------------------------------------------------------------------------------------------
# Reference: value, metrics and d loss / d logp.
# ---------------------------------------------------------------------------------------------


def sampler_weights(old, behavior, mask, mode, threshold):
  """Per-token weight, 'capped' flag (above the upper bound) and 'masked' flag (weight set to 0;
  None for the truncating modes) of each correction mode, from the raw ratios."""
  if mode == "none":
    return np.ones_like(old), np.zeros(old.shape, bool), None
  if mode.startswith("token") or mode == "icepop":
    raw = np.exp(old - behavior)
  else:
    raw = np.repeat(np.exp(np.sum(mask * (old - behavior), axis=1))[:, None], old.shape[1], 1)
  if mode == "icepop":  # Ring-1T: k where alpha <= k <= beta, else 0
    capped = (raw > ICEPOP_BAND[1]) & mask
    masked = capped | ((raw < ICEPOP_BAND[0]) & mask)
    return np.where(masked, 0, raw), capped, masked
  capped = (raw > threshold) & mask
  if mode.endswith("truncate"):
    return np.minimum(raw, threshold), capped, None
  return np.where(capped, 0, raw), capped, capped


def dppo_term(logp, old, adv, low, high, divergence):
  """DPPO (Qi et al. 2026): -A·r, 0 where the token left the trust region in its advantage's
  direction; value, d/dlogp and the low / high masks."""
  p, p_old, ratio = np.exp(logp), np.exp(old), np.exp(logp - old)
  if divergence == "tv":
    up, down = p - p_old > high, p - p_old < -low
  else:
    with np.errstate(divide="ignore", invalid="ignore"):  # p = 1 at padding (logp zeroed)
      kl = p_old * np.log(p_old / p) + (1 - p_old) * np.log((1 - p_old) / (1 - p))
    up, down = (p > p_old) & (kl > high), (p < p_old) & (kl > low)
  masked_high, masked_low = (adv > 0) & up, (adv < 0) & down
  keep = ~(masked_high | masked_low)
  return np.where(keep, -adv * ratio, 0), np.where(keep, -adv * ratio, 0), masked_low, masked_high


def clipped_term(x, adv, low, high, dual_clip):
  """Value of max(-A·x, -A·clip(x)) (then the dual clip) and its derivative in x."""
  unclipped, clipped = -adv * x, -adv * np.clip(x, low, high)
  value = np.maximum(unclipped, clipped)
  slope = np.where((x >= low) & (x <= high) | (unclipped > clipped), -adv, 0.0)
  dual = np.zeros(x.shape, bool)
  if dual_clip is not None:
    dual = (adv < 0) & (value > -adv * dual_clip)
    value, slope = np.where(dual, -adv * dual_clip, value), np.where(dual, 0.0, slope)
  return value, slope, dual


def reference(logp, old, adv, mask, *, loss_type, loss_agg, is_correction="none", behavior=None,
              is_threshold=2.0, epsilon_low=0.2, epsilon_high=0.2, dual_clip=None, ref=None,
              beta=0.0, entropy=None, entropy_coef=0.0):
  mask = np.asarray(mask, bool)
  zero = lambda x: np.where(mask, x, 0.0)  # noqa: E731
  logp, old = zero(logp), zero(old)
  adv = zero(np.broadcast_to(adv[:, None], mask.shape) if np.ndim(adv) == 1 else adv)
  low, high = 1 - epsilon_low, 1 + epsilon_high
  lengths = mask.sum(1)
  rows = lengths > 0
  ratio = np.exp(logp - old)
  seq_ratio = np.exp(np.sum(logp - old, 1) / np.maximum(lengths, 1))
  seq_ratio_tokens = np.repeat(seq_ratio[:, None], mask.shape[1], 1)
  if loss_type == "cispo":
    weight = np.clip(ratio, low, high)
    pg, local_grad = -weight * adv * logp, -weight * adv
    flags = {"clip_frac/low": ratio < low, "clip_frac/high": ratio > high}
  elif loss_type.startswith("dppo"):
    pg, local_grad, masked_low, masked_high = dppo_term(
        logp, old, adv, epsilon_low, epsilon_high, loss_type.split("-")[1])
    flags = {"clip_frac/low": masked_low, "clip_frac/high": masked_high}
  else:
    x = ratio if loss_type == "ppo" else seq_ratio_tokens
    pg, slope, dual = clipped_term(x, adv, low, high, dual_clip)
    local_grad = slope * x  # d x / d logp_t = x for r_t and for s_{i,t} alike
    flags = {"clip_frac/low": (adv < 0) & (x < low), "clip_frac/high": (adv > 0) & (x > high)}
    if dual_clip is not None:
      flags["clip_frac/dual"] = dual
  flags["clip_frac"] = flags["clip_frac/low"] | flags["clip_frac/high"]

  is_weight, capped, masked = np.ones_like(pg), np.zeros(mask.shape, bool), None
  if behavior is not None:
    is_weight, capped, masked = sampler_weights(old, zero(behavior), mask, is_correction,
                                                is_threshold)
  per_token = is_weight * pg
  kl_grad = 0.0
  if ref is not None:  # k3
    gap = zero(ref) - logp
    per_token = per_token + beta * (np.exp(gap) - gap - 1)
    kl_grad = beta * (1 - np.exp(gap))
  if entropy is not None:
    per_token = per_token - entropy_coef * zero(entropy)

  num_sequences, num_tokens = max(rows.sum(), 1), max(mask.sum(), 1)
  if loss_agg == "token-mean":
    coef = mask / num_tokens
  elif loss_agg == "seq-mean-token-mean":
    coef = mask / np.maximum(lengths, 1)[:, None] / num_sequences
  else:
    coef = mask / mask.shape[1] / num_sequences
  loss = np.sum(coef * per_token)
  if loss_type == "gspo":  # s_i depends on every token of row i: d s_i / d logp_t = s_i / n_i
    row_sum = np.sum(coef * is_weight * slope, 1) * seq_ratio / np.maximum(lengths, 1)
    grad = mask * row_sum[:, None]
  else:
    grad = coef * is_weight * local_grad
  grad = grad + coef * kl_grad

  mean = lambda v: np.sum(np.where(mask, v, 0)) / mask.sum()  # noqa: E731
  metrics = {"pg_loss": mean(is_weight * pg), "ratio/mean": mean(ratio),
             "ratio/min": ratio[mask].min(), "ratio/max": ratio[mask].max(),
             "approx_kl": mean(ratio - 1 - (logp - old))}
  for name, flag in flags.items():
    metrics[name] = flag[rows].any(1).mean() if loss_type == "gspo" else mean(flag)
  if loss_type in ("gspo", "gspo-token"):
    metrics.update({"seq_ratio/mean": seq_ratio[rows].mean(), "seq_ratio/min":
                    seq_ratio[rows].min(), "seq_ratio/max": seq_ratio[rows].max()})
  if ref is not None:
    metrics["kl"] = mean(np.exp(zero(ref) - logp) - (zero(ref) - logp) - 1)
  if entropy is not None:
    metrics["entropy"] = mean(entropy)
  if behavior is not None:
    gap = np.abs(old - zero(behavior))
    metrics.update({"tis/abs_log_diff": mean(gap), "tis/abs_log_diff/max": gap[mask].max()})
    if is_correction != "none":
      metrics.update({"tis/weight": mean(is_weight), "tis/capped_token_frac": mean(capped),
                      "tis/capped_seq_frac": capped[rows].any(1).mean()})
    if masked is not None:
      metrics.update({"tis/masked_token_frac": mean(masked),
                      "tis/masked_seq_frac": masked[rows].any(1).mean()})
    if is_correction == "icepop":
      metrics["tis/floored_token_frac"] = mean(masked & ~capped)
  return loss, metrics, grad


# ---------------------------------------------------------------------------------------------
# Data: 7 completions, T = 6: one-token, empty and full rows, garbage (NaN / inf) in padding,
# ratios and sequence ratios beyond both clip bounds, and row 5 far off-policy with A < 0 (dual clip).
# ---------------------------------------------------------------------------------------------

LENGTHS = [6, 4, 1, 0, 5, 6, 3]
ADVANTAGES = np.array([1.0, -0.8, 0.6, np.nan, -1.2, -0.9, 0.7])
CLIP = dict(epsilon_low=0.2, epsilon_high=0.28)
DUAL_CLIP = 2.5
IS_THRESHOLD = 1.5
ICEPOP_BAND = (0.7, 1.5)  # narrower than Ring-1T's [0.5, 5], so that this data leaves it


def make_data(seed=0):
  rng = np.random.default_rng(seed)
  mask = np.arange(6)[None, :] < np.array(LENGTHS)[:, None]
  logp = -np.abs(rng.normal(size=mask.shape)) - 0.1
  old = logp - rng.normal(size=mask.shape) * 0.35
  old[5] = logp[5] - 1.5  # log-ratio +1.5 on every token: r = s = 4.5 > DUAL_CLIP
  old[1] += 0.45  # A < 0, s ≈ 0.64: below GSPO's floor
  old[2] -= 0.6  # A > 0, s ≈ 1.8: above GSPO's ceiling
  data = {"mask": mask, "logp": logp, "old": old,
          "behavior": old + rng.normal(size=mask.shape) * 0.4,
          "ref": logp + rng.normal(size=mask.shape) * 0.3,
          "entropy": np.abs(rng.normal(size=mask.shape)),
          "token_advantages": np.nan_to_num(ADVANTAGES)[:, None] + rng.normal(size=mask.shape)}
  # Keep every quantity away from the kinks, where a derivative is not defined.
  lengths = np.maximum(mask.sum(1), 1)
  seq = np.exp(np.sum(np.where(mask, logp - old, 0), 1) / lengths)
  tok_w = np.exp(old - data["behavior"])[mask]
  seq_w = np.exp(np.sum(np.where(mask, old - data["behavior"], 0), 1))
  for values in (np.exp(logp - old)[mask], seq, tok_w, seq_w):
    for kink in (0.8, 1.28, DUAL_CLIP, IS_THRESHOLD, *ICEPOP_BAND):
      assert np.min(np.abs(values - kink)) > 1e-3
  for key, garbage in (("logp", np.nan), ("old", -np.inf), ("behavior", np.inf),
                       ("ref", np.nan), ("token_advantages", np.nan)):
    data[key][~mask] = garbage
  return data


def loss_kwargs(loss_type, is_correction):
  return dict(CLIP, loss_type=loss_type, beta=0.05, entropy_coef=0.01,
              is_correction=is_correction, is_threshold=IS_THRESHOLD,
              icepop_low=ICEPOP_BAND[0], icepop_high=ICEPOP_BAND[1],
              dual_clip=None if loss_type in NO_DUAL_CLIP else DUAL_CLIP)


def run_jax(data, advantages, kwargs, with_behavior=True):
  """Loss, stats and d loss / d logp from the module in float64 jax."""
  with jax.enable_x64(True):
    arrays = {k: jnp.asarray(v) for k, v in data.items()}

    def loss_fn(logp):
      return policy_loss(logp, arrays["old"], jnp.asarray(advantages), arrays["mask"],
                         ref_logprobs=arrays["ref"], entropy=arrays["entropy"],
                         behavior_logprobs=arrays["behavior"] if with_behavior else None,
                         **kwargs)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(arrays["logp"])
    assert grad.dtype == jnp.float64
    return float(loss), metrics, np.asarray(grad)


def assert_metrics(got_stats, expected, rtol):
  got = stats.finalize(got_stats)
  assert sorted(got) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=rtol, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("is_correction", IS_CORRECTIONS)
@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_value_metrics_and_gradient_match_reference(loss_type, loss_agg, is_correction):
  data = make_data()
  kwargs = dict(loss_kwargs(loss_type, is_correction), loss_agg=loss_agg)
  reference_kwargs = {k: v for k, v in kwargs.items()
                      if k not in ("loss_type", "icepop_low", "icepop_high")}
  expected_loss, expected_metrics, expected_grad = reference(
      data["logp"], data["old"], ADVANTAGES, data["mask"], loss_type=loss_type,
      behavior=data["behavior"], ref=data["ref"], entropy=data["entropy"], **reference_kwargs)
  # The data exercises every branch this case has.
  assert expected_metrics["clip_frac/low"] > 0 and expected_metrics["clip_frac/high"] > 0
  if loss_type not in NO_DUAL_CLIP:
    assert expected_metrics["clip_frac/dual"] > 0
  if is_correction != "none":
    assert 0 < expected_metrics["tis/capped_seq_frac"] < 1

  loss, metrics = policy_loss(data["logp"], data["old"], ADVANTAGES, data["mask"],
                              behavior_logprobs=data["behavior"], ref_logprobs=data["ref"],
                              entropy=data["entropy"], **kwargs)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-12)
  assert_metrics(metrics, expected_metrics, rtol=1e-12)

  loss, metrics, grad = run_jax(data, ADVANTAGES, kwargs)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-12)
  assert_metrics(metrics, expected_metrics, rtol=1e-12)
  np.testing.assert_allclose(grad, expected_grad, rtol=1e-10, atol=1e-14)
  assert np.all(grad[~data["mask"]] == 0) and np.count_nonzero(grad) > 10


@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS)
def test_gspo_and_gspo_token_agree_unless_advantages_differ_within_a_sequence(loss_agg):
  data = make_data(seed=1)
  kwargs = dict(CLIP, loss_agg=loss_agg, dual_clip=DUAL_CLIP, beta=0.05, entropy_coef=0.01)
  sequence = run_jax(data, ADVANTAGES, dict(kwargs, loss_type="gspo"))
  token = run_jax(data, ADVANTAGES, dict(kwargs, loss_type="gspo-token"))
  np.testing.assert_allclose(token[0], sequence[0], rtol=1e-12)
  np.testing.assert_allclose(token[2], sequence[2], rtol=1e-10, atol=1e-14)
  assert np.count_nonzero(sequence[2]) > 10

  # Token-level advantages: gspo-token follows its own formula, and its gradient leaves gspo's
  # (here with each sequence's mean advantage, the closest [B] input gspo accepts).
  token_adv = data["token_advantages"]
  row_mean = np.array([np.mean(a[m]) if m.any() else 0.0 for a, m in zip(token_adv,
                                                                         data["mask"])])
  loss, _, grad = run_jax(data, token_adv, dict(kwargs, loss_type="gspo-token"),
                          with_behavior=False)
  expected_loss, _, expected_grad = reference(
      data["logp"], data["old"], token_adv, data["mask"], loss_type="gspo-token",
      ref=data["ref"], entropy=data["entropy"], **kwargs)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-12)
  np.testing.assert_allclose(grad, expected_grad, rtol=1e-10, atol=1e-14)
  _, _, mean_grad = run_jax(data, row_mean, dict(kwargs, loss_type="gspo"), with_behavior=False)
  assert np.max(np.abs(grad - mean_grad)) > 1e-3


def test_cispo_gradient_is_minus_clipped_weight_times_advantage():
  data = make_data(seed=2)
  mask, ratio = data["mask"], np.exp(data["logp"] - data["old"])
  options = dict(CLIP, loss_agg="token-mean")
  # ref / entropy go in with weight 0 (beta = entropy_coef = 0): the pure policy gradient.
  _, _, grad = run_jax(data, ADVANTAGES, dict(options, loss_type="cispo"), with_behavior=False)
  weight = np.clip(ratio, 0.8, 1.28)
  expected = np.where(mask, -weight * np.nan_to_num(ADVANTAGES)[:, None] / mask.sum(), 0)
  np.testing.assert_allclose(grad, expected, rtol=1e-12, atol=1e-15)
  # Unlike PPO, a token whose ratio left the trust region keeps its (bounded) gradient.
  _, _, ppo_grad = run_jax(data, ADVANTAGES, dict(options, loss_type="ppo"), with_behavior=False)
  outside = mask & ((ratio > 1.28) & (np.nan_to_num(ADVANTAGES)[:, None] > 0))
  assert outside.any() and np.all(ppo_grad[outside] == 0) and np.all(grad[outside] != 0)
  # epsilon_low = 1: no floor, the weight is the raw ratio however small.
  _, _, no_floor = run_jax(data, ADVANTAGES, dict(options, loss_type="cispo", epsilon_low=1.0),
                           with_behavior=False)
  expected = np.where(mask, -np.minimum(ratio, 1.28) * np.nan_to_num(ADVANTAGES)[:, None]
                      / mask.sum(), 0)
  assert (mask & (ratio < 0.8)).any()
  np.testing.assert_allclose(no_floor, expected, rtol=1e-12, atol=1e-15)


def test_importance_weights_hand_values():
  # log w per token; C = 2 (log 2 ≈ 0.693). Row 2 is empty (garbage behind the mask).
  log_w = np.array([[0.0, 1.0, -0.5], [0.3, 0.3, 0.0], [5.0, 5.0, 5.0]])
  mask = np.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]], bool)
  old, behavior = np.zeros_like(log_w), -log_w
  e = np.exp
  expected = {
      "token-truncate": ([[1, 2, e(-0.5)], [e(0.3), e(0.3), 0]], 1 / 5, 1 / 2),
      "token-mask": ([[1, 0, e(-0.5)], [e(0.3), e(0.3), 0]], 1 / 5, 1 / 2),
      # row sums: 0.5 (kept, W = e^0.5), 0.6 (kept, W = e^0.6)
      "sequence-truncate": ([[e(0.5)] * 3, [e(0.6), e(0.6), 0]], 0, 0),
      "sequence-mask": ([[e(0.5)] * 3, [e(0.6), e(0.6), 0]], 0, 0),
  }
  for mode, (weights, token_frac, seq_frac) in expected.items():
    weight, got = importance_weights(old, behavior, mask, mode, 2.0)
    np.testing.assert_allclose(weight, np.array(weights + [[0, 0, 0]], float), rtol=1e-12)
    got = stats.finalize(got)
    assert got["tis/capped_token_frac"] == pytest.approx(token_frac)
    assert got["tis/capped_seq_frac"] == pytest.approx(seq_frac)
    assert got["tis/abs_log_diff"] == pytest.approx((0 + 1 + 0.5 + 0.3 + 0.3) / 5)
    assert got["tis/abs_log_diff/max"] == pytest.approx(1.0)
  # Threshold 1.7 (log ≈ 0.531): row 1's sequence (0.6) is capped, row 0's (0.5) is not.
  weight, got = importance_weights(old, behavior, mask, "sequence-mask", 1.7)
  np.testing.assert_allclose(weight[:2], [[e(0.5)] * 3, [0, 0, 0]], rtol=1e-12)
  assert stats.finalize(got)["tis/capped_token_frac"] == pytest.approx(2 / 5)
  assert stats.finalize(got)["tis/capped_seq_frac"] == pytest.approx(1 / 2)
  weight, _ = importance_weights(old, behavior, mask, "sequence-truncate", 1.7)
  np.testing.assert_allclose(weight[1], [1.7, 1.7, 0], rtol=1e-12)
  _, got = importance_weights(old, behavior, mask, "none", 1.7)
  assert sorted(got) == ["tis/abs_log_diff", "tis/abs_log_diff/max"]


def test_sequence_weights_never_overflow_and_carry_no_gradient():
  mask = jnp.ones((2, 4), bool)
  old = jnp.zeros((2, 4), jnp.float32)
  behavior = jnp.array([[-60.0] * 4, [0.1] * 4])  # row 0: W = e^240, beyond float32
  for mode, row0 in (("sequence-truncate", 3.0), ("sequence-mask", 0.0)):
    weight, _ = importance_weights(old, behavior, mask, mode, 3.0)
    np.testing.assert_allclose(np.asarray(weight[0]), row0)
    np.testing.assert_allclose(np.asarray(weight[1]), np.exp(-0.4), rtol=1e-6)

  def loss_of(behavior_, old_):
    return policy_loss(jnp.full((2, 4), -1.0), old_, jnp.array([1.0, -1.0]), mask,
                       behavior_logprobs=behavior_, is_correction="token-truncate",
                       loss_type="cispo")[0]

  grad_behavior, grad_old = jax.grad(loss_of, argnums=(0, 1))(behavior, old)
  assert np.all(np.asarray(grad_behavior) == 0)
  assert np.all(np.asarray(grad_old) == 0)  # cispo's weight is a constant too
