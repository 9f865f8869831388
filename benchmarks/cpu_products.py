"""One projection's forward + backward on a CPU: float32, bfloat16 through autodiff of the einsum,
and bfloat16 through `reasoning_rl.models.cpu_products` (every product a plain bfloat16 dot).

Usage: python -m benchmarks.cpu_products [--rows 4096] [--repeats 8]
       python -m benchmarks.isa_cap benchmarks.cpu_products   (the same, capped at AVX2)

Shapes are SmolLM2-135M's: q / gate / up ([576] → [576] / [1536]), down ([1536] → [576]), a
KV projection ([576] → [192]) and a quarter of the vocabulary head ([576] → [12288]). Each cell is
the best of `--repeats` calls of a jitted gradient of sum(tanh(x · W)) with respect to x and W
(three products: 6·M·K·N FLOPs), in GFLOP/s.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import time_it
from reasoning_rl.models import cpu_products

SHAPES = ((576, 576), (576, 1536), (1536, 576), (576, 192), (576, 12288))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=4096)
  parser.add_argument("--repeats", type=int, default=8)
  args = parser.parse_args()
  flags = " or ".join(cpu_products.BFLOAT16_PRODUCT_FLAGS)
  print(f"bfloat16 products listed by this CPU ({flags}): "
        f"{cpu_products.has_bfloat16_products()}; {args.rows} rows; fwd + bwd GFLOP/s")
  print("| K → N | float32 | bfloat16, autodiff of the einsum | bfloat16, cpu_products |")
  print("|---|---:|---:|---:|")
  rng = np.random.default_rng(0)
  variants = (
      (jnp.float32, lambda x, w: jnp.dot(x, w)),
      (jnp.bfloat16, lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)),
      (jnp.bfloat16, lambda x, w: cpu_products.matmul(x, w, jnp.float32)),
  )
  for fan_in, fan_out in SHAPES:
    cells = []
    for dtype, product in variants:
      x = jnp.asarray(rng.standard_normal((args.rows, fan_in)), dtype)
      w = jnp.asarray(rng.standard_normal((fan_in, fan_out)) * 0.05, dtype)
      grad = jax.jit(jax.grad(lambda a, b, f=product: jnp.sum(jnp.tanh(f(a, b))), argnums=(0, 1)))
      seconds = time_it(lambda g=grad, a=x, b=w: jax.block_until_ready(g(a, b)), args.repeats)
      cells.append(6 * args.rows * fan_in * fan_out / seconds / 1e9)
    print(f"| {fan_in} → {fan_out} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")


if __name__ == "__main__":
  main()
