"""The off-policy masks of `reasoning_rl.rl.off_policy` (docs/off_policy.md) against hand-computed
values: IcePop's token band, the TIS floor, the geometric-mean and mean-k3 sequence rejections
(composed with a correction), DPPO's Binary-TV / Binary-KL masks, their metrics, and their
settings' checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import stats
from reasoning_rl.rl.losses import importance_weights, policy_loss, rejection_mask
from reasoning_rl.rl.step_config import StepConfig

e = np.exp
# log ρ = log π_old − log μ per token; row 2 is empty (garbage behind the mask).
LOG_RHO = np.array([[0.0, 1.0, -0.5, -1.0], [0.3, 0.3, 0.0, 2.0], [9.0, 9.0, 9.0, 9.0]])
MASK = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]], bool)
OLD, BEHAVIOR = np.zeros_like(LOG_RHO), -LOG_RHO


def test_icepop_keeps_the_weight_inside_the_band_and_zeroes_the_rest():
  # band [0.5, 2]: log 0.5 = -0.693, log 2 = 0.693 → row 0: 1 kept, e^1 above, e^-0.5 kept,
  # e^-1 below; row 1: all three kept.
  weight, got = importance_weights(OLD, BEHAVIOR, MASK, "icepop", icepop_low=0.5,
                                   icepop_high=2.0)
  np.testing.assert_allclose(weight, [[1, 0, e(-0.5), 0], [e(0.3), e(0.3), 1, 0], [0] * 4],
                             rtol=1e-12)
  got = stats.finalize(got)
  assert got["tis/masked_token_frac"] == pytest.approx(2 / 7)
  assert got["tis/masked_seq_frac"] == pytest.approx(1 / 2)
  assert got["tis/capped_token_frac"] == pytest.approx(1 / 7)  # above β
  assert got["tis/floored_token_frac"] == pytest.approx(1 / 7)  # below α
  # Ring-1T's defaults [0.5, 5]: e^1 ≈ 2.7 is kept now.
  weight, _ = importance_weights(OLD, BEHAVIOR, MASK, "icepop")
  np.testing.assert_allclose(weight[0], [1, e(1.0), e(-0.5), 0], rtol=1e-12)


def test_truncation_floor_clips_the_weight_from_below():
  weight, got = importance_weights(OLD, BEHAVIOR, MASK, "token-truncate", 2.0,
                                   is_threshold_low=0.5)
  np.testing.assert_allclose(weight, [[1, 2, e(-0.5), 0.5], [e(0.3), e(0.3), 1, 0], [0] * 4],
                             rtol=1e-12)
  got = stats.finalize(got)
  assert got["tis/floored_token_frac"] == pytest.approx(1 / 7)
  assert got["tis/capped_token_frac"] == pytest.approx(1 / 7)
  # per sequence: W_0 = e^-0.5 (row sum -0.5) floored to 0.7, W_1 = e^0.6 capped at 1.5
  weight, _ = importance_weights(OLD, BEHAVIOR, MASK, "sequence-truncate", 1.5,
                                 is_threshold_low=0.7)
  np.testing.assert_allclose(weight[:2], [[0.7] * 4, [1.5, 1.5, 1.5, 0]], rtol=1e-12)
  # floor 0 (the default) is the plain truncation
  default, got = importance_weights(OLD, BEHAVIOR, MASK, "token-truncate", 2.0)
  np.testing.assert_allclose(default[0], [1, 2, e(-0.5), e(-1.0)], rtol=1e-12)
  assert "tis/floored_token_frac" not in got


def test_geometric_mean_rejection_hand_values():
  # mean log ρ: row 0 (0 + 1 - 0.5 - 1) / 4 = -0.125 → 0.8825; row 1 0.6 / 3 = 0.2 → 1.2214
  keep, got = rejection_mask(OLD, BEHAVIOR, MASK, "seq-geo-mean", geo_low=0.9, geo_high=1.3)
  np.testing.assert_array_equal(keep, [[0] * 4, [1, 1, 1, 0], [0] * 4])
  got = stats.finalize(got)
  assert got["rejection/seq_frac"] == pytest.approx(1 / 2)
  assert got["rejection/token_frac"] == pytest.approx(4 / 7)
  assert got["rejection/seq_geo_ratio/min"] == pytest.approx(e(-0.125))
  assert got["rejection/seq_geo_ratio/max"] == pytest.approx(e(0.2))
  keep, _ = rejection_mask(OLD, BEHAVIOR, MASK, "seq-geo-mean", geo_low=0.85, geo_high=1.2)
  np.testing.assert_array_equal(keep[:2], [[1] * 4, [0] * 4])


def test_mean_k3_rejection_hand_values():
  k3 = lambda x: e(x) - 1 - x  # noqa: E731
  row0 = (k3(0.0) + k3(1.0) + k3(-0.5) + k3(-1.0)) / 4  # ≈ 0.2357
  row1 = (2 * k3(0.3) + k3(0.0)) / 3  # ≈ 0.0332
  keep, got = rejection_mask(OLD, BEHAVIOR, MASK, "seq-mean-k3", k3_threshold=0.1)
  np.testing.assert_array_equal(keep, [[0] * 4, [1, 1, 1, 0], [0] * 4])
  got = stats.finalize(got)
  assert got["rejection/seq_k3"] == pytest.approx((row0 + row1) / 2)
  assert got["rejection/seq_k3/max"] == pytest.approx(row0)
  assert got["rejection/seq_frac"] == pytest.approx(1 / 2)
  keep, _ = rejection_mask(OLD, BEHAVIOR, MASK, "seq-mean-k3", k3_threshold=0.03)
  assert not keep.any()


def test_rejection_composes_with_the_correction_in_the_loss():
  """pg = w_t · keep_i · pg_t: token-truncate weights times the seq-mean-k3 mask (row 0
  rejected), REINFORCE-like ppo at r = 1 (logp = old), token-mean."""
  adv = np.array([1.0, 2.0, 0.0])
  loss, got = policy_loss(OLD, OLD, adv, MASK, loss_agg="token-mean",
                          behavior_logprobs=BEHAVIOR, is_correction="token-truncate",
                          is_threshold=2.0, rejection="seq-mean-k3",
                          rejection_k3_threshold=0.1)
  # row 1: pg = -A·r = -2 per token, weights e^0.3, e^0.3, 1
  assert float(loss) == pytest.approx(-2 * (2 * e(0.3) + 1) / 7, rel=1e-12)
  got = stats.finalize(got)
  assert got["rejection/seq_frac"] == pytest.approx(1 / 2)
  assert got["tis/capped_token_frac"] == pytest.approx(1 / 7)


def test_rejected_and_masked_tokens_get_no_gradient():
  with jax.enable_x64(True):
    def loss_fn(logp, **kwargs):
      return policy_loss(logp, jnp.asarray(OLD), jnp.asarray([1.0, 1.0, 0.0]),
                         jnp.asarray(MASK), loss_agg="token-mean",
                         behavior_logprobs=jnp.asarray(BEHAVIOR), **kwargs)[0]
    logp = jnp.asarray(OLD)
    grad = np.asarray(jax.grad(loss_fn)(logp, rejection="seq-geo-mean", rejection_geo_low=0.9,
                                        rejection_geo_high=1.3))
    np.testing.assert_array_equal(grad[0], 0.0)
    np.testing.assert_allclose(grad[1, :3], -1 / 7, rtol=1e-12)
    grad = np.asarray(jax.grad(loss_fn)(logp, is_correction="icepop", icepop_low=0.5,
                                        icepop_high=2.0))
    np.testing.assert_allclose(grad[0], [-1 / 7, 0, -e(-0.5) / 7, 0], rtol=1e-12)
  assert np.all(np.isfinite(grad))


# DPPO, Qi et al. 2026: p = π_θ(y), p_old = π_old(y), δ_low = δ_high = 0.1.
P_OLD = np.array([[0.5, 0.5, 0.5, 0.5]])
P_NEW = np.array([[0.65, 0.55, 0.35, 0.45]])
ADV = np.array([[1.0, 1.0, -1.0, -1.0]])


def dppo(loss_type, p_new=P_NEW):
  with jax.enable_x64(True):
    def loss_fn(logp):
      return policy_loss(logp, jnp.log(P_OLD), jnp.asarray(ADV), jnp.ones((1, 4)),
                         loss_type=loss_type, loss_agg="token-mean", epsilon_low=0.1,
                         epsilon_high=0.1)
    (loss, got), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.log(jnp.asarray(p_new)))
  return float(loss), stats.finalize(got), np.asarray(grad)


def test_dppo_binary_tv_masks_by_probability_difference_in_the_advantage_direction():
  # p − p_old: +0.15 (A > 0: masked), +0.05 (kept), −0.15 (A < 0: masked), −0.05 (kept)
  loss, got, grad = dppo("dppo-tv")
  r = P_NEW / P_OLD
  assert loss == pytest.approx((-r[0, 1] + r[0, 3]) / 4, rel=1e-12)
  np.testing.assert_allclose(grad[0], [0, -r[0, 1] / 4, 0, r[0, 3] / 4], rtol=1e-12)
  assert got["clip_frac/high"] == pytest.approx(1 / 4)
  assert got["clip_frac/low"] == pytest.approx(1 / 4)
  # the wrong direction is never masked: A > 0 with a big drop, A < 0 with a big rise
  loss, got, grad = dppo("dppo-tv", p_new=np.array([[0.3, 0.5, 0.7, 0.5]]))
  assert got["clip_frac"] == 0.0 and np.all(grad[0, [0, 2]] != 0)


def test_dppo_binary_kl_masks_by_the_bernoulli_kl():
  def binary_kl(q, p):
    return q * np.log(q / p) + (1 - q) * np.log((1 - q) / (1 - p))
  # KL(0.5‖0.65) ≈ 0.0457, KL(0.5‖0.55) ≈ 0.0050: δ = 0.02 masks the first only
  assert binary_kl(0.5, 0.65) > 0.02 > binary_kl(0.5, 0.55)
  with jax.enable_x64(True):
    def loss_fn(logp):
      return policy_loss(logp, jnp.log(P_OLD), jnp.asarray(ADV), jnp.ones((1, 4)),
                         loss_type="dppo-kl", loss_agg="token-mean", epsilon_low=0.02,
                         epsilon_high=0.02)
    (loss, got), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.log(jnp.asarray(P_NEW)))
  r = P_NEW / P_OLD
  assert float(loss) == pytest.approx((-r[0, 1] + r[0, 3]) / 4, rel=1e-12)
  np.testing.assert_allclose(np.asarray(grad)[0], [0, -r[0, 1] / 4, 0, r[0, 3] / 4], rtol=1e-12)
  got = stats.finalize(got)
  assert got["clip_frac/high"] == pytest.approx(1 / 4) and got["clip_frac/low"] == pytest.approx(
      1 / 4)
  # the same divergences in the other direction (A > 0 falling, A < 0 rising) are not masked
  with jax.enable_x64(True):
    (_, got), grad = jax.value_and_grad(loss_fn, has_aux=True)(
        jnp.log(jnp.asarray([[0.35, 0.5, 0.65, 0.5]])))
  assert stats.finalize(got)["clip_frac"] == 0.0 and np.all(np.asarray(grad) != 0)


def test_dppo_kl_is_finite_at_probability_one():
  loss, got, grad = dppo("dppo-kl", p_new=np.array([[1.0, 0.55, 0.35, 0.45]]))
  assert np.isfinite(loss) and np.all(np.isfinite(grad))
  assert all(np.isfinite(v) for v in got.values())


@pytest.mark.parametrize("overrides, field", [
    ({"is_threshold_low": 2.0, "is_threshold": 2.0}, "config.algo.is_threshold_low"),
    ({"icepop_low": 5.0}, "config.algo.icepop_low"),
    ({"rejection_geo_low": 1.2}, "config.algo.rejection_geo_low"),
    ({"rejection_geo_high": 0.9}, "config.algo.rejection_geo_low"),
    ({"rejection_k3_threshold": 0.0}, "config.algo.rejection_k3_threshold"),
    ({"rejection": "seq_k3"}, "config.algo.rejection"),
    ({"loss_type": "dppo-tv", "dual_clip": 3.0}, "config.algo.dual_clip"),
])
def test_bad_settings_name_the_field(overrides, field):
  with pytest.raises(ConfigError) as error:
    StepConfig(**overrides)
  message = str(error.value)
  assert message.startswith(field) and "\n" not in message


def test_a_rejection_without_the_samplers_logprobs_is_refused():
  with pytest.raises(ConfigError, match=r"^config\.algo\.rejection='seq-mean-k3' needs"):
    StepConfig(rejection="seq-mean-k3").sampler_correction(False)
  with pytest.raises(ConfigError, match=r"^rejection='seq-geo-mean' needs behavior_logprobs"):
    policy_loss(OLD, OLD, np.ones(3), MASK, rejection="seq-geo-mean")
