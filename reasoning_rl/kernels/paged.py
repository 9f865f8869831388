"""Decode attention over a paged KV cache (`reasoning_rl.models.kv_pages`): the two ways to read
the pool, one signature.

  kernel       backend  what it is
  -----------  -------  ---------------------------------------------------------------------
  gather       any      the rows' pages gathered into a contiguous [B, K, n·page, D] copy (one
                        layer at a time), then `decode_attention`, the position-masked reference
  pallas_tpu   TPU      JAX's Pallas TPU paged-attention kernel (`jax.experimental.pallas.ops.
                        tpu.paged_attention`, the decode kernel of JetStream's engine): reads
                        each row's pages where they lie, in blocks of pages, with an online
                        softmax; masks by each row's length

`auto` takes pallas_tpu on a TPU for the layers it computes exactly as the model asks — one
query per row (a decode step), no sliding window, no attention sinks (GPT-OSS), a bfloat16 pool
(the kernel converts keys and values to bfloat16 before its products, so a float32 pool would
lose digits), heads of a multiple of 128 lanes — and gather elsewhere. Named explicitly, pallas_tpu runs anywhere (off a
TPU in Pallas's TPU interpret mode, how tests/test_paged_kv.py checks it on CPU) on those same
layers; the others still gather.

Why not `ragged_paged_attention` (the kernel for mixed prefill and decode batches): JAX 0.10.2's
TPU interpreter cannot run it (its reshape of a VMEM buffer reference is unsupported there), so
it could not be tested on this project's machines; the engine's decode steps are one query per
row, which the paged-attention kernel covers.

Mask equivalence: the kernel attends entries [0, length) of a row; the reference attends the
entries whose position is in [0, q_pos] (and within the window). They agree because a row's
entries are contiguous from 0 with position = index, and length = q_pos + 1 for a decode step.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
from jax.sharding import PartitionSpec

from reasoning_rl import config_schema
from reasoning_rl.errors import ConfigError
from reasoning_rl.sharding import logical_to_spec

PAGED_KERNELS = config_schema.PAGED_KERNELS  # ("auto", "gather", "pallas_tpu")
# Keys per compute block of the TPU kernel (pages_per_compute_block · page_size at most this):
# the block streamed into VMEM per step of its online softmax.
BLOCK_KEYS = 512


def validate_paged_kernel(name: str, field: str = "config.rollout.kv_page_kernel") -> None:
  if name not in PAGED_KERNELS:
    raise ConfigError(f"{field}={name!r}: choose one of {', '.join(PAGED_KERNELS)} ('auto' "
                      "picks the backend's)")


def choose_paged_kernel(requested: str, *, backend: str, dtype, head_dim: int,
                        latent_attention: bool = False) -> str:
  """The kernel the engine hands its layers (module docstring); per layer, `runs_kernel` still
  sends windowed layers and multi-token calls to the gather path. `auto` also keeps to the
  shapes the kernel is built for on a TPU, heads of a multiple of 128 lanes (Llama, Qwen,
  Gemma; SmolLM2's 64 gather). A latent-attention model (`models/mla.py`) always gathers: the
  kernel computes grouped-query attention, not attention over a compressed cache."""
  validate_paged_kernel(requested)
  if latent_attention:
    if requested == "pallas_tpu":
      raise ConfigError("config.rollout.kv_page_kernel='pallas_tpu': the TPU paged-attention "
                        "kernel computes grouped-query attention, and this model's latent "
                        "attention (DeepSeek-V3) reads its compressed cache by gathering pages; "
                        "use 'auto' or 'gather'")
    return "gather"
  if requested == "auto":
    native = backend == "tpu" and jnp.dtype(dtype) == jnp.bfloat16 and head_dim % 128 == 0
    return "pallas_tpu" if native else "gather"
  return requested


def backend_of(mesh) -> str:
  """The platform the engine's mesh lives on (JAX's default backend without one): what the
  kernel choice is made for, and whether the kernel runs natively or interpreted."""
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def runs_kernel(kernel: str, q, window, sinks=None) -> bool:
  """Whether the kernel computes this layer's call: pallas_tpu, one query per row, no window,
  no attention sinks (the kernel's softmax has no place for them)."""
  return kernel == "pallas_tpu" and q.shape[1] == 1 and not window and sinks is None


def _pages_per_block(pages_per_row: int, page_size: int) -> int:
  """The largest divisor of the table's width (the kernel needs one) within BLOCK_KEYS keys."""
  best = 1
  for count in range(1, pages_per_row + 1):
    if pages_per_row % count == 0 and count * page_size <= BLOCK_KEYS:
      best = count
  return best


def _tpu_kernel(q, k_pool, v_pool, table, lengths, *, scale, softcap, interpret):
  """q [B, N, D] (scaled here); pools [K, P, page, D]; table [B, n] of valid pages."""
  run = functools.partial(
      paged_attention, attn_logits_soft_cap=softcap,
      pages_per_compute_block=_pages_per_block(table.shape[1], k_pool.shape[2]))
  with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
    return run((q.astype(jnp.float32) * scale).astype(q.dtype), k_pool, v_pool, lengths, table)


def _over_mesh(run, mesh, q, k_pool, v_pool, table, lengths):
  """`run` per device of the engine's mesh: rows split as the decode state's, heads as the
  pool's (a Pallas call is opaque to XLA's sharding propagation, which would gather the pool)."""
  if mesh is None or mesh.size == 1:
    return run(q, k_pool, v_pool, table, lengths)
  rows = logical_to_spec(("batch",), lengths.shape, mesh)[0]
  heads = logical_to_spec(("heads",), (q.shape[1],), mesh)[0]
  kv_heads = logical_to_spec(("kv_heads",), (k_pool.shape[0],), mesh)[0]
  if heads != kv_heads:  # a shard's query heads would lose their KV head: split neither
    heads = kv_heads = None
  q_spec = PartitionSpec(rows, heads, None)
  pool_spec = PartitionSpec(kv_heads, None, None, None)
  return jax.shard_map(run, mesh=mesh, in_specs=(q_spec, pool_spec, pool_spec,
                                                 PartitionSpec(rows, None), PartitionSpec(rows)),
                       out_specs=q_spec, check_vma=False)(q, k_pool, v_pool, table, lengths)


def read_pages(pool: jax.Array, table: jax.Array) -> jax.Array:
  """The gather path's read: pool [K, P, page, D] through `table` [B, n] (−1: none, read as page
  0, which its positions of −1 mask) as the contiguous [B, K, n·page, D]."""
  rows, n = table.shape
  heads, _, page, dim = pool.shape
  picked = pool[:, jnp.maximum(table, 0)]  # [K, B, n, page, D]
  return picked.swapaxes(0, 1).reshape(rows, heads, n * page, dim)


def kernel_attention(q, k_pool, v_pool, table, lengths, *, mesh, scale: float,
                     softcap: float | None) -> jax.Array:
  """The pallas_tpu path: q [B, 1, N, D]; pools [K, P, page, D]; table [B, n] of pages in the
  pools (every entry a valid page); lengths [B] entries per row. Returns [B, 1, N, D]."""
  run = functools.partial(_tpu_kernel, scale=scale, softcap=softcap,
                          interpret=backend_of(mesh) != "tpu")
  # rows no call writes (done or empty slots) still run: a length of at least 1 keeps their
  # softmax defined; their outputs are never read
  lengths = jnp.maximum(lengths, 1).astype(jnp.int32)
  out = _over_mesh(run, mesh, q[:, 0], k_pool, v_pool, table.astype(jnp.int32), lengths)
  return out[:, None].astype(q.dtype)


__all__ = ["BLOCK_KEYS", "PAGED_KERNELS", "backend_of", "choose_paged_kernel",
           "kernel_attention", "read_pages", "runs_kernel", "validate_paged_kernel"]
