"""Sampling functions against hand-computed distributions, with stated statistical tolerances.

Frequencies of N = 20 000 draws (fixed seed) are compared with the expected probabilities by
Pearson's chi-square statistic; the test fails if it exceeds the 99.9 % quantile of the chi-square
distribution with (support size − 1) degrees of freedom, i.e. a correct sampler fails with
probability 0.1 % for a random seed (and, the seed being fixed, never). Critical values are
scipy.stats.chi2.ppf(0.999, df), written out so the test does not depend on scipy.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.errors import SamplingError
from reasoning_rl.sampler.sampling import (
  SamplingParams,
  first_argmax,
  gumbel_max,
  sample_key,
  sample_tokens,
)

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
DRAWS = 20_000
CHI2_999 = {1: 10.828, 2: 13.816, 7: 24.322}


def softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def draw(logits, temperature, top_p, top_k):
  keys = jax.random.split(jax.random.key(1234), DRAWS)
  batch = jnp.broadcast_to(logits, (DRAWS, logits.shape[0]))
  full = lambda value, dtype: jnp.full(DRAWS, value, dtype)
  return sample_tokens(batch, keys, full(temperature, jnp.float32), full(top_p, jnp.float32),
                       full(top_k, jnp.int32))


def chi_square(tokens, probs):
  support = probs > 0
  counts = np.bincount(np.asarray(tokens), minlength=probs.size)
  expected = DRAWS * probs[support]
  return float(np.sum((counts[support] - expected) ** 2 / expected)), counts


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_frequencies_match_softmax(temperature):
  tokens, model_lp, sampling_lp = draw(jnp.asarray(LOGITS), temperature, 1.0, 0)
  probs = softmax(LOGITS / temperature)
  statistic, _ = chi_square(tokens, probs)
  assert statistic < CHI2_999[7], statistic
  tokens = np.asarray(tokens)
  np.testing.assert_allclose(model_lp, np.log(softmax(LOGITS))[tokens], rtol=1e-5)
  np.testing.assert_allclose(sampling_lp, np.log(probs)[tokens], rtol=1e-5)


@pytest.mark.parametrize("top_p, top_k, kept", [
    # p = softmax(LOGITS) = [.404, .245, .149, .090, ...]: mass before token 2 is .649 >= .6.
    (0.6, 0, [0, 1]),
    (1.0, 3, [0, 1, 2]),
    # top-3 renormalised: [.506, .307, .186]; mass before token 2 is .814 >= .8.
    (0.8, 3, [0, 1]),
    # the most likely token is always kept, however small p is.
    (0.01, 0, [0]),
])
def test_top_p_top_k_keep_exactly_the_expected_tokens(top_p, top_k, kept):
  tokens, _, sampling_lp = draw(jnp.asarray(LOGITS), 1.0, top_p, top_k)
  tokens = np.asarray(tokens)
  assert set(np.unique(tokens)) <= set(kept)  # excluded tokens are never emitted
  probs = np.zeros_like(LOGITS)
  probs[kept] = softmax(LOGITS[kept])
  if len(kept) > 1:
    statistic, _ = chi_square(tokens, probs)
    assert statistic < CHI2_999[len(kept) - 1], statistic
  np.testing.assert_allclose(sampling_lp, np.log(probs[tokens]), rtol=1e-5, atol=1e-6)


def test_greedy_rows_and_sampled_rows_share_a_batch():
  logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1], LOGITS]))
  keys = jax.random.split(jax.random.key(0), 3)
  tokens, model_lp, sampling_lp = sample_tokens(
      logits, keys, jnp.array([0.0, 0.0, 1.0]), jnp.array([1.0, 1.0, 0.01]),
      jnp.array([0, 0, 0]))
  assert tokens.tolist() == [0, 7, 0]
  np.testing.assert_allclose(model_lp[:2], np.log(softmax(LOGITS))[0], rtol=1e-6)
  np.testing.assert_allclose(sampling_lp, [0.0, 0.0, 0.0], atol=1e-6)


def test_sample_keys_depend_on_seed_prompt_and_sample_only():
  a = jax.random.key_data(sample_key(3, 5, 1))
  assert np.array_equal(a, jax.random.key_data(sample_key(3, 5, 1)))
  others = [sample_key(4, 5, 1), sample_key(3, 6, 1), sample_key(3, 5, 2)]
  assert all(not np.array_equal(a, jax.random.key_data(k)) for k in others)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_bad_sampling_parameters_name_the_field(kwargs, field):
  with pytest.raises(SamplingError, match=field):
    SamplingParams(**kwargs)


def test_first_argmax_is_jnp_argmax_with_ties_infinities_and_nans():
  rng = np.random.RandomState(0)
  rows = rng.randint(-3, 4, (64, 50)).astype(np.float32)  # many ties
  rows[1] = -np.inf
  rows[2, 7] = np.inf
  rows[3, [5, 9]] = np.nan
  rows[4, :] = np.nan
  rows[5, 40] = np.nan
  got = np.asarray(first_argmax(jnp.asarray(rows)))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(rows), axis=-1)))
  assert got[3] == 5 and got[4] == 0 and got[5] == 40 and got[2] == 7


def test_gumbel_max_draws_the_tokens_of_jax_random_categorical():
  # the sampler's speed-up must not change a sampled token (runs stay reproducible across it)
  rng = np.random.RandomState(1)
  logits = jnp.asarray(rng.randn(32, 3000).astype(np.float32) * 4)
  logits = logits.at[0, 100:].set(-jnp.inf)  # a filtered row (top-k / top-p leave -inf)
  for seed in range(5):
    keys = jax.random.split(jax.random.key(seed), 32)
    expected = jax.vmap(jax.random.categorical)(keys, logits)
    np.testing.assert_array_equal(np.asarray(gumbel_max(keys, logits)), np.asarray(expected))
  assert int(gumbel_max(keys, logits)[0]) < 100
