"""How the step cuts a batch into mini-batches and micro-batches, and puts it back together.

Padded batches are cut in strided rows: slice i of n holds rows i, i+n, i+2n, …, so a batch sharded
over the data-parallel devices in row blocks keeps a share of every slice on every device (micro-
batch j of mini-batch k holds rows k + M·j + M·m·s). Packed batches (`reasoning_rl.rl.packing`)
arrive already cut, as [rows, S, ...] with one slice per index of the second axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_rows(tree, num_slices: int):
  """[B, ...] leaves → [num_slices, B / num_slices, ...]: slice i holds rows i, i+n, i+2n, …
  (strided, so a batch sharded over devices in row blocks keeps a share on every device)."""
  return jax.tree.map(
      lambda x: x.reshape(x.shape[0] // num_slices, num_slices, *x.shape[1:]).swapaxes(0, 1),
      tree)


def has_tokens(micro) -> jax.Array:
  """Whether a (packed) micro-batch holds any completion token."""
  return jnp.any(micro["completion_mask"] > 0)


def skipping_empty(forward, example):
  """`forward` of a packed micro-batch, or zeros (no compute, `lax.cond`) when it is empty."""
  shapes = jax.eval_shape(forward, example)
  nothing = lambda _: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  return lambda micro: jax.lax.cond(has_tokens(micro), forward, nothing, micro)


def slice_major(tree):
  """A packed batch's [rows, S, ...] leaves → [S, rows, ...] (one slice per leading index), and
  back."""
  return jax.tree.map(lambda x: x.swapaxes(0, 1), tree)


def merge_rows(tree):
  """Inverse of `split_rows`: [n, B / n, ...] → [B, ...] in the original row order."""
  return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)

