"""Attention written as plain XLA ops: the reference every kernel is tested against, and the path a
CPU takes.

Masks are position-based: query t attends key s iff 0 <= k_pos[s] <= q_pos[t] (a negative position
marks an empty or padding key), q_pos[t] − k_pos[s] < window for sliding layers, and — with
`segment_ids`, queries and keys being the same tokens of a packed row — both tokens belong to the
same sequence. A segment id is `unit · BRANCHES + branch` (`shared_prefix_ids`): the tokens of
branch 0 of a unit ≥ 1 are a prefix every branch of that unit attends (one prompt, its
completions each a branch, `rl/packing.py`'s shared prompts); ids below BRANCHES (unit 0, the
plain packed layout) are sequences of their own. So a key is visible to a query iff their ids are
equal, or the key is its unit's prefix; with no prefix tokens that is equality, the rule the
flash kernels apply. With `sinks` (GPT-OSS), each head's learned sink logit joins every query's softmax
as one more score and its probability is then dropped: the weights over the keys sum to less
than 1, and a query may attend to almost nothing. Scores and softmax are float32 whatever the
compute dtype. The [B, heads, T, S]
scores are materialised, so memory grows with T·S: fine for a CPU's short rows, not for 32k tokens
on an accelerator (`reasoning_rl.kernels` picks a flash kernel there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED_SCORE = -1e30  # finite, so a query with nothing to attend to gives uniform (unused) weights
BRANCH_BITS = 16
BRANCHES = 1 << BRANCH_BITS  # branches per unit of a segment id (module docstring)
# `causal_attention`'s query blocks: fewer and longer leave more masked scores computed, more and
# shorter run more, smaller products (benchmarks/RESULTS.md, "Causal blocks and a heads-first
# layout")
MIN_CAUSAL_BLOCK = 64
MAX_CAUSAL_BLOCKS = 8


def shared_prefix_ids(unit, branch):
  """The segment id of branch `branch` of unit `unit` (module docstring); branch 0 of a unit
  >= 1 is that unit's shared prefix."""
  return (unit << BRANCH_BITS) + branch


def _visible(q_ids, k_ids) -> jax.Array:
  """[B, T, S] bool: the key's segment is the query's, or the key is the prefix of the query's
  unit (module docstring)."""
  k_unit, k_branch = k_ids >> BRANCH_BITS, k_ids & (BRANCHES - 1)
  same = q_ids[:, :, None] == k_ids[:, None, :]
  prefix = (k_branch == 0) & (k_unit > 0)
  return same | (prefix[:, None, :] & ((q_ids >> BRANCH_BITS)[:, :, None] == k_unit[:, None, :]))


def allowed(q_pos, k_pos, *, window: int | None, segment_ids=None,
            key_segment_ids=None) -> jax.Array:
  """[B, T, S] bool: which key each query may attend (module docstring). `key_segment_ids`: the
  keys' ids where the keys are not the queries' tokens (a block of keys), else `segment_ids`."""
  delta = q_pos[:, :, None] - k_pos[:, None, :]
  mask = (k_pos[:, None, :] >= 0) & (delta >= 0)
  if window:
    mask &= delta < window
  if segment_ids is not None:
    mask &= _visible(segment_ids, segment_ids if key_segment_ids is None else key_segment_ids)
  return mask


def _capped(scores, softcap):
  """Logit soft-capping, softcap · tanh(s / softcap) (Gemma 2 report, 2024, §2)."""
  return jnp.tanh(scores / softcap) * softcap if softcap else scores


def softmax(scores, sinks=None) -> jax.Array:
  """Softmax over the last axis of float32 scores [B, K, G, …, S]; with `sinks` [N = K·G] each
  head's sink logit joins as one more score whose probability is dropped (module docstring)."""
  if sinks is None:
    return jax.nn.softmax(scores, axis=-1)
  num_kv, group = scores.shape[1:3]
  sink = sinks.astype(jnp.float32).reshape(1, num_kv, group, *([1] * (scores.ndim - 3)))
  sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
  return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


def attention(q, k, v, q_pos, k_pos, *, scale: float, softcap: float | None, window: int | None,
              kv_heads_first: bool = False, keys_length_last: bool = False, segment_ids=None,
              key_segment_ids=None, sinks=None) -> jax.Array:
  """Grouped-query attention (Ainslie et al. 2023) with the module's position-based mask.

  q [B, T, N, D]; k, v [B, S, K, D], or [B, K, S, D] with `kv_heads_first` (the KV-cache layout;
  k [B, K, D, S] with `keys_length_last` too), N a multiple of K; q_pos [B, T]; k_pos [B, S];
  sinks [N] or None; segment_ids [B, T] and, where the keys are not the queries' tokens,
  key_segment_ids [B, S]. Returns [B, T, N, D] in v's dtype.
  """
  batch, steps, num_heads, head_dim = q.shape
  num_kv = k.shape[1] if kv_heads_first else k.shape[2]
  group = num_heads // num_kv
  if not kv_heads_first:
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  keys = k.shape[3] if keys_length_last else k.shape[2]
  # Each KV head's queries as the rows of one matrix, [B, K, G·T, D]: the products are then plain
  # batched matmuls over contiguous operands, where an einsum over [B, T, K, G, D] left XLA:CPU
  # layouts it ran slower (benchmarks/RESULTS.md, "Causal blocks and a heads-first layout")
  q = q.reshape(batch, steps, num_kv, group, head_dim).transpose(0, 2, 3, 1, 4)
  q = q.reshape(batch, num_kv, group * steps, head_dim)
  spec = "bkmd,bkds->bkms" if keys_length_last else "bkmd,bksd->bkms"
  scores = jnp.einsum(spec, q, k, preferred_element_type=jnp.float32) * scale
  scores = scores.reshape(batch, num_kv, group, steps, keys)
  mask = allowed(q_pos, k_pos, window=window, segment_ids=segment_ids,
                 key_segment_ids=key_segment_ids)
  scores = jnp.where(mask[:, None, None], _capped(scores, softcap), MASKED_SCORE)
  probs = softmax(scores, sinks).reshape(batch, num_kv, group * steps, keys)
  out = jnp.einsum("bkms,bksd->bkmd", probs.astype(v.dtype), v)
  out = out.reshape(batch, num_kv, group, steps, head_dim).transpose(0, 3, 1, 2, 4)
  return out.reshape(batch, steps, num_heads, head_dim)


def causal_blocks(length: int) -> list[tuple[int, int]]:
  """[start, end) of the query blocks `causal_attention` splits a row of `length` into: at most
  MAX_CAUSAL_BLOCKS, none shorter than MIN_CAUSAL_BLOCK (one block below twice that)."""
  count = max(1, min(MAX_CAUSAL_BLOCKS, length // MIN_CAUSAL_BLOCK))
  size = -(-length // count)
  return [(start, min(length, start + size)) for start in range(0, length, size)]


def causal_attention(q, k, v, q_pos, k_pos, *, scale: float, softcap: float | None,
                     window: int | None, segment_ids=None, sinks=None) -> jax.Array:
  """`attention` of a training row's tokens over themselves, computing for each block of queries
  only the keys up to the block's end.

  Valid where no query attends a key at a later index, which holds for every training row
  (`reasoning_rl.kernels`' docstring: each sequence at consecutive indices, positions rising; a
  shared prompt before its branches): the skipped keys are all masked, so the result is
  `attention`'s for every query that attends something. A query that attends nothing (padding)
  gets uniform weights over its block's keys rather than all of them; its output is never read.
  Why: the dense [T, T] scores cost T² per head where a causal row needs about half, and on a
  CPU the reference's softmax and layout work over them is most of the attention's time
  (benchmarks/RESULTS.md, "Causal blocks and a heads-first layout").

  q [B, T, N, D]; k, v [B, T, K, D]; q_pos, k_pos, segment_ids [B, T]; as `attention` otherwise.
  """
  outputs = []
  for start, end in causal_blocks(q.shape[1]):
    query_ids = key_ids = None
    if segment_ids is not None:
      query_ids, key_ids = segment_ids[:, start:end], segment_ids[:, :end]
    outputs.append(attention(q[:, start:end], k[:, :end], v[:, :end], q_pos[:, start:end],
                             k_pos[:, :end], scale=scale, softcap=softcap, window=window,
                             segment_ids=query_ids, key_segment_ids=key_ids, sinks=sinks))
  return outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=1)


def one_query_attention(q, k, v, q_pos, k_pos, *, scale: float, softcap: float | None,
                        window: int | None, sinks=None, keys_length_last: bool = True) -> jax.Array:
  """`attention` for one query per row (a decode step) over a cache of keys k [B, K, D, S]
  ([B, K, S, D] with keys_length_last=False, as pages are read) and values v [B, K, S, D],
  written as broadcast products and sums instead of matmuls.

  Why: with one query the einsums become batches of [G, D] × [D, S] matmuls, which XLA:CPU runs
  slowly, while products and sums fuse into vectorised loops (benchmarks/RESULTS.md, "Sampler:
  the decode step's non-matmul work"); over length-last keys the sum over D runs along the keys
  in vector lanes ("The keys cache stored length-last"). Same values up to summation order.
  """
  batch, _, num_heads, head_dim = q.shape
  num_kv = k.shape[1]
  q = q.reshape(batch, num_kv, num_heads // num_kv, head_dim).astype(jnp.float32)
  if keys_length_last:
    scores = jnp.sum(q[..., None] * k[:, :, None].astype(jnp.float32), axis=-2)
  else:
    scores = jnp.sum(q[:, :, :, None, :] * k[:, :, None].astype(jnp.float32), axis=-1)
  scores = scores * scale  # [B, K, G, S]
  mask = allowed(q_pos, k_pos, window=window)[:, 0]  # [B, S]
  scores = jnp.where(mask[:, None, None], _capped(scores, softcap), MASKED_SCORE)
  probs = softmax(scores, sinks)
  out = jnp.sum(probs[..., None] * v[:, :, None].astype(jnp.float32), axis=-2)  # [B, K, G, D]
  return out.astype(v.dtype).reshape(batch, 1, num_heads, head_dim)
