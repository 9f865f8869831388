"""Mixed precision: float32 master weights, computation in the model's dtype.

The policy (Micikevicius et al. 2018, "Mixed Precision Training", §3.1; MaxText's `weight_dtype`
against `dtype`): the trainer keeps its parameters and AdamW moments in `model.weight_dtype`
(float32 unless asked otherwise) and the forward and backward passes run in `model.dtype` (each
projection casts its kernel to the compute dtype right before the matmul, so gradients come back in
the master dtype). Gradients are summed over micro-batches in float32 whatever the weights are.

Why not bfloat16 weights: bfloat16 has 8 significant bits, so `w + u` rounds back to `w` whenever
|u| < |w| · 2^-9 (half a unit in the last place). An R1-Zero-sized AdamW step moves a weight by
about the learning rate (Adam normalises the update to ~1), e.g. 1e-6 against N(0, 0.02) weights:
almost every such update is rounded away, every step (`lost_update_fraction` measures it).

Only the trainer needs the master copy: the sampler decodes with weights in the compute dtype,
cast on the trainer side before they are sent (`TrainStep.sampler_weights`), so half the bytes
cross to the sampler, and the frozen KL reference is held in the compute dtype too (it only ever
feeds the forward pass, which casts to that dtype anyway).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

def is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floating(tree, dtype):
  """`tree` with every floating-point leaf in `dtype` (integer leaves, e.g. quantized weights or
  counters, untouched); leaves already in `dtype` are returned as they are (no copy). Works on
  arrays and on `jax.ShapeDtypeStruct`s."""
  dtype = jnp.dtype(dtype)

  def cast(x):
    if not is_float(x) or x.dtype == dtype:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):  # abstract trees (shapes for the weight sync)
      return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return x.astype(dtype)

  return jax.tree.map(cast, tree)


def needs_cast(tree, dtype) -> bool:
  """Whether any floating-point leaf of `tree` is not already in `dtype`."""
  dtype = jnp.dtype(dtype)
  return any(is_float(x) and x.dtype != dtype for x in jax.tree.leaves(tree))


def lost_update_fraction(weights: np.ndarray, update: float, dtype) -> float:
  """The fraction of `weights` that `weights + update` leaves unchanged once stored in `dtype`:
  the share of an update of that size which a weight of that dtype cannot hold."""
  stored = np.asarray(jnp.asarray(weights, dtype))
  moved = np.asarray(jnp.asarray(stored, jnp.float32) + update, dtype=np.float32)
  after = np.asarray(jnp.asarray(moved, dtype))
  return float(np.mean(after == stored))


def pure_low_precision_warning(weight_dtype: str, learning_rate: float) -> str | None:
  """The warning a run with low-precision master weights logs at its start, naming the share of
  an update of `learning_rate` size that N(0, 0.02) weights (a typical init scale) lose."""
  if jnp.dtype(weight_dtype).itemsize >= 4:
    return None
  weights = np.random.default_rng(0).normal(0.0, 0.02, 100_000).astype(np.float32)
  lost = lost_update_fraction(weights, learning_rate, weight_dtype)
  return (f"model.weight_dtype={weight_dtype}: the optimizer updates {weight_dtype} weights in "
          f"place; an update of the learning rate's size ({learning_rate:g}) leaves "
          f"{100 * lost:.0f}% of N(0, 0.02) weights unchanged (rounded away) every step. "
          "Use model.weight_dtype=float32 (master weights; compute stays in model.dtype) unless "
          "you have measured that the loss is acceptable")
