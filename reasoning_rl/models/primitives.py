"""The building blocks every layer of the decoder is made of: parameters with logical axes, a
projection's kernel in the compute dtype, and projections over flattened rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes


def weight(variable, dtype):
  """A projection's kernel in the compute dtype. Through flax's promote_dtype because qwix
  intercepts it: a quantized base (QLoRA) is passed on as is, for qwix's matmul to consume."""
  return dtypes.promote_dtype((variable[...],), dtype=dtype)[0]


def project(spec: str, x, kernel):
  """x [B, T, …] through a projection kernel: one `jnp.einsum(spec, …)` over the B·T rows
  flattened into one axis (`spec` names that axis t), the result reshaped back to [B, T, …].

  Why flat rows: with B and T as two axes, the kernel's gradient contracts two axes of the
  activations, and XLA:CPU lays the [B, T, F] operand out transposed for it, a strided copy of the
  MLP's widest activation per projection; with one row axis the contraction is a plain matmul
  (benchmarks/RESULTS.md, "Training step: projections over flattened rows"). It stays a
  `jnp.einsum` with the kernel as its second operand, the call qwix intercepts to add LoRA
  adapters."""
  batch, length = x.shape[:2]
  out = jnp.einsum(spec, x.reshape(batch * length, *x.shape[2:]), kernel)
  return out.reshape(batch, length, *out.shape[1:])


def param(rngs: nnx.Rngs | None, shape, dtype, axes, init: str = "normal", std: float = 0.02):
  if init == "zeros":
    value = jnp.zeros(shape, dtype)
  elif init == "ones":
    value = jnp.ones(shape, dtype)
  else:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(axes))
