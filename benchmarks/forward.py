"""Forward throughput on SmolLM2-135M: reasoning_rl (JAX, jit) beside transformers (torch CPU).

Usage: python benchmarks/forward.py [--batch 16] [--length 256] [--repeats 3]
Prints one table row per implementation: tokens/s, seconds per forward, achieved GFLOP/s
(FLOPs of `reasoning_rl.flops`).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.installed import smollm2_gguf
from reasoning_rl.flops import forward_flops


def time_it(fn, repeats):
  fn()  # warm-up / compile
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  from reasoning_rl.models import load

  path = smollm2_gguf()
  model, _ = load(path)
  ids = np.random.RandomState(0).randint(0, model.config.vocab_size, (args.batch, args.length))
  # Every position projected to the vocabulary, every query scored against the row's keys.
  flops = forward_flops(model.config, args.batch * args.length, args.length)
  tokens = args.batch * args.length
  rows = []

  forward = jax.jit(lambda m, x: m(x))
  jax_ids = jnp.asarray(ids)
  seconds = time_it(lambda: forward(model, jax_ids).block_until_ready(), args.repeats)
  rows.append(("reasoning_rl (jax.jit, f32)", seconds))

  import torch
  import transformers

  torch_model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
  torch_ids = torch.tensor(ids)

  def torch_forward():
    with torch.inference_mode():
      torch_model(torch_ids)

  seconds = time_it(torch_forward, args.repeats)
  rows.append((f"transformers {transformers.__version__} (torch {torch.__version__}, f32)",
               seconds))

  print(f"SmolLM2-135M forward, batch {args.batch} x {args.length} tokens, "
        f"{flops / 1e9:.1f} GFLOP per forward, best of {args.repeats}")
  print("| implementation | s / forward | tokens/s | GFLOP/s |")
  print("|---|---|---|---|")
  for name, seconds in rows:
    print(f"| {name} | {seconds:.3f} | {tokens / seconds:,.0f} | {flops / seconds / 1e9:.0f} |")
  print(f"speed-up: {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
  main()
