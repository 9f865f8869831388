"""Decode attention alone on a CPU: one query per row over a KV cache, three ways of writing it.

SmolLM2-135M's shape (9 query heads over 3 KV heads of 64 dims), 30 layers each with its own
cache (so every layer reads its K and V from memory, as in a decode step), one jit:
- `products` — `kernels.reference.one_query_attention` over keys stored [B, K, D, S], what the
  engine runs on a CPU (`KVCache`'s layout): q·K as broadcast products and a sum over the head
  dim, which vectorises along the keys;
- `keys_length_first` — the same over keys stored [B, K, S, D] (the cache's layout before
  2026-12-01; pages are still read so): the sum over the head dim runs along each key's row;
- `einsum` — batched [G, D] × [D, S] matmuls over the [B, K, S, D] keys.
Prints ms per 30 layers (median and min of --repeats) and the bytes of K and V read per second.

Usage: python -m benchmarks.decode_attention [--rows 64] [--keys 208] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from reasoning_rl.kernels import reference

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 30, 3, 3, 64


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=64)
  parser.add_argument("--keys", type=int, default=208)
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args()
  b, s = args.rows, args.keys
  rng = np.random.default_rng(0)

  def cache():
    return [jnp.asarray(rng.standard_normal((b, KV_HEADS, s, HEAD_DIM), np.float32))
            for _ in range(LAYERS)]

  ks, vs = cache(), cache()
  q = jnp.asarray(rng.standard_normal((b, 1, KV_HEADS * GROUP, HEAD_DIM), np.float32))
  q_pos = jnp.full((b, 1), s - 1, jnp.int32)
  k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  scale = HEAD_DIM ** -0.5
  mask = ((k_pos >= 0) & (k_pos <= q_pos))[:, None, None]

  def products(q, k_t, v):
    return reference.one_query_attention(q, k_t, v, q_pos, k_pos, scale=scale, softcap=None,
                                         window=None)

  def keys_length_first(q, k, v):
    return reference.one_query_attention(q, k, v, q_pos, k_pos, scale=scale, softcap=None,
                                         window=None, keys_length_last=False)

  def einsum(q, k, v):
    grouped = q.reshape(b, KV_HEADS, GROUP, HEAD_DIM)
    scores = jnp.where(mask, jnp.einsum("bkgd,bksd->bkgs", grouped, k) * scale, -1e30)
    out = jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(q.shape)

  k_ts = [jnp.swapaxes(k, 2, 3) for k in ks]
  reference_out = jax.jit(keys_length_first)(q, ks[0], vs[0])
  moved = 2 * LAYERS * b * KV_HEADS * s * HEAD_DIM * 4
  print(f"rows {b}, keys {s}: {moved / 1e6:.0f} MB of K and V per 30 layers\n")
  print("| form | ms per 30 layers (median) | min | GB/s | max abs diff |")
  print("| --- | ---: | ---: | ---: | ---: |")
  for name, form, keys in (("products", products, k_ts),
                           ("keys_length_first", keys_length_first, ks), ("einsum", einsum, ks)):
    @jax.jit
    def layers(q, keys, values, form=form):
      out = q
      for k, v in zip(keys, values):
        out = form(out, k, v) * 0.5 + q  # each layer's query depends on the last: no reordering
      return out

    layers(q, keys, vs).block_until_ready()
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      layers(q, keys, vs).block_until_ready()
      times.append(time.perf_counter() - start)
    diff = float(jnp.max(jnp.abs(jax.jit(form)(q, keys[0], vs[0]) - reference_out)))
    print(f"| {name} | {1000 * statistics.median(times):.1f} | {1000 * min(times):.1f} | "
          f"{moved / min(times) / 1e9:.1f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
  main()
