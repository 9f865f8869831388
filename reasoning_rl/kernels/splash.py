"""Training attention on TPU: JAX's Pallas splash attention kernel.

Splash ("sparse flash") attention is flash attention (Dao et al. 2022, "FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness") for TPU that skips the blocks a static mask
rules out: scores live only block by block in VMEM, so memory per layer is O(T) instead of O(T²),
and a causal or sliding-window mask halves (or more) the work. It takes segment ids (packed rows),
causal and local masks, logit soft-capping and attention sinks (GPT-OSS: a learned logit per
query head that joins the softmax, its probability dropped; the kernel starts each row's running
maximum and normaliser from it, and its backward gives the sinks' gradient), and computes its
softmax in float32.

Masks are index-based, so the caller (`reasoning_rl.kernels.training_attention`) guarantees that
positions within a segment are consecutive indices (left-padded rows and packed rows are).
Grouped-query attention runs one multi-query kernel per KV head (vmapped), the way the kernel's
MQA variant is meant to be used.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

LANES = 128  # the kernel's blocks are multiples of a TPU vreg's 128 lanes


def block_size(length: int) -> int:
  """The q / kv block for rows of `length` (a multiple of LANES): 512 where it divides, the
  size MaxText uses on TPU, else 128."""
  return 512 if length % 512 == 0 else LANES


@functools.lru_cache(maxsize=64)
def _kernel(length: int, group: int, window: int | None, softcap: float | None, interpret: bool):
  """One multi-query splash kernel for rows of `length`, `group` query heads per KV head."""
  if window:
    # query i attends keys [i − (window − 1), i]: the position mask's 0 <= delta < window
    head_mask = splash.LocalMask((length, length), window_size=(window - 1, 0), offset=0)
  else:
    head_mask = splash.CausalMask((length, length))
  block = block_size(length)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                            block_q_dq=block, block_kv_dq=block)
  # The kernel holds its mask's block tables as arrays: made concrete here (not tracers of the
  # program being traced when it is first asked for), so the cached kernel serves every trace.
  with jax.ensure_compile_time_eval():
    return splash.make_splash_mqa_single_device(
        splash.MultiHeadMask([head_mask] * group), block_sizes=sizes,
        attn_logits_soft_cap=softcap, interpret=interpret)


def attention(q, k, v, segment_ids, sinks=None, *, scale: float, softcap: float | None,
              window: int | None, interpret: bool = False) -> jax.Array:
  """Causal (optionally sliding-window, soft-capped, with sinks) attention within segments.

  q [B, T, N, D]; k, v [B, T, K, D]; segment_ids [B, T] int32 (tokens attend only keys of their
  own segment); sinks [N] float32 or None. T must be a multiple of LANES (the dispatcher pads).
  Returns [B, T, N, D].
  """
  batch, length, num_heads, head_dim = q.shape
  num_kv = k.shape[2]
  group = num_heads // num_kv
  kernel = _kernel(length, group, window, softcap, interpret)
  # [B, K, G, T, D] queries (scaled here: the kernel does not scale), [B, K, T, D] keys / values
  q = (q * jnp.asarray(scale, q.dtype)).reshape(batch, length, num_kv, group, head_dim)
  q = q.transpose(0, 2, 3, 1, 4)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

  def one_row(q_row, k_row, v_row, ids):
    segments = splash.SegmentIds(q=ids, kv=ids)
    if sinks is None:
      return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=segments))(
          q_row, k_row, v_row)
    # each KV head's kernel takes the sinks of its group of query heads, [K, G]
    return jax.vmap(lambda qh, kh, vh, sh: kernel(qh, kh, vh, segment_ids=segments, sinks=sh))(
        q_row, k_row, v_row, sinks.astype(jnp.float32).reshape(num_kv, group))

  out = jax.vmap(one_row)(q, k, v, segment_ids)  # [B, K, G, T, D]
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads, head_dim)
