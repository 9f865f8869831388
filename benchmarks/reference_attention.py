"""The XLA reference attention on a CPU, dense [T, T] scores against causal query blocks.

Usage: python -m benchmarks.reference_attention [--shapes 8x128,4x192,2x384,1x768] [--repeats 3]

For each rows × length: forward + backward (the gradient of Σ out², q, k and v) through 30 layers
of SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64; a scan over the layers, as the
model runs), each row two packed sequences; seconds per pass (best of `repeats` after compiling)
for `reference.attention` (every score of the row) and `reference.causal_attention` (what the
training step runs: each block of queries against the keys up to its end).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.forward import time_it
from reasoning_rl.kernels import reference

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def _pass(attention, rows: int, length: int):
  """(jitted gradient function, its arguments) for `attention` over LAYERS layers."""
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (LAYERS, rows, length, HEADS, HEAD_DIM))
  k, v = (jax.random.normal(key, (LAYERS, rows, length, KV_HEADS, HEAD_DIM)) for key in keys[1:])
  first = length * 5 // 8  # two packed sequences per row, of 5/8 and 3/8 of its length
  index = jnp.arange(length)
  positions = jnp.broadcast_to(jnp.where(index < first, index, index - first), (rows, length))
  segment_ids = jnp.broadcast_to(jnp.where(index < first, 1, 2), (rows, length))

  def loss(q, k, v):
    def layer(total, qkv):
      out = attention(*qkv, positions, positions, scale=HEAD_DIM ** -0.5, softcap=None,
                      window=None, segment_ids=segment_ids)
      return total + jnp.sum(out * out), None
    return jax.lax.scan(layer, 0.0, (q, k, v))[0]

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shapes", default="8x128,4x192,2x384,1x768",
                      help="rows x length, comma-separated")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  print(f"{LAYERS} layers of {HEADS} heads / {KV_HEADS} KV heads / head_dim {HEAD_DIM}, forward + "
        f"backward, jax {jax.__version__}, best of {args.repeats}")
  print("| rows × length | query blocks | dense s | causal blocks s | ratio |")
  print("|---|---:|---:|---:|---:|")
  for shape in args.shapes.split(","):
    rows, length = (int(x) for x in shape.split("x"))
    seconds = []
    for attention in (reference.attention, reference.causal_attention):
      fn, arrays = _pass(attention, rows, length)
      seconds.append(time_it(lambda: jax.block_until_ready(fn(*arrays)), args.repeats))
    print(f"| {rows} × {length} | {len(reference.causal_blocks(length))} | {seconds[0]:.3f} | "
          f"{seconds[1]:.3f} | {seconds[1] / seconds[0]:.2f} |", flush=True)


if __name__ == "__main__":
  main()
