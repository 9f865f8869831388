"""rl/logprobs.head_logprobs: the vocabulary head in chunks (the first kept, the others recomputed
in the backward pass, empty ones skipped) gives the full softmax's values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.rl.logprobs import head_logprobs
from reasoning_rl.sampler.sampling import truncated_logprobs

B, L, D, V = 2, 10, 8, 13


class Head:
  """What head_logprobs asks of a model: logits = hidden · Eᵀ."""

  def __init__(self, embedding):
    self.embedding = embedding

  def logits_from_hidden(self, hidden):
    return hidden @ self.embedding.T


def inputs(empty_from: int | None = None):
  rng = np.random.default_rng(0)
  embedding = jnp.asarray(rng.standard_normal((V, D)), jnp.float32)
  hidden = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
  targets = rng.integers(0, V, (B, L)).astype(np.int32)
  if empty_from is not None:
    targets[:, empty_from:] = -1
  weights = jnp.asarray(rng.standard_normal((2, B, L)), jnp.float32)
  return embedding, hidden, jnp.asarray(targets), weights


def full_softmax(embedding, hidden, targets):
  logits = hidden @ embedding.T
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(log_probs, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
  return picked, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


@pytest.mark.parametrize("chunk", [3, 4, 10, 16])
@pytest.mark.parametrize("skip_empty", [False, True])
def test_chunked_head_gives_the_full_softmax_values_and_gradients(chunk, skip_empty):
  # positions 6.. have no target: with chunks of 3 the chunks starting at 6 and 9 are empty
  embedding, hidden, targets, weights = inputs(empty_from=6 if skip_empty else None)
  valid = (targets >= 0).astype(jnp.float32)

  def weighted(fn, embedding, hidden):
    logprobs, entropy = fn(embedding, hidden)
    return jnp.sum((weights[0] * logprobs + weights[1] * entropy) * valid)

  chunked = lambda e, h: head_logprobs(Head(e), h, targets, chunk, skip_empty=skip_empty)
  reference = lambda e, h: full_softmax(e, h, targets)
  for got, want in zip(chunked(embedding, hidden), reference(embedding, hidden)):
    np.testing.assert_allclose(np.asarray(got) * np.asarray(valid),
                               np.asarray(want) * np.asarray(valid), atol=1e-5)
  got_grads = jax.grad(lambda e, h: weighted(chunked, e, h), argnums=(0, 1))(embedding, hidden)
  want_grads = jax.grad(lambda e, h: weighted(reference, e, h), argnums=(0, 1))(embedding,
                                                                                hidden)
  for got, want in zip(got_grads, want_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  assert float(jnp.abs(want_grads[0]).max()) > 0.1  # the gradient is not trivially 0
  if skip_empty and chunk == 3:  # chunks 2 and 3 (positions 6-11) are skipped: their outputs are 0
    for out in chunked(embedding, hidden):
      assert not np.any(np.asarray(out)[:, 6:])


def test_chunked_truncated_head_equals_one_chunk():
  embedding, hidden, targets, weights = inputs()
  rng = np.random.default_rng(1)
  settings = (jnp.asarray(rng.uniform(0.5, 1.5, (B, L)), jnp.float32),  # temperature
              jnp.full((B, L), 0.9, jnp.float32), jnp.full((B, L), 6, jnp.int32),  # top-p, top-k
              jnp.zeros((B, L), jnp.float32))  # min-p

  def weighted(chunk, embedding, hidden):
    out = head_logprobs(Head(embedding), hidden, targets, chunk, truncation=settings)
    return sum(jnp.sum(w * x) for w, x in zip((weights[0], weights[1], weights[0]), out[:3]))

  whole = head_logprobs(Head(embedding), hidden, targets, L, truncation=settings)
  direct = truncated_logprobs(hidden @ embedding.T, targets, *settings, with_membership=True)
  np.testing.assert_allclose(np.asarray(whole[0]), np.asarray(direct[0]), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(whole[3]), np.asarray(direct[1], np.float32))
  for chunk in (3, 4):
    for got, want in zip(head_logprobs(Head(embedding), hidden, targets, chunk,
                                       truncation=settings), whole):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    got = jax.grad(lambda e, h: weighted(chunk, e, h), argnums=(0, 1))(embedding, hidden)
    want = jax.grad(lambda e, h: weighted(L, e, h), argnums=(0, 1))(embedding, hidden)
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
