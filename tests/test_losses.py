"""policy_loss, aggregation, KL, entropy and stats against a plain-Python loop reference."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import stats
from reasoning_rl.rl.advantages import ESTIMATORS, group_advantages
from reasoning_rl.rl.off_policy import NO_DUAL_CLIP
from reasoning_rl.rl.losses import (KL_ESTIMATORS, LOSS_AGGREGATIONS, LOSS_TYPES,
                                    aggregate_loss, loss_normalizers, policy_loss, token_entropy)

# ---------------------------------------------------------------------------------------------
# Independent reference: one token at a time, Python floats, formulas as written in the papers.
# ---------------------------------------------------------------------------------------------


def reference_policy_loss(logp, old, adv, mask, *, ref=None, beta=0.0, kl_estimator="k3",
                          epsilon_low=0.2, epsilon_high=0.2, dual_clip=None,
                          loss_agg="seq-mean-token-mean", behavior=None, is_threshold=2.0,
                          entropy=None, entropy_coef=0.0, num_sequences=None, num_tokens=None,
                          max_completion_length=None):
  num_rows, num_steps = np.shape(mask)
  row_sums, row_counts = [], []
  sums = {name: 0.0 for name in ("pg", "clip", "low", "high", "dual", "ratio", "approx_kl",
                                 "kl", "entropy", "tis_w", "tis_clip", "tis_diff")}
  ratios, log_diffs, capped_rows, count = [], [], set(), 0
  for b in range(num_rows):
    row_sum, row_count = 0.0, 0
    for t in range(num_steps):
      if not mask[b][t]:
        continue
      a = float(adv[b]) if np.ndim(adv) == 1 else float(adv[b][t])
      log_ratio = float(logp[b][t]) - float(old[b][t])
      rho = math.exp(log_ratio)
      rho_clipped = min(max(rho, 1 - epsilon_low), 1 + epsilon_high)
      pg = max(-a * rho, -a * rho_clipped)
      if dual_clip is not None and a < 0:
        if pg > -a * dual_clip:
          sums["dual"] += 1
        pg = min(pg, -a * dual_clip)
      if behavior is not None:  # token-truncate
        raw = math.exp(float(old[b][t]) - float(behavior[b][t]))
        weight = min(raw, is_threshold)
        log_diffs.append(abs(float(old[b][t]) - float(behavior[b][t])))
        sums["tis_w"] += weight
        sums["tis_clip"] += raw > is_threshold
        if raw > is_threshold:
          capped_rows.add(b)
        pg *= weight
      loss = pg
      if ref is not None:
        d = float(ref[b][t]) - float(logp[b][t])
        kl = {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[kl_estimator]
        loss += beta * kl
        sums["kl"] += kl
      if entropy is not None:
        loss -= entropy_coef * float(entropy[b][t])
        sums["entropy"] += float(entropy[b][t])
      row_sum += loss
      row_count += 1
      low, high = a < 0 and rho < 1 - epsilon_low, a > 0 and rho > 1 + epsilon_high
      sums["pg"] += pg
      sums["low"] += low
      sums["high"] += high
      sums["clip"] += low or high
      sums["ratio"] += rho
      sums["approx_kl"] += rho - 1 - log_ratio
      ratios.append(rho)
    row_sums.append(row_sum)
    row_counts.append(row_count)
    count += row_count

  if num_sequences is None:
    num_sequences = sum(1 for c in row_counts if c > 0)
  if num_tokens is None:
    num_tokens = count
  if loss_agg == "token-mean":
    loss = sum(row_sums) / max(num_tokens, 1)
  elif loss_agg == "seq-mean-token-mean":
    loss = sum(s / c for s, c in zip(row_sums, row_counts) if c > 0) / max(num_sequences, 1)
  else:
    length = max_completion_length or num_steps
    loss = sum(s / length for s in row_sums) / max(num_sequences, 1)

  mean = lambda key: sums[key] / count if count else math.nan
  metrics = {"pg_loss": mean("pg"), "clip_frac": mean("clip"), "clip_frac/low": mean("low"),
             "clip_frac/high": mean("high"), "ratio/mean": mean("ratio"),
             "ratio/min": min(ratios, default=math.nan),
             "ratio/max": max(ratios, default=math.nan), "approx_kl": mean("approx_kl")}
  if dual_clip is not None:
    metrics["clip_frac/dual"] = mean("dual")
  if ref is not None:
    metrics["kl"] = mean("kl")
  if entropy is not None:
    metrics["entropy"] = mean("entropy")
  if behavior is not None:
    num_rows_valid = sum(1 for c in row_counts if c > 0)
    metrics.update({"tis/weight": mean("tis_w"), "tis/capped_token_frac": mean("tis_clip"),
                    "tis/capped_seq_frac": len(capped_rows) / num_rows_valid,
                    "tis/abs_log_diff": sum(log_diffs) / count,
                    "tis/abs_log_diff/max": max(log_diffs, default=math.nan)})
  return loss, metrics


# ---------------------------------------------------------------------------------------------
# Test data: 3 prompts x 4 completions, T = 5; one-token completions, a fully masked row, an
# all-equal reward group, garbage (NaN / inf) at padded positions; "extreme" adds log-ratios
# of +-30 and reference gaps of +-30.
# ---------------------------------------------------------------------------------------------

LENGTHS = [5, 3, 1, 4, 5, 2, 5, 0, 1, 5, 3, 4]
REWARDS = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.2, 1.3, -0.7, 0.9]])
NUM_STEPS = 5


def make_batch(kind, seed=0):
  rng = np.random.default_rng(seed)
  shape = (len(LENGTHS), NUM_STEPS)
  mask = np.arange(NUM_STEPS)[None, :] < np.array(LENGTHS)[:, None]
  logp = -np.abs(rng.normal(size=shape)) * 2 - 0.05
  old = logp + rng.normal(size=shape) * 0.3
  ref = logp + rng.normal(size=shape) * 0.3
  behavior = old + rng.normal(size=shape) * 0.5
  if kind == "extreme":
    # row 0 has A > 0, row 1 A < 0 (binary group); row 8 is a one-token completion.
    for (b, t), delta in {(0, 0): 30.0, (0, 1): -30.0, (1, 0): 30.0, (1, 2): -30.0,
                          (8, 0): 30.0, (9, 3): -30.0}.items():
      old[b, t] = logp[b, t] - delta
    ref[3, 1], ref[10, 0] = logp[3, 1] + 30.0, logp[10, 0] - 30.0
  for array, garbage in ((logp, np.nan), (old, -np.inf), (ref, np.inf), (behavior, np.nan)):
    array[~mask] = garbage
  return {"logp": logp, "old": old, "ref": ref, "behavior": behavior, "mask": mask}


CLIP_SETTINGS = {
    "symmetric": dict(epsilon_low=0.2, epsilon_high=0.2),
    "clip_higher": dict(epsilon_low=0.2, epsilon_high=0.28),
    "dual": dict(epsilon_low=0.2, epsilon_high=0.2, dual_clip=3.0),
    "asymmetric_dual": dict(epsilon_low=0.1, epsilon_high=0.3, dual_clip=2.0),
}


def assert_metrics_close(got_stats, expected, rtol, atol=1e-6):
  got = stats.finalize(got_stats)
  assert sorted(got) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(got[name], expected[name], rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("kind", ["typical", "extreme"])
@pytest.mark.parametrize("clip", sorted(CLIP_SETTINGS))
@pytest.mark.parametrize("kl_estimator", [None, *KL_ESTIMATORS])
@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_policy_loss_matches_reference(estimator, loss_agg, kl_estimator, clip, kind):
  batch = make_batch(kind)
  advantages = group_advantages(REWARDS, estimator=estimator).reshape(-1)
  kwargs = dict(loss_agg=loss_agg, **CLIP_SETTINGS[clip])
  if kl_estimator is not None:
    kwargs.update(beta=0.05, kl_estimator=kl_estimator)
  ref = None if kl_estimator is None else batch["ref"]
  expected_loss, expected_metrics = reference_policy_loss(
      batch["logp"], batch["old"], advantages, batch["mask"], ref=ref, **kwargs)

  # numpy path: float64 end to end.
  loss, metrics = policy_loss(batch["logp"], batch["old"], advantages, batch["mask"],
                              ref_logprobs=ref, **kwargs)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-10, atol=1e-12)
  assert_metrics_close(metrics, expected_metrics, rtol=1e-10, atol=1e-12)

  # jax path (eager, float32): same numbers to float32 precision.
  as_jax = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
  loss, metrics = policy_loss(as_jax(batch["logp"]), as_jax(batch["old"]), as_jax(advantages),
                              jnp.asarray(batch["mask"]), ref_logprobs=as_jax(ref), **kwargs)
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(float(loss), expected_loss, rtol=2e-5, atol=1e-6)
  assert_metrics_close(metrics, expected_metrics, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("is_threshold", [0.5, 2.0, 10.0])
def test_truncated_importance_sampling(loss_agg, is_threshold):
  batch = make_batch("typical", seed=1)
  advantages = group_advantages(REWARDS, estimator="grpo").reshape(-1)
  kwargs = dict(loss_agg=loss_agg, is_threshold=is_threshold, dual_clip=3.0)
  expected_loss, expected_metrics = reference_policy_loss(
      batch["logp"], batch["old"], advantages, batch["mask"], behavior=batch["behavior"],
      **kwargs)
  kwargs["is_correction"] = "token-truncate"
  loss, metrics = policy_loss(batch["logp"], batch["old"], advantages, batch["mask"],
                              behavior_logprobs=batch["behavior"], **kwargs)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-10)
  assert_metrics_close(metrics, expected_metrics, rtol=1e-10)
  if is_threshold == 2.0:  # the data has weights on both sides of the cap
    assert 0 < stats.finalize(metrics)["tis/capped_token_frac"] < 1
  # Behaviour = old: every raw weight is 1, so the loss is the on-policy one scaled by min(1, C).
  same_loss, same_metrics = policy_loss(batch["logp"], batch["old"], advantages, batch["mask"],
                                        behavior_logprobs=batch["old"], **kwargs)
  plain_loss, _ = policy_loss(batch["logp"], batch["old"], advantages, batch["mask"],
                              **dict(kwargs, is_correction="none"))
  np.testing.assert_allclose(same_loss, min(1.0, is_threshold) * plain_loss, rtol=1e-12)
  assert stats.finalize(same_metrics)["tis/weight"] == pytest.approx(min(1.0, is_threshold))


def test_entropy_bonus_and_per_token_advantages():
  batch = make_batch("typical", seed=2)
  rng = np.random.default_rng(3)
  entropy = np.abs(rng.normal(size=batch["mask"].shape))
  token_advantages = rng.normal(size=batch["mask"].shape)  # PPO-with-value style [B, T]
  for loss_agg in LOSS_AGGREGATIONS:
    kwargs = dict(loss_agg=loss_agg, entropy_coef=0.01, epsilon_high=0.28)
    expected_loss, expected_metrics = reference_policy_loss(
        batch["logp"], batch["old"], token_advantages, batch["mask"], entropy=entropy,
        **kwargs)
    loss, metrics = policy_loss(batch["logp"], batch["old"], token_advantages, batch["mask"],
                                entropy=entropy, **kwargs)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-10)
    assert_metrics_close(metrics, expected_metrics, rtol=1e-10)


def test_kl_estimators_hand_values():
  # logp = log 0.5, ref = log 0.25: x = ref - logp = -log 2.
  logp, ref, x = np.log([[0.5]]), np.log([[0.25]]), -math.log(2)
  expected = {"k1": math.log(2), "k2": x * x / 2, "k3": 0.5 + math.log(2) - 1}
  for estimator, value in expected.items():
    _, metrics = policy_loss(logp, logp, np.zeros(1), np.ones((1, 1)), ref_logprobs=ref,
                             kl_estimator=estimator)
    assert stats.finalize(metrics)["kl"] == pytest.approx(value, rel=1e-12)


def test_aggregations_hand_values():
  per_token = np.array([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0] * 4])
  mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
  assert aggregate_loss(per_token, mask, "token-mean") == pytest.approx(10 / 4)
  assert aggregate_loss(per_token, mask, "seq-mean-token-mean") == pytest.approx((2 + 4) / 2)
  assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm") == pytest.approx(
      (6 / 4 + 4 / 4) / 2)
  assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm",
                        max_completion_length=8) == pytest.approx((6 / 8 + 4 / 8) / 2)
  assert aggregate_loss(per_token, np.zeros_like(mask), "token-mean") == 0.0
  normalizers = loss_normalizers(mask)
  assert (int(normalizers["num_sequences"]), int(normalizers["num_tokens"])) == (2, 4)


def test_padding_garbage_never_reaches_loss_or_gradient():
  batch = make_batch("typical")
  advantages = jnp.asarray(group_advantages(REWARDS).reshape(-1))
  for loss_agg in LOSS_AGGREGATIONS:
    def loss_fn(logp):
      return policy_loss(logp, jnp.asarray(batch["old"]), advantages, jnp.asarray(batch["mask"]),
                         ref_logprobs=jnp.asarray(batch["ref"]), beta=0.1, loss_agg=loss_agg,
                         behavior_logprobs=jnp.asarray(batch["behavior"]),
                         is_correction="sequence-mask")
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(batch["logp"]))
    assert np.isfinite(float(loss))
    assert all(np.isfinite(v) for v in stats.finalize(metrics).values())
    grad = np.asarray(grad)
    assert np.all(np.isfinite(grad)) and np.all(grad[~batch["mask"]] == 0)
    assert np.all(grad[7] == 0)  # the fully masked row
    assert np.count_nonzero(grad) > 10


def test_fully_masked_batch_gives_zero_and_nan_free_stats():
  logp = jnp.full((2, 3), jnp.nan)
  loss, metrics = policy_loss(logp, logp, jnp.ones(2), jnp.zeros((2, 3)))
  assert float(loss) == 0.0
  finalized = stats.finalize(metrics)
  assert all(math.isnan(v) for v in finalized.values())  # count == 0 → nan, never a crash
  assert all(int(count) == 0 for _, count in metrics.values())


FD_CASES = {
    "dual_k3_seqmean": dict(dual_clip=3.0, ref=True, beta=0.1, kl_estimator="k3",
                            loss_agg="seq-mean-token-mean"),
    "asym_k2_tokenmean_tis_entropy": dict(epsilon_low=0.1, epsilon_high=0.3, ref=True, beta=0.2,
                                          kl_estimator="k2", loss_agg="token-mean",
                                          behavior=True, entropy_coef=0.05),
    "k1_sumnorm": dict(ref=True, beta=0.5, kl_estimator="k1", loss_agg="seq-mean-token-sum-norm"),
}


@pytest.mark.parametrize("case", sorted(FD_CASES))
def test_grad_matches_central_finite_differences(case):
  options = dict(FD_CASES[case])
  with jax.enable_x64(True):
    rng = np.random.default_rng(4)
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], bool)
    logp = -np.abs(rng.normal(size=mask.shape)) - 0.1
    old = logp + np.array([[0.5, -0.6, 0.05, 1.5], [-0.05, 0.4, 0, 0], [-1.3, 0, 0, 0]])
    advantages = np.array([1.2, -0.7, -1.5])
    entropy = np.abs(rng.normal(size=mask.shape))
    kwargs = {k: v for k, v in options.items() if k not in ("ref", "behavior")}
    if options.get("ref"):
      kwargs["ref_logprobs"] = jnp.asarray(logp + rng.normal(size=mask.shape) * 0.5)
    if options.get("behavior"):
      kwargs["behavior_logprobs"] = jnp.asarray(old + rng.normal(size=mask.shape) * 0.5)
      kwargs["is_correction"] = "token-truncate"
    # Stay away from the kinks of the clip (finite differences are meaningless there).
    ratios = np.exp(logp - old)[mask]
    kinks = [1 - kwargs.get("epsilon_low", 0.2), 1 + kwargs.get("epsilon_high", 0.2),
             kwargs.get("dual_clip", 100.0)]
    assert min(abs(r - k) for r in ratios for k in kinks) > 1e-2

    @jax.jit
    def loss_fn(logp_, entropy_):
      return policy_loss(logp_, jnp.asarray(old), jnp.asarray(advantages), jnp.asarray(mask),
                         entropy=entropy_, **kwargs)[0]

    grads = jax.grad(loss_fn, argnums=(0, 1))(jnp.asarray(logp), jnp.asarray(entropy))
    h = 1e-6
    for index, base in enumerate((logp, entropy)):
      numeric = np.zeros_like(base)
      for pos in np.ndindex(base.shape):
        plus, minus = base.copy(), base.copy()
        plus[pos] += h
        minus[pos] -= h
        args_plus = [jnp.asarray(a) for a in ((plus, entropy) if index == 0 else (logp, plus))]
        args_minus = [jnp.asarray(a) for a in ((minus, entropy) if index == 0 else (logp, minus))]
        numeric[pos] = (float(loss_fn(*args_plus)) - float(loss_fn(*args_minus))) / (2 * h)
      assert grads[index].dtype == jnp.float64
      np.testing.assert_allclose(np.asarray(grads[index]), numeric, rtol=1e-6, atol=1e-8)
    assert np.count_nonzero(np.asarray(grads[0])) >= 5


@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_four_micro_batches_equal_one_full_batch(loss_agg, loss_type):
  rng = np.random.default_rng(5)
  lengths = np.array([5, 2, 0, 5, 1, 5, 3, 5])
  num_steps = 6  # the full batch carries one more padding column than any micro-batch
  mask = np.arange(num_steps)[None, :] < lengths[:, None]
  logp = -np.abs(rng.normal(size=mask.shape)) - 0.1
  old = logp + rng.normal(size=mask.shape) * 0.3
  ref = logp + rng.normal(size=mask.shape) * 0.3
  behavior = old + rng.normal(size=mask.shape) * 0.3
  advantages = rng.normal(size=len(lengths))
  options = dict(beta=0.04, loss_agg=loss_agg, epsilon_high=0.28,
                 max_completion_length=num_steps, is_threshold=1.5)
  correction = {"ppo": "token-truncate", "gspo": "sequence-mask", "gspo-token": "sequence-truncate",
                "cispo": "token-mask", "dppo-tv": "icepop", "dppo-kl": "token-truncate"}[loss_type]
  # the rejections are per row, so they must split over micro-batches as well
  rejection = {"dppo-tv": "seq-geo-mean", "dppo-kl": "seq-mean-k3"}.get(loss_type, "none")
  loss_options = dict(options, loss_type=loss_type, is_correction=correction,
                      rejection=rejection, rejection_geo_low=0.9, rejection_geo_high=1.1,
                      rejection_k3_threshold=0.05, icepop_low=0.8, icepop_high=1.3,
                      is_threshold_low=0.7 if loss_type == "dppo-kl" else 0.0,
                      dual_clip=None if loss_type in NO_DUAL_CLIP else 3.0)

  @jax.jit
  @functools.partial(jax.value_and_grad, has_aux=True)
  def loss_and_grad(logp_, old_, ref_, behavior_, adv_, mask_, num_sequences, num_tokens):
    return policy_loss(logp_, old_, adv_, mask_, ref_logprobs=ref_, behavior_logprobs=behavior_,
                       num_sequences=num_sequences, num_tokens=num_tokens, **loss_options)

  full_mask = jnp.asarray(mask)
  normalizers = loss_normalizers(full_mask)
  as_jax = lambda *arrays: [jnp.asarray(a, jnp.float32) for a in arrays]
  (full_loss, full_metrics), full_grad = loss_and_grad(
      *as_jax(logp, old, ref, behavior, advantages), full_mask, **normalizers)
  if loss_type == "ppo":  # the other types are checked against a reference in test_loss_types
    expected_loss, _ = reference_policy_loss(logp, old, advantages, mask, ref=ref,
                                             behavior=behavior, dual_clip=3.0, **options)
    np.testing.assert_allclose(float(full_loss), expected_loss, rtol=1e-5)

  micro_losses, micro_metrics, micro_grads, naive_losses = [], [], [], []
  width = num_steps - 1  # each micro-batch trimmed to its own padding
  for rows in np.split(np.arange(len(lengths)), 4):
    part = [a[rows][:, :width] for a in (logp, old, ref, behavior)]
    (loss, metrics), grad = loss_and_grad(*as_jax(*part, advantages[rows]),
                                          jnp.asarray(mask[rows][:, :width]), **normalizers)
    micro_losses.append(float(loss))
    micro_metrics.append(metrics)
    micro_grads.append(np.pad(np.asarray(grad), ((0, 0), (0, num_steps - width))))
    naive_losses.append(policy_loss(part[0], part[1], advantages[rows], mask[rows][:, :width],
                                    ref_logprobs=part[2], behavior_logprobs=part[3],
                                    **loss_options)[0])

  np.testing.assert_allclose(sum(micro_losses), float(full_loss), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.concatenate(micro_grads), np.asarray(full_grad), rtol=1e-5,
                             atol=1e-7)
  merged, full = stats.finalize(stats.merge_all(micro_metrics)), stats.finalize(full_metrics)
  assert sorted(merged) == sorted(full)
  for name in full:
    np.testing.assert_allclose(merged[name], full[name], rtol=1e-5, atol=1e-7, err_msg=name)
  # Without the whole-batch normalisers the micro-batches weight rows differently.
  assert abs(sum(naive_losses) - float(full_loss)) > 1e-3


def test_jit_matches_numpy_float64():
  batch = make_batch("typical", seed=6)
  advantages = group_advantages(REWARDS, estimator="dr_grpo").reshape(-1)
  for loss_agg, kl_estimator in (("token-mean", "k3"), ("seq-mean-token-sum-norm", "k2")):
    options = dict(beta=0.04, kl_estimator=kl_estimator, loss_agg=loss_agg, epsilon_high=0.28,
                   dual_clip=3.0, is_correction="token-mask")
    expected_loss, expected_metrics = policy_loss(
        batch["logp"], batch["old"], advantages, batch["mask"], ref_logprobs=batch["ref"],
        behavior_logprobs=batch["behavior"], **options)
    normalizers = {k: int(v) for k, v in loss_normalizers(batch["mask"]).items()}

    @jax.jit
    def jitted(logp, old, adv, mask, ref, behavior, num_sequences, num_tokens):
      return policy_loss(logp, old, adv, mask, ref_logprobs=ref, behavior_logprobs=behavior,
                         num_sequences=num_sequences, num_tokens=num_tokens, **options)

    args = [jnp.asarray(batch[k], jnp.float32) for k in ("logp", "old")]
    args += [jnp.asarray(advantages, jnp.float32), jnp.asarray(batch["mask"])]
    args += [jnp.asarray(batch[k], jnp.float32) for k in ("ref", "behavior")]
    loss, metrics = jitted(*args, normalizers["num_sequences"], normalizers["num_tokens"])
    # the loss is a near-cancelling mean of O(1) terms (|A| <= 1, ratios ~1): float32's rounding is
    # absolute on the terms' scale, not relative to the small mean (2.7e-8 here against rtol's
    # 3.2e-8, so other CPUs' sum orders broke it); a wrong clip or weight moves it by ~1e-3.
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-5, atol=1e-6)
    assert_metrics_close(metrics, stats.finalize(expected_metrics), rtol=1e-5)


def test_bfloat16_inputs_are_computed_in_float32():
  batch = make_batch("typical", seed=8)
  advantages = group_advantages(REWARDS).reshape(-1)
  low = {k: jnp.asarray(batch[k], jnp.bfloat16) for k in ("logp", "old", "ref")}
  loss, metrics = policy_loss(low["logp"], low["old"], advantages, batch["mask"],
                              ref_logprobs=low["ref"], beta=0.1)
  assert loss.dtype == jnp.float32 and metrics["kl"][0].dtype == jnp.float32
  # Same numbers as float64 on the bf16-rounded values: no arithmetic happened in bf16.
  rounded = {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in low.items()}
  expected, _ = reference_policy_loss(rounded["logp"], rounded["old"], advantages,
                                      batch["mask"], ref=rounded["ref"], beta=0.1)
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def test_token_entropy():
  rng = np.random.default_rng(7)
  logits = rng.normal(size=(2, 3, 11)) * 3
  expected = np.zeros((2, 3))
  for pos in np.ndindex(2, 3):
    z = logits[pos]
    probs = [math.exp(v) for v in z]
    total = sum(probs)
    expected[pos] = -sum(p / total * math.log(p / total) for p in probs)
  np.testing.assert_allclose(np.asarray(token_entropy(jnp.asarray(logits))), expected,
                             rtol=1e-5)
  uniform = token_entropy(jnp.zeros((1, 8), jnp.bfloat16))
  # -Σ p log p over 8 float32 terms: up to ~8 ulp (1e-6 relative) from the sum's order alone
  assert uniform.dtype == jnp.float32 and float(uniform[0]) == pytest.approx(math.log(8), 1e-5)
  masked = jnp.array([[0.0, -jnp.inf, 0.0, -jnp.inf]])
  value, grad = jax.jit(jax.value_and_grad(lambda z: token_entropy(z).sum()))(masked)
  assert float(value) == pytest.approx(math.log(2), 1e-6)
  assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(kl_estimator="k4"), r"config\.algo\.kl_estimator='k4': unknown KL estimator; use one "
     r"of \['k1', 'k2', 'k3'\]"),
    (dict(loss_agg="mean"), r"config\.algo\.loss_agg='mean': unknown loss aggregation; use one "
     r"of \['seq-mean-token-mean', 'token-mean', 'seq-mean-token-sum-norm'\]"),
    (dict(beta=0.1), "beta=0.1 needs ref_logprobs"),
    (dict(entropy_coef=0.1), "entropy_coef=0.1 needs entropy"),
    (dict(dual_clip=0.9), "dual_clip=0.9 must be > 1"),
    (dict(epsilon_low=1.0), "epsilon_low=1.0"),
    (dict(epsilon_high=-0.1), "epsilon_high=-0.1"),
    (dict(is_threshold=0.0), "is_threshold=0.0"),
    (dict(loss_type="grpo"), r"config\.algo\.loss_type='grpo': unknown policy loss; use one of "
     r"\['ppo', 'gspo', 'gspo-token', 'cispo', 'dppo-tv', 'dppo-kl'\]"),
    (dict(is_correction="sequence"), r"config\.algo\.is_correction='sequence': unknown sampler "
     r"importance correction; use one of \['none', 'token-truncate'"),
    (dict(is_correction="token-mask"), "is_correction='token-mask' needs behavior_logprobs"),
    (dict(loss_type="cispo", dual_clip=3.0), "dual_clip=3.0 does not apply to loss_type='cispo'"),
    (dict(loss_type="dppo-kl", dual_clip=3.0),
     "dual_clip=3.0 does not apply to loss_type='dppo-kl'"),
    (dict(is_threshold_low=2.0), r"is_threshold_low=2.0 must be in \[0, is_threshold=2.0\)"),
    (dict(icepop_low=0.5, icepop_high=0.4), "need 0 <= icepop_low < icepop_high"),
    (dict(rejection="seq-k3"), r"config\.algo\.rejection='seq-k3': unknown off-policy "
     r"rejection; use one of \['none', 'seq-geo-mean', 'seq-mean-k3'\]"),
    (dict(loss_type="cispo", epsilon_low=1.5), r"epsilon_low=1.5 must be in \[0, 1\] for cispo"),
    (dict(max_completion_length=0), "max_completion_length=0"),
])
def test_bad_options_raise_config_error(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    policy_loss(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros(2), np.ones((2, 3)), **kwargs)


def test_bad_shapes_raise_value_error():
  with pytest.raises(ValueError, match=r"old_logprobs has shape \(2, 4\)"):
    policy_loss(np.zeros((2, 3)), np.zeros((2, 4)), np.zeros(2), np.ones((2, 3)))
  with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
    policy_loss(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros(3), np.ones((2, 3)))
  with pytest.raises(ValueError, match="loss_type='gspo' needs one advantage per sequence"):
    policy_loss(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 3)), np.ones((2, 3)),
                loss_type="gspo")
