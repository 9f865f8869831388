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
  sampling_logits,
  truncated_logprobs,
)

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
DRAWS = 20_000
CHI2_999 = {1: 10.828, 2: 13.816, 7: 24.322}


def softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def numpy_sampling_probs(logits, temperature, top_p, top_k, min_p=0.0):
  """The sampled distribution in numpy, written from the papers' definitions: temperature, then
  top-k (ties with the k-th kept), top-p on the renormalised top-k (token kept iff the mass
  strictly before it is < p), then min-p (p ≥ min_p · p_max after temperature)."""
  logits = np.asarray(logits, np.float64)
  scaled = logits / temperature
  keep = np.ones(logits.shape, bool)
  if top_k > 0:
    keep &= scaled >= np.sort(scaled)[::-1][min(top_k, scaled.size) - 1]
  if top_p < 1.0:
    probs = np.where(keep, softmax(np.where(keep, scaled, -np.inf)), 0.0)
    order = np.argsort(-scaled, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    nucleus = np.zeros_like(keep)
    nucleus[order] = before < top_p
    keep &= nucleus
  if min_p > 0:
    probs = softmax(scaled)
    keep &= probs >= min_p * probs.max()
  out = np.zeros(logits.shape)
  out[keep] = softmax(scaled[keep])
  return out


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def draw(logits, temperature, top_p, top_k, min_p=0.0):
  keys = jax.random.split(jax.random.key(1234), DRAWS)
  batch = jnp.broadcast_to(logits, (DRAWS, logits.shape[0]))
  full = lambda value, dtype: jnp.full(DRAWS, value, dtype)
  return sample_tokens(batch, keys, full(temperature, jnp.float32), full(top_p, jnp.float32),
                       full(top_k, jnp.int32), full(min_p, jnp.float32))


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


def test_all_greedy_and_plain_batches_give_what_a_mixed_batch_gives_their_rows():
  """A batch of greedy rows, or of temperature-1 rows without filters, skips the filtered
  distribution (`sample_tokens`' shortcuts); each row must still get exactly the tokens and
  log-probs it gets inside a batch that takes the general path (a top-p row beside it)."""
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(scale=2.0, size=(4, 64)), jnp.float32)
  keys = jax.random.split(jax.random.key(7), 5)
  for temperature in (0.0, 1.0):
    alone = sample_tokens(logits, keys[:4], jnp.full(4, temperature), jnp.ones(4),
                          jnp.zeros(4, jnp.int32))
    mixed = sample_tokens(jnp.concatenate([logits, logits[:1]]), keys,
                          jnp.array([temperature] * 4 + [0.8]), jnp.array([1.0] * 4 + [0.5]),
                          jnp.zeros(5, jnp.int32))
    for got, want in zip(alone, mixed):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[:4])
    if temperature == 0.0:
      np.testing.assert_array_equal(np.asarray(alone[0]), np.argmax(np.asarray(logits), -1))
      np.testing.assert_array_equal(np.asarray(alone[2]), np.zeros(4))
    else:
      np.testing.assert_array_equal(np.asarray(alone[2]), np.asarray(alone[1]))


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
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
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


@pytest.mark.parametrize("temperature, min_p, kept", [
    # p = softmax(LOGITS) = [.404, .245, .149, .090, .055, ...]; min_p · p_max = .12 keeps 3.
    (1.0, 0.3, [0, 1, 2]),
    # after temperature 0.5: p ∝ exp(2·z) = [.63, .23, .085, .031, ...]; 0.1 · .63 = .063 keeps 3.
    (0.5, 0.1, [0, 1, 2]),
    # min_p = 1 keeps only the most likely token.
    (1.0, 1.0, [0]),
])
def test_min_p_keeps_exactly_the_expected_tokens(temperature, min_p, kept):
  tokens, _, sampling_lp = draw(jnp.asarray(LOGITS), temperature, 1.0, 0, min_p)
  tokens = np.asarray(tokens)
  probs = numpy_sampling_probs(LOGITS, temperature, 1.0, 0, min_p)
  assert np.flatnonzero(probs).tolist() == kept
  assert set(np.unique(tokens)) <= set(kept)
  if len(kept) > 1:
    statistic, _ = chi_square(tokens, probs)
    assert statistic < CHI2_999[len(kept) - 1], statistic
  np.testing.assert_allclose(sampling_lp, np.log(probs[tokens]), rtol=1e-5, atol=1e-6)


# Rows with different settings in one batch: (temperature, top_p, top_k, min_p).
ROW_SETTINGS = [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (1.0, 1.0, 3, 0.0), (1.3, 0.8, 5, 0.05),
                (0.9, 1.0, 0, 0.2), (1.0, 0.95, 20, 0.1), (2.0, 0.5, 0, 0.0), (0.5, 1.0, 2, 0.3)]


def _row_arrays(settings):
  t, p, k, m = zip(*settings)
  return (jnp.asarray(t, jnp.float32), jnp.asarray(p, jnp.float32), jnp.asarray(k, jnp.int32),
          jnp.asarray(m, jnp.float32))


def test_per_row_settings_match_the_numpy_reference():
  """Each row of one batch is filtered with its own settings, as numpy does row by row."""
  logits = np.random.default_rng(0).normal(0, 2, (len(ROW_SETTINGS), 32)).astype(np.float32)
  filtered = np.asarray(sampling_logits(jnp.asarray(logits), *_row_arrays(ROW_SETTINGS)))
  for row, settings in enumerate(ROW_SETTINGS):
    expected = numpy_sampling_probs(logits[row], *settings)
    got = np.exp(filtered[row] - filtered[row].max())
    got /= got.sum()
    np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=str(settings))


def test_truncated_logprobs_rebuild_the_samplers_log_probs():
  """The trainer's rebuild (`truncated_logprobs`, per position) gives the sampler's own
  sampling log-probs for the tokens the sampler drew, for every row's settings."""
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(0, 2, (len(ROW_SETTINGS), 32)).astype(np.float32))
  keys = jax.random.split(jax.random.key(7), len(ROW_SETTINGS))
  rows = _row_arrays(ROW_SETTINGS)
  tokens, _, sampling_lp = sample_tokens(logits, keys, *rows)
  rebuilt = truncated_logprobs(logits, tokens, *rows)
  np.testing.assert_allclose(rebuilt, sampling_lp, atol=1e-5)
  for row, settings in enumerate(ROW_SETTINGS):
    probs = numpy_sampling_probs(np.asarray(logits[row]), *settings)
    np.testing.assert_allclose(rebuilt[row], np.log(probs[int(tokens[row])]), atol=1e-5)


def test_truncated_logprobs_keep_the_target_and_read_greedy_rows_as_the_model():
  logits = jnp.asarray(np.stack([LOGITS, LOGITS]))
  # top_k = 1 keeps token 0 only; the target 3 is kept anyway (it was drawn): log of its share
  # of {0, 3}. The greedy row (temperature 0) is the model's own log-prob.
  got = truncated_logprobs(logits, jnp.array([3, 3]), jnp.array([1.0, 0.0]),
                           jnp.array([1.0, 1.0]), jnp.array([1, 1]), jnp.array([0.0, 0.0]))
  share = np.exp(LOGITS[3]) / (np.exp(LOGITS[0]) + np.exp(LOGITS[3]))
  np.testing.assert_allclose(got, [np.log(share), np.log(softmax(LOGITS))[3]], rtol=1e-5)


def test_truncated_logprobs_gradient_is_the_truncated_score_function():
  """∇_z log π^W(y) = (onehot(y) − π^W)/T: the kept set carries no gradient."""
  z = jnp.asarray(LOGITS)
  t, p, k, m = 0.8, 0.9, 4, 0.0
  grad = jax.grad(lambda x: truncated_logprobs(x, jnp.array(1), jnp.array(t), jnp.array(p),
                                               jnp.array(k), jnp.array(m)))(z)
  probs = numpy_sampling_probs(LOGITS, t, p, k, m)
  np.testing.assert_allclose(grad, (np.eye(LOGITS.size)[1] - probs) / t, atol=1e-6)


def test_a_rows_kept_set_does_not_depend_on_the_other_rows_of_its_call(monkeypatch):
  """A row the prefix settles takes the prefix's threshold even when another row of the call
  needs the full sort. The sort is replaced by one that keeps nothing, so the test does not rest
  on where the two paths happen to round apart on this CPU (they do in ~2 of 10,000 rows)."""
  from reasoning_rl.sampler import sampling

  rng = np.random.default_rng(5)
  vocab = 1000
  peaked = rng.normal(0, 3.0, vocab).astype(np.float32)  # the prefix holds its top-p set
  flat = rng.normal(0, 0.01, vocab).astype(np.float32)  # its top-p set outgrows the prefix
  alone = np.asarray(sampling.truncation_threshold(
      jnp.asarray(peaked[None]), jnp.array([0.9]), jnp.array([0]), jnp.zeros(1)))
  monkeypatch.setattr(sampling, "_top_k_top_p_threshold",
                      lambda s, p, k: jnp.full(s.shape[:-1] + (1,), jnp.inf, s.dtype))
  both = np.asarray(sampling.truncation_threshold(
      jnp.asarray(np.stack([peaked, flat])), jnp.array([0.9, 0.9]), jnp.array([0, 0]),
      jnp.zeros(2)))
  assert both[0] == alone[0] and np.isfinite(both[0]).all()
  assert np.isinf(both[1]).all()  # the flat row did take the (replaced) sort


@pytest.mark.parametrize("scale", [0.3, 3.0])  # flat rows overflow the prefix, peaked ones fit
def test_the_prefix_threshold_equals_the_full_sort(scale):
  """`truncation_threshold` reads the PREFIX largest values and sorts only rows that need it;
  either way its kept sets are the full sort's."""
  from reasoning_rl.sampler import sampling

  rng = np.random.default_rng(2)
  vocab, rows = 1000, 64
  scaled = jnp.asarray(rng.normal(0, scale, (rows, vocab)).astype(np.float32))
  top_p = jnp.asarray(rng.choice([0.5, 0.9, 0.99, 1.0], rows).astype(np.float32))
  top_k = jnp.asarray(rng.choice([0, 5, 50, 300], rows).astype(np.int32))
  top_k = top_k.at[0].set(0)
  top_p = top_p.at[0].set(0.9)
  fast, resolved = sampling._prefix_threshold(scaled, top_p, top_k)
  full = sampling._top_k_top_p_threshold(scaled, top_p, top_k)
  resolved = np.asarray(resolved)
  assert resolved.any()
  np.testing.assert_array_equal(np.asarray(scaled >= fast)[resolved],
                                np.asarray(scaled >= full)[resolved])
  kept = np.asarray(scaled >= sampling.truncation_threshold(scaled, top_p, top_k,
                                                            jnp.zeros(rows)))
  np.testing.assert_array_equal(kept, np.asarray(scaled >= full))
  if scale < 1:
    assert not resolved.all()  # the fallback ran
