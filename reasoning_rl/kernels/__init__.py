"""Attention kernels: one signature for training attention and one for decode attention, the
implementation chosen from the backend the program runs on.

Training attention (the full forward of the training step and of scoring):

  kernel        backend   what it is                                   memory per layer
  ------------  --------  -------------------------------------------  ----------------
  reference     any       XLA einsums over [T, T] scores, causal       O(T²)
                          blocks of queries skipping later keys
  splash        TPU       Pallas splash attention (flash, block-sparse) O(T)
  pallas_gpu    GPU       Pallas/Triton flash attention                O(T)

`auto` (the default, `config.model.attention_kernel`) takes splash on TPU, pallas_gpu on GPU where
it supports the layer (no sliding window, no soft-cap, no attention sinks: Gemma 2 and GPT-OSS
stay on the reference there) and the reference on CPU. A kernel named explicitly runs anywhere:
off its own backend in Pallas interpret mode (slow, exact; how the tests check each kernel on
CPU); pallas_gpu named for a model it cannot compute is refused (ConfigError). Splash and the
reference take GPT-OSS's attention sinks (a learned logit per head that joins the softmax, its
probability dropped), with their gradient.

The kernels' masks are index-based (causal within a segment), the reference's position-based;
they agree because every training row holds each sequence at consecutive indices with positions
0, 1, 2, … (left-padded rows, right-padded rows and packed rows alike). Padding tokens form
segment 0 and attend only each other; their outputs are never read.

Under a mesh (`jax.sharding.use_abstract_mesh`, as the training step traces) a kernel runs inside
`jax.shard_map`: each device computes its own rows (and its heads, where the tensor axis splits
query and KV heads alike), because a Pallas call is opaque to XLA's sharding propagation.

Decode attention (the sampler's cached steps) is the reference with a CPU fast path for one query
per row over a contiguous cache; over the paged cache (`reasoning_rl.models.kv_pages`) it is
`paged_decode_attention`: the rows' pages gathered into that layout, or read in place by JAX's
Pallas TPU paged-attention kernel (`reasoning_rl.kernels.paged`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from reasoning_rl import config_schema
from reasoning_rl.errors import ConfigError
from reasoning_rl.kernels import paged, pallas_gpu, reference, splash
from reasoning_rl.sharding import logical_to_spec

TRAINING_KERNELS = config_schema.TRAINING_KERNELS  # ("auto", "reference", "splash", "pallas_gpu")
_NATIVE_BACKEND = {"splash": "tpu", "pallas_gpu": "gpu"}
_GPU_BACKENDS = ("gpu", "cuda", "rocm")


def validate_kernel_name(name: str, field: str = "config.model.attention_kernel") -> None:
  if name not in TRAINING_KERNELS:
    raise ConfigError(f"{field}={name!r}: choose one of {', '.join(TRAINING_KERNELS)} "
                      "('auto' picks the backend's kernel)")


def choose_training_kernel(requested: str, *, backend: str, softcap: float | None = None,
                           window: int | None = None, sinks: bool = False) -> str:
  """The kernel that computes a layer with these options on `backend` (module docstring);
  `sinks`: the layer has attention sinks."""
  validate_kernel_name(requested)
  gpu_ok = pallas_gpu.supports(softcap=softcap, window=window, sinks=sinks)
  if requested == "auto":
    if backend == "tpu":
      return "splash"
    return "pallas_gpu" if backend in _GPU_BACKENDS and gpu_ok else "reference"
  if requested == "pallas_gpu" and not gpu_ok:
    raise ConfigError("config.model.attention_kernel='pallas_gpu': JAX's GPU flash kernel has no "
                      "sliding window, logit soft-cap or attention sinks, which this model uses; "
                      "use 'auto' (the reference on GPU for this model) or 'reference'")
  return requested


def _native(name: str, backend: str) -> bool:
  native = _NATIVE_BACKEND[name]
  return backend == native or (native == "gpu" and backend in _GPU_BACKENDS)


def _over_mesh(kernel, q, k, v, segment_ids, sinks=None):
  """kernel(q, k, v, segment_ids[, sinks]) per device under the traced mesh, else as is
  (docstring); sinks [N] (when given) split as the query heads."""
  mesh = jax.sharding.get_abstract_mesh()
  args = (q, k, v, segment_ids) + (() if sinks is None else (sinks,))
  if mesh.empty:
    return kernel(*args)
  q_spec = logical_to_spec(("batch", "length", "heads", "head_dim"), q.shape, mesh)
  kv_spec = logical_to_spec(("batch", "length", "kv_heads", "head_dim"), k.shape, mesh)
  if q_spec[2] != kv_spec[2]:
    # query heads split where KV heads are not (3 KV heads on a tensor axis of 2): a shard's query
    # heads would lose their KV head, so neither is split here
    q_spec = PartitionSpec(q_spec[0], None, None, None)
    kv_spec = PartitionSpec(kv_spec[0], None, None, None)
  ids_spec = PartitionSpec(q_spec[0], None)
  specs = (q_spec, kv_spec, kv_spec, ids_spec, PartitionSpec(q_spec[2]))[:len(args)]
  return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=q_spec,
                       check_vma=False)(*args)


def training_attention(q, k, v, positions, key_positions, segment_ids=None, *, scale: float,
                       softcap: float | None, window: int | None, sinks=None,
                       kernel: str = "auto") -> jax.Array:
  """Causal grouped-query self-attention of a training row.

  q [B, T, N, D]; k, v [B, T, K, D]; positions [B, T] of the queries, key_positions [B, T] the
  same with −1 at padding; segment_ids [B, T] (0 = padding) for packed rows, else None; sinks
  [N] float32 (attention sinks) or None. Returns [B, T, N, D]. `kernel`: one of
  TRAINING_KERNELS (module docstring).
  """
  backend = jax.default_backend()
  name = choose_training_kernel(kernel, backend=backend, softcap=softcap, window=window,
                                sinks=sinks is not None)
  if name == "reference":
    return reference.causal_attention(q, k, v, positions, key_positions, scale=scale,
                                      softcap=softcap, window=window, segment_ids=segment_ids,
                                      sinks=sinks)
  if segment_ids is None:
    segment_ids = (key_positions >= 0).astype(jnp.int32)
  interpret = not _native(name, backend)
  if name == "splash":
    multiple = splash.LANES
    run = functools.partial(splash.attention, scale=scale, softcap=softcap, window=window,
                            interpret=interpret)
  else:  # never with sinks (choose_training_kernel)
    multiple = pallas_gpu.BLOCK
    run = functools.partial(pallas_gpu.attention, scale=scale, interpret=interpret)
  length = q.shape[1]
  pad = -length % multiple
  if pad:  # padded tokens join segment 0 (padding): nothing real attends them
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
  out = _over_mesh(run, q, k, v, segment_ids.astype(jnp.int32), sinks)
  return out[:, :length].astype(v.dtype)


def decode_attention(q, k_cache, v_cache, q_pos, k_pos, *, scale: float, softcap: float | None,
                     window: int | None, sinks=None, keys_length_last: bool = True) -> jax.Array:
  """Attention of T new tokens per row over a KV cache: keys [B, K, D, S] (`KVCache`'s layout;
  [B, K, S, D] with keys_length_last=False), values [B, K, S, D] (position-based mask; sinks [N]
  or None).

  One query per row on a CPU takes `reference.one_query_attention` (products and sums: XLA:CPU
  runs one-row matmuls slowly); everything else the einsum reference."""
  options = dict(scale=scale, softcap=softcap, window=window, sinks=sinks,
                 keys_length_last=keys_length_last)
  if q.shape[1] == 1 and jax.default_backend() == "cpu":
    return reference.one_query_attention(q, k_cache, v_cache, q_pos, k_pos, **options)
  return reference.attention(q, k_cache, v_cache, q_pos, k_pos, kv_heads_first=True, **options)


def paged_decode_attention(q, k_pool, v_pool, page_offset, address, q_pos, k_pos, *,
                           scale: float, softcap: float | None, window: int | None,
                           sinks=None) -> jax.Array:
  """Attention of T new tokens per row [B, T, N, D] over the pages of `address.read_table`.

  k_pool, v_pool: one layer's [K, pages, page, D] view (`kv_pages.layer_view`) in which the
  layer's page 0 is page `page_offset`; address: the call's `kv_pages.PageAddress` (read table
  [B, n] with −1 for none, lengths [B], and the engine's kernel and mesh); q_pos [B, T] and
  k_pos [B, n·page] positions (−1: empty); sinks [N] or None. The layers and calls the kernel
  does not cover (`paged.runs_kernel`: windowed layers, layers with sinks, several tokens per
  row) gather their pages and take `decode_attention`.
  """
  options = dict(scale=scale, softcap=softcap)
  table = jnp.where(address.read_table >= 0, address.read_table + page_offset, -1)
  if paged.runs_kernel(address.kernel, q, window, sinks):
    return paged.kernel_attention(q, k_pool, v_pool, jnp.maximum(table, page_offset),
                                  address.lengths, mesh=address.mesh, **options)
  k, v = paged.read_pages(k_pool, table), paged.read_pages(v_pool, table)
  return decode_attention(q, k.astype(q.dtype), v.astype(q.dtype), q_pos, k_pos, window=window,
                          sinks=sinks, keys_length_last=False, **options)


__all__ = ["TRAINING_KERNELS", "choose_training_kernel", "decode_attention",
           "paged_decode_attention", "training_attention", "validate_kernel_name"]
