"""GAE, reward placement, whitening and the clipped value loss against loop references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import stats
from reasoning_rl.rl.losses import LOSS_AGGREGATIONS, loss_normalizers
from reasoning_rl.rl.value import (gae_advantages, masked_whiten, sequence_rewards_to_tokens,
                                   value_loss)

# Rows: full, right-padded, a hole in the middle (masked tool output), one token, empty.
MASK = np.array([
    [1, 1, 1, 1, 1, 1],
    [1, 1, 1, 0, 0, 0],
    [1, 1, 0, 0, 1, 1],
    [1, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0],
], bool)


def make_inputs(seed=0):
  rng = np.random.default_rng(seed)
  rewards = rng.normal(size=MASK.shape)
  values = rng.normal(size=MASK.shape)
  rewards[~MASK], values[~MASK] = np.nan, np.inf  # garbage must be ignored
  return rewards, values


def reference_gae(rewards, values, mask, gamma, lam):
  """A_t = Σ_k (γλ)^k δ_{t+k} summed explicitly along each row's valid tokens."""
  advantages = np.zeros(mask.shape)
  returns = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    steps = [t for t in range(mask.shape[1]) if mask[b, t]]
    deltas = []
    for i, t in enumerate(steps):
      next_value = values[b, steps[i + 1]] if i + 1 < len(steps) else 0.0
      deltas.append(rewards[b, t] + gamma * next_value - values[b, t])
    for i, t in enumerate(steps):
      advantages[b, t] = sum((gamma * lam) ** (k - i) * deltas[k] for k in range(i, len(steps)))
      returns[b, t] = advantages[b, t] + values[b, t]
  return advantages, returns


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_reference(gamma, lam):
  rewards, values = make_inputs()
  expected_adv, expected_ret = reference_gae(rewards, values, MASK, gamma, lam)
  with jax.enable_x64(True):
    advantages, returns = gae_advantages(rewards, values, MASK, gamma=gamma, lam=lam)
    assert advantages.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(advantages), expected_adv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(returns), expected_ret, rtol=1e-12, atol=1e-12)
  advantages, _ = gae_advantages(jnp.asarray(rewards, jnp.float32),
                                 jnp.asarray(values, jnp.float32), MASK, gamma=gamma, lam=lam)
  np.testing.assert_allclose(np.asarray(advantages), expected_adv, rtol=1e-5, atol=1e-5)


def test_gae_special_cases():
  rewards, values = make_inputs(1)
  # λ = γ = 1: Monte-Carlo return of the remaining valid tokens minus V.
  advantages, returns = gae_advantages(rewards, values, MASK, gamma=1.0, lam=1.0)
  for b, t in zip(*np.nonzero(MASK)):
    remaining = sum(rewards[b, k] for k in range(t, MASK.shape[1]) if MASK[b, k])
    assert float(returns[b, t]) == pytest.approx(remaining, rel=1e-5, abs=1e-5)
    assert float(advantages[b, t]) == pytest.approx(remaining - values[b, t], rel=1e-5,
                                                    abs=1e-5)
  assert np.all(np.asarray(advantages)[~MASK] == 0) and np.all(np.asarray(returns)[~MASK] == 0)


def test_outcome_reward_on_last_token():
  token_rewards = sequence_rewards_to_tokens(np.array([1.0, 2.0, 3.0, 4.0, 5.0]), MASK)
  expected = np.zeros(MASK.shape)
  for b in range(MASK.shape[0]):
    valid = [t for t in range(MASK.shape[1]) if MASK[b, t]]
    if valid:
      expected[b, valid[-1]] = b + 1.0
  np.testing.assert_array_equal(np.asarray(token_rewards), expected)
  # With V = 0 and γ = λ = 1 every valid token's advantage is the outcome reward; with λ < 1
  # it decays by λ per valid token before the end.
  outcome = np.where(MASK, np.arange(1, 6)[:, None], 0)
  advantages, _ = gae_advantages(token_rewards, np.zeros(MASK.shape), MASK, gamma=1.0, lam=1.0)
  np.testing.assert_allclose(np.asarray(advantages), outcome)
  advantages, _ = gae_advantages(token_rewards, np.zeros(MASK.shape), MASK, gamma=1.0, lam=0.5)
  valid_after = np.cumsum(MASK[:, ::-1], axis=1)[:, ::-1] - 1  # valid tokens after t
  np.testing.assert_allclose(np.asarray(advantages), outcome * 0.5 ** valid_after, rtol=1e-6)


def test_masked_whiten():
  rng = np.random.default_rng(2)
  x = rng.normal(size=MASK.shape) * 3 + 1
  got = np.asarray(masked_whiten(x, MASK, eps=0.0))
  valid = x[MASK]
  mean = sum(valid) / len(valid)
  std = math.sqrt(sum((v - mean) ** 2 for v in valid) / len(valid))
  np.testing.assert_allclose(got[MASK], (valid - mean) / std, rtol=1e-5)
  assert np.all(got[~MASK] == 0)


def reference_value_loss(values, old_values, returns, mask, clip_epsilon, loss_agg, length):
  row_sums, row_counts, clipped = [], [], 0
  for b in range(mask.shape[0]):
    row_sum, row_count = 0.0, 0
    for t in range(mask.shape[1]):
      if not mask[b, t]:
        continue
      unclipped = (values[b, t] - returns[b, t]) ** 2
      loss = 0.5 * unclipped
      if clip_epsilon is not None:
        delta = min(max(values[b, t] - old_values[b, t], -clip_epsilon), clip_epsilon)
        clipped_sq = (old_values[b, t] + delta - returns[b, t]) ** 2
        loss = 0.5 * max(unclipped, clipped_sq)
        clipped += clipped_sq > unclipped
      row_sum += loss
      row_count += 1
    row_sums.append(row_sum)
    row_counts.append(row_count)
  tokens = sum(row_counts)
  sequences = sum(1 for c in row_counts if c)
  if loss_agg == "token-mean":
    loss = sum(row_sums) / tokens
  elif loss_agg == "seq-mean-token-mean":
    loss = sum(s / c for s, c in zip(row_sums, row_counts) if c) / sequences
  else:
    loss = sum(s / length for s in row_sums) / sequences
  return loss, clipped / tokens, sum(row_sums) / tokens


@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("clip_epsilon", [None, 0.2])
def test_value_loss_matches_reference(loss_agg, clip_epsilon):
  rng = np.random.default_rng(3)
  old_values = rng.normal(size=MASK.shape)
  values = old_values + rng.normal(size=MASK.shape) * 0.3
  returns = rng.normal(size=MASK.shape)
  expected, clip_frac, mean_token_loss = reference_value_loss(
      values, old_values, returns, MASK, clip_epsilon, loss_agg, MASK.shape[1])
  loss, metrics = value_loss(values, old_values, returns, MASK, clip_epsilon=clip_epsilon,
                             loss_agg=loss_agg)
  assert float(loss) == pytest.approx(expected, rel=1e-5)
  got = stats.finalize(metrics)
  assert got["value/clip_frac"] == pytest.approx(clip_frac)
  assert got["value/loss"] == pytest.approx(mean_token_loss, rel=1e-5)
  assert got["value/abs_error"] == pytest.approx(np.abs(values - returns)[MASK].mean(), rel=1e-5)
  if clip_epsilon is not None:
    assert 0 < clip_frac < 1


def test_value_loss_gradient_and_micro_batches():
  rng = np.random.default_rng(4)
  old_values = rng.normal(size=MASK.shape)
  values = old_values + np.array([0.05, -0.5, 0.1, 0.6, -0.15, 0.3])[None, :]
  returns = rng.normal(size=MASK.shape)
  with jax.enable_x64(True):
    loss_fn = jax.jit(lambda v, m, num_sequences, num_tokens: value_loss(
        v, old_values, returns, m, clip_epsilon=0.2, num_sequences=num_sequences,
        num_tokens=num_tokens)[0])
    normalizers = loss_normalizers(MASK)
    grad = np.asarray(jax.grad(loss_fn)(jnp.asarray(values), MASK, **normalizers))
    numeric = np.zeros_like(values)
    for pos in np.ndindex(values.shape):
      step = np.zeros_like(values)
      step[pos] = 1e-6
      numeric[pos] = (float(loss_fn(values + step, MASK, **normalizers))
                      - float(loss_fn(values - step, MASK, **normalizers))) / 2e-6
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)
    # Clipped tokens (|V - V_old| = 0.5, 0.6 beyond ε_v = 0.2 on the far side) get no gradient.
    assert np.count_nonzero(grad) > 5 and np.all(grad[~MASK] == 0)
  # Rows split in two parts with the whole-batch token count sum to the full loss.
  full, _ = value_loss(values, old_values, returns, MASK, num_tokens=int(MASK.sum()))
  halves = [value_loss(values[rows], old_values[rows], returns[rows], MASK[rows],
                       num_tokens=int(MASK.sum()))[0] for rows in (slice(0, 2), slice(2, 5))]
  # Two float32 programs summing ~20 squared errors in different orders: up to n·6e-8 ≈ 1.2e-6
  # relative apart worst-case (1 ulp here, more where XLA vectorises the sum differently); a wrong
  # normaliser (each half's own token count) is off by a factor ~2.
  assert float(sum(halves)) == pytest.approx(float(full), rel=1e-5)


def test_bad_inputs():
  rewards, values = make_inputs()
  with pytest.raises(ConfigError, match="lam=1.5"):
    gae_advantages(rewards, values, MASK, lam=1.5)
  with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
    gae_advantages(rewards[:, :3], values, MASK)
  with pytest.raises(ConfigError, match="clip_epsilon=0"):
    value_loss(values, values, values, MASK, clip_epsilon=0)
  with pytest.raises(ValueError, match="sequence_rewards has shape"):
    sequence_rewards_to_tokens(np.zeros(3), MASK)
