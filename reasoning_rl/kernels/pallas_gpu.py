"""Training attention on GPU: JAX's Pallas (Triton) flash attention kernel.

Flash attention (Dao et al. 2022; the backward of Dao 2023, "FlashAttention-2") computes softmax
block by block with a running maximum and normaliser, so the [T, T] scores are never held: memory
per layer is O(T). JAX's kernel takes segment ids (packed rows) and a causal mask; it has no
sliding window, logit soft-cap or attention sinks, so Gemma 2 and GPT-OSS layers keep the
reference path on GPU (the dispatcher decides). Its softmax runs in float32.

Masks are index-based: the caller guarantees consecutive positions within a segment. The kernel
wants as many KV heads as query heads, so grouped-query keys and values are repeated per group
(G× their size, still O(T)).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as gpu_attention

# q / kv blocks of the forward pass and of the backward passes, and the multiple T is padded to.
# Measured on an H200 (benchmarks/RESULTS.md, "Training attention kernels"): 128 / 64 is 12 %
# faster than 64 / 64 at 16k tokens and 37 % faster than JAX's own default (128 / 32).
FORWARD_BLOCK, BACKWARD_BLOCK = 128, 64
BLOCK = max(FORWARD_BLOCK, BACKWARD_BLOCK)


def attention(q, k, v, segment_ids, *, scale: float, interpret: bool = False,
              forward_block: int = FORWARD_BLOCK, backward_block: int = BACKWARD_BLOCK):
  """Causal attention within segments. q [B, T, N, D]; k, v [B, T, K, D]; segment_ids [B, T];
  T a multiple of both blocks (the dispatcher pads to BLOCK). Returns [B, T, N, D]."""
  group = q.shape[2] // k.shape[2]
  if group > 1:
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  f, b = forward_block, backward_block
  blocks = gpu_attention.BlockSizes(block_q=f, block_k=f, block_q_dkv=b, block_kv_dkv=b,
                                    block_q_dq=b, block_kv_dq=b)
  return gpu_attention.mha(q, k, v, segment_ids, sm_scale=scale, causal=True,
                           block_sizes=blocks, interpret=interpret)


def supports(*, softcap: float | None, window: int | None, sinks: bool = False) -> bool:
  """Whether this kernel computes a layer with these options (`sinks`: attention sinks)."""
  return not softcap and not window and not sinks

