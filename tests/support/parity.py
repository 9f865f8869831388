"""Logits of a model by full forward and by prefill + decode, on a left-padded batch: what parity
tests compare with the reference implementation. (From test_model_parity.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reasoning_rl.models.transformer import positions_from_mask


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids, mask):
  return nnx.merge(graphdef, state)(ids, mask)


@functools.partial(jax.jit, static_argnums=0)
def _decode(graphdef, state, ids, positions, cache, write_index):
  return nnx.merge(graphdef, state).decode(ids, positions, cache, write_index)


def full_logits(model, ids, mask) -> np.ndarray:
  """model(ids, mask) as numpy, [B, T, V]."""
  return np.asarray(_forward(*nnx.split(model), jnp.asarray(ids), jnp.asarray(mask)))


def decoded_logits(model, ids, mask, cache, prompt_len: int) -> np.ndarray:
  """The logits of a prefill of each row's first prompt_len entries, then of one token at a time
  through the KV cache, [B, T, V] (padding entries carry position −1, as the engine's do)."""
  graphdef, state = nnx.split(model)
  rows = len(ids)
  positions = positions_from_mask(jnp.asarray(mask))
  logits, cache = _decode(graphdef, state, jnp.asarray(ids[:, :prompt_len]),
                          positions[:, :prompt_len], cache, jnp.zeros(rows, jnp.int32))
  steps = [np.asarray(logits)]
  for t in range(prompt_len, ids.shape[1]):
    logits, cache = _decode(graphdef, state, jnp.asarray(ids[:, t:t + 1]), positions[:, t:t + 1],
                            cache, jnp.full(rows, t, jnp.int32))
    steps.append(np.asarray(logits))
  return np.concatenate(steps, axis=1)


def left_padded_batch(vocab, seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(0, vocab, size=(3, 11))
  mask = np.ones_like(ids)
  mask[0, :4] = 0  # left padding of different lengths; row 2 unpadded
  mask[1, :1] = 0
  ids[mask == 0] = 0
  return ids, mask
