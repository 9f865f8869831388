"""The building blocks every layer of the decoder is made of: parameters with logical axes (and
buffers, the variables no optimizer updates), a projection's kernel in the compute dtype,
projections over flattened rows, RMSNorm, rotary position embeddings, and the write of new
entries into a contiguous KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from reasoning_rl.models import cpu_products


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
  rows = x.reshape(batch * length, *x.shape[2:])
  if cpu_products.applies(rows, kernel):
    out = cpu_products.project_rows(spec, rows, kernel)
  else:
    out = jnp.einsum(spec, rows, kernel)
  return out.reshape(batch, length, *out.shape[1:])


def param(rngs: nnx.Rngs | None, shape, dtype, axes, init: str = "normal", std: float = 0.02):
  if init == "zeros":
    value = jnp.zeros(shape, dtype)
  elif init == "ones":
    value = jnp.ones(shape, dtype)
  else:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(axes))


class Buffer(nnx.Variable):
  """A model variable that is part of the function but not trained: it comes from the checkpoint
  and is written back to it, and no optimizer updates it (`reasoning_rl.rl.optimizer.make_optimizer`
  leaves every variable that is not an `nnx.Param` as it is). DeepSeek-V3's router selection
  bias is one (`reasoning_rl.models.moe`): its own balancing rule sets it, not the gradient."""


def buffer(shape, dtype, axes) -> Buffer:
  """A zero-initialised `Buffer` with logical axes (a checkpoint fills it)."""
  return Buffer(jnp.zeros(shape, dtype), logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
  """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32.

  y = x / sqrt(mean(x²) + eps) · w, or · (1 + w) for Gemma (whose checkpoints store w − 1).
  """

  def __init__(self, dim: int, *, eps: float, plus_one: bool, param_dtype, axes=("norm",)):
    self.eps = eps
    self.plus_one = plus_one
    self.scale = param(None, (dim,), param_dtype, axes, init="zeros" if plus_one else "ones")

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.plus_one:
      return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
    return normed.astype(x.dtype) * self.scale[...].astype(x.dtype)


def rope_angles(positions: jax.Array, inv_freq: jax.Array,
                attention_factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) [B, T, 1, D] in float32 for positions [B, T], halves layout, scaled by
  `attention_factor` (YaRN's, `transformer.rope_attention_factor`). A forward computes them once
  per table and every layer's q and k reuse them."""

  # XLA:CPU counts sin and cos as cheap and duplicates them into their consumers' fusions. Taken
  # of the concatenated [B, T, D] angles, a copy landed in every q and k rotation, once per layer,
  # pass and head, each a libm call per element (4.5 % of a SmolLM2 training step's CPU time on an
  # Intel Xeon; benchmarks/RESULTS.md). Taken of the half-width angles before the concatenation,
  # they stay one fusion per table and forward, which every layer reads (tests/test_rope.py).
  half = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos, sin = jnp.cos(half), jnp.sin(half)
  if attention_factor != 1.0:
    cos, sin = cos * attention_factor, sin * attention_factor
  return (jnp.concatenate([cos, cos], axis=-1)[:, :, None, :],
          jnp.concatenate([sin, sin], axis=-1)[:, :, None, :])


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, H, D] rotated by `rope_angles`' (cos, sin), halves layout (first half · second
  half)."""
  cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               attention_factor: float = 1.0) -> jax.Array:
  """Rotates x [B, T, H, D] by its positions [B, T]: `rotate` by freshly computed
  `rope_angles`."""
  return rotate(x, *rope_angles(positions, inv_freq, attention_factor))


# The length axis of one layer's KV-cache buffer (`transformer.KVCache`): keys [B, K, D, S],
# values [B, K, S, D].
KEYS_LENGTH_AXIS = 3
VALUES_LENGTH_AXIS = 2


def scatter_cache(buffer: jax.Array, rows_index: jax.Array, values: jax.Array,
                  layer=None, *, length_axis: int = VALUES_LENGTH_AXIS) -> jax.Array:
  """buffer [B, K, S, D] at [b, :, rows_index[b, t]] = values [B, T, K, D]; drops outside.
  With length_axis=KEYS_LENGTH_AXIS the buffer is [B, K, D, S] (a keys cache, `KVCache`) and is
  written at [b, :, :, rows_index[b, t]].

  With `layer` (a scanned stack), buffer is [L, B, …] and only layer `layer` is written, in
  place: the scan carries the whole cache, and copying a layer out and back would move it twice.

  A decode step's write (one new entry per row) into a 2-byte float cache on a CPU is a select
  instead (`_select_entry`): XLA:CPU computes a bfloat16 scatter in float32, converting the
  whole buffer to float32 and back around it, two passes over the cache per layer and step where
  a float32 buffer is written in place; a select over the cache's 16-bit words is one fused pass
  at their width (benchmarks/RESULTS.md, "bfloat16 decoding: the cache write").
  """
  if _select_one_entry(buffer, values):
    return _select_entry(buffer, rows_index[:, 0], values[:, 0], layer, length_axis)
  batch = jnp.arange(values.shape[0])[:, None]
  if length_axis == KEYS_LENGTH_AXIS:
    # advanced indices around two slices: the indexed entries come out [B, T, K, D], as given
    index = (batch, slice(None), slice(None), rows_index)
    ordered = values
  else:
    heads = jnp.arange(values.shape[2])[None, :, None]
    index = (batch[:, :, None], heads, rows_index[:, None, :])
    ordered = values.swapaxes(1, 2)
  if layer is not None:
    index = (layer, *index)
  return buffer.at[index].set(ordered, mode="drop")


def writes_through_float32(dtype) -> bool:
  """Whether XLA here writes into a buffer of `dtype` (scatter, dynamic-update-slice) through
  float32 copies of the whole buffer: a 2-byte float on a CPU backend. Such writes are selects
  over the buffer's 16-bit words instead (`where_by_words`)."""
  dtype = jnp.dtype(dtype)
  return (jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2
          and jax.default_backend() == "cpu")


def where_by_words(hit: jax.Array, value: jax.Array, buffer: jax.Array) -> jax.Array:
  """jnp.where(hit, value, buffer) for a 2-byte float buffer, computed over its 16-bit words:
  XLA:CPU computes a select of bfloat16 in float32 (a fused pass with conversions), one of
  integers at their width, 4× faster."""
  words = jnp.uint16
  written = jnp.where(hit, jax.lax.bitcast_convert_type(value.astype(buffer.dtype), words),
                      jax.lax.bitcast_convert_type(buffer, words))
  return jax.lax.bitcast_convert_type(written, buffer.dtype)


def _select_one_entry(buffer: jax.Array, values: jax.Array) -> bool:
  """Whether `scatter_cache` writes by select: one entry per row, a 2-byte float buffer, a CPU."""
  return values.shape[1] == 1 and writes_through_float32(buffer.dtype)


def _select_entry(buffer: jax.Array, slot: jax.Array, value: jax.Array, layer,
                  length_axis: int) -> jax.Array:
  """buffer [B, K, S, D] or [B, K, D, S] (`length_axis`; [L, B, …] at `layer`) with entry slot[b]
  of row b set to value [B, K, D] and every other entry kept, as the scatter: a slot in
  [-S, 0) counts from the end (numpy's indexing), any other slot outside [0, S) writes nothing."""
  size = buffer.shape[length_axis + (layer is not None)]
  slot = jnp.where(slot < 0, slot + size, slot)
  hit = jnp.arange(size)[None, :] == slot[:, None]  # [B, S]
  if length_axis == KEYS_LENGTH_AXIS:
    hit, value = hit[:, None, None, :], value[..., None]
  else:
    hit, value = hit[:, None, :, None], value[:, :, None, :]
  value = value.astype(buffer.dtype)
  if layer is not None:
    # The whole stack is selected over (the layer index is traced); as floats, which XLA:CPU
    # computes in float32 inside one fused pass: as 16-bit words the scan's carry got two
    # bitcast copies of the stack per layer, 2× slower (benchmarks/RESULTS.md, same section).
    hit = (jnp.arange(buffer.shape[0]) == layer)[:, None, None, None, None] & hit[None]
    return jnp.where(hit, value[None], buffer)
  return where_by_words(hit, value, buffer)
