"""group_advantages against a plain-Python reference written from the papers' formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.errors import ConfigError
from reasoning_rl.rl.advantages import ESTIMATORS, group_advantages

EPS = 1e-6


def reference_advantages(rewards, estimator, eps=EPS):
  """One group at a time, with explicit loops (independent of the vectorised code)."""
  rows = [[float(r) for r in row] for row in np.asarray(rewards)]
  group_size = len(rows[0])
  centered_rows = []
  for row in rows:
    mean = sum(row) / group_size
    centered_rows.append([r - mean for r in row])
  if estimator == "reinforce_pp":
    flat = [a for row in centered_rows for a in row]
    batch_mean = sum(flat) / len(flat)
    batch_var = sum((a - batch_mean) ** 2 for a in flat) / max(len(flat) - 1, 1)
    batch_std = math.sqrt(batch_var)
  out = []
  for row, centered in zip(rows, centered_rows):
    if max(row) == min(row):
      out.append([0.0] * group_size)
      continue
    if estimator == "grpo":
      std = math.sqrt(sum(a * a for a in centered) / (group_size - 1))
      out.append([a / (std + eps) for a in centered])
    elif estimator == "dr_grpo":
      out.append(centered)
    elif estimator == "rloo":
      advantages = []
      for i in range(group_size):
        others = [row[j] for j in range(group_size) if j != i]
        advantages.append(row[i] - sum(others) / len(others))
      out.append(advantages)
    elif estimator == "reinforce_pp":
      out.append([(a - batch_mean) / (batch_std + eps) for a in centered])
  return np.array(out)


REWARD_CASES = {
    "binary": [[1, 0, 0, 1], [0, 0, 0, 1], [1, 1, 1, 0]],
    "all_equal_groups": [[0.1, 0.1, 0.1, 0.1], [0.7, 0.2, 0.4, 0.9], [1.0, 1.0, 1.0, 1.0]],
    "every_group_equal": [[0.3, 0.3, 0.3], [2.0, 2.0, 2.0]],
    "real_valued": [[0.25, -1.5, 3.0, 0.5, 2.0, 2.0], [10.0, 9.5, 9.75, 10.0, 9.0, 11.0]],
    "two_samples": [[0.0, 1.0], [5.0, 5.0], [-2.0, 3.0]],
}


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("case", sorted(REWARD_CASES))
def test_matches_reference_numpy_and_jax(estimator, case):
  rewards = np.array(REWARD_CASES[case], dtype=np.float64)
  expected = reference_advantages(rewards, estimator)

  got_numpy = group_advantages(rewards, estimator=estimator)
  assert isinstance(got_numpy, np.ndarray) and got_numpy.dtype == np.float64
  np.testing.assert_allclose(got_numpy, expected, rtol=1e-12, atol=1e-12)

  got_jax = group_advantages(jnp.asarray(rewards, jnp.float32), estimator=estimator)
  assert isinstance(got_jax, jax.Array) and got_jax.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got_jax), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_all_equal_groups_are_exactly_zero(estimator):
  # 0.1 is not representable: a naive (r - mean) / (std + eps) leaves rounding noise here.
  rewards = np.array([[0.1] * 3, [1 / 3] * 3, [0.7, 0.1, 0.3]])
  for advantages in (group_advantages(rewards, estimator=estimator),
                     np.asarray(group_advantages(jnp.asarray(rewards), estimator=estimator))):
    assert np.all(advantages[:2] == 0.0)
    assert np.all(np.isfinite(advantages)) and np.any(advantages[2] != 0)


def test_grpo_uses_sample_std():
  # Rewards (0, 1): mean 1/2, sample std sqrt(1/2) (population std would be 1/2).
  advantages = group_advantages(np.array([[0.0, 1.0]]), estimator="grpo", eps=0.0)
  np.testing.assert_allclose(advantages, [[-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)]])


def test_hand_computed_values():
  rewards = np.array([[1.0, 0.0, 0.0, 0.0]])
  # RLOO: 1 - 0 = 1 for the winner, 0 - 1/3 for the others.
  np.testing.assert_allclose(group_advantages(rewards, estimator="rloo"),
                             [[1.0, -1 / 3, -1 / 3, -1 / 3]])
  np.testing.assert_allclose(group_advantages(rewards, estimator="dr_grpo"),
                             [[0.75, -0.25, -0.25, -0.25]])
  # GRPO: sample std of (1,0,0,0) = sqrt(0.75 / 3) = 0.5.
  np.testing.assert_allclose(group_advantages(rewards, estimator="grpo", eps=0.0),
                             [[1.5, -0.5, -0.5, -0.5]])


def test_reinforce_pp_normalises_over_the_batch_not_the_group():
  rewards = np.array([[0.0, 1.0], [0.0, 10.0]])
  advantages = group_advantages(rewards, estimator="reinforce_pp", eps=0.0)
  centered = np.array([-0.5, 0.5, -5.0, 5.0])
  np.testing.assert_allclose(advantages.ravel(), centered / np.std(centered, ddof=1))
  # GRPO would give both groups the same +-1/sqrt(2).
  assert abs(advantages[1, 1]) > 5 * abs(advantages[0, 1])


def test_group_size_one():
  rewards = np.array([[0.3], [1.0]])
  for estimator in ("grpo", "dr_grpo", "reinforce_pp"):
    np.testing.assert_array_equal(group_advantages(rewards, estimator=estimator), 0.0)
  with pytest.raises(ConfigError, match="rloo.*G = 1"):
    group_advantages(rewards, estimator="rloo")


def test_jit_and_integer_rewards():
  rewards = np.array([[1, 0, 1, 1], [0, 0, 0, 0]])
  for estimator in ESTIMATORS:
    jitted = jax.jit(lambda r, e=estimator: group_advantages(r, estimator=e))
    got = jitted(jnp.asarray(rewards))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), reference_advantages(rewards, estimator),
                               rtol=1e-5, atol=1e-6)


def test_bad_inputs():
  with pytest.raises(ConfigError, match="estimator='ppo'.*grpo"):
    group_advantages(np.zeros((2, 2)), estimator="ppo")
  with pytest.raises(ValueError, match=r"\[num_prompts, G\].*shape \(8,\)"):
    group_advantages(np.zeros(8))
  with pytest.raises(ValueError, match=r"rewards\[1, 0\] is not finite"):
    group_advantages(np.array([[0.0, 1.0], [np.nan, 1.0]]))
  with pytest.raises(ConfigError, match="eps"):
    group_advantages(np.zeros((2, 2)), eps=-1.0)
