"""The training step alone: full fine-tuning vs LoRA on SmolLM2-135M, in one process.

The LoRA demo's step shape (32 rows of 64 prompt + 64 completion tokens, token-mean loss, β = 0,
log-probs in chunks of 64): one compiling step, then the best of `--repeats` timed steps, for
full fine-tuning and for rank-r adapters on each target set given. Why the targets matter on a
CPU: each adapted projection adds four rank-r products that read or write activation-sized arrays.

  python -m benchmarks.lora_step [--rank 16] [--repeats 3]
         [--targets 'layers/\\d+/(attn|mlp)' 'layers/\\d+/attn' 'layers/\\d+/mlp']
"""

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.installed import smollm2_gguf
from benchmarks.train_step import random_batch


def time_step(model, settings, batch, repeats: int) -> tuple[float, float]:
  """(first step incl. compilation, best later step) in seconds."""
  from reasoning_rl.rl.step import TrainStep
  from reasoning_rl.rl.step_config import StepConfig

  graphdef, params = nnx.split(model)
  step = TrainStep(graphdef, StepConfig(lora=settings, learning_rate=1e-5, logprob_chunk=64,
                                        loss_agg="token-mean"))
  state = step.init_state(jax.tree.map(jnp.copy, params))
  start = time.perf_counter()
  state, stats = step(state, batch)
  jax.block_until_ready(stats)
  first = time.perf_counter() - start
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    state, stats = step(state, batch)
    jax.block_until_ready(stats)
    best = min(best, time.perf_counter() - start)
  return first, best


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--targets", nargs="*",
                      default=[r"layers/\d+/(attn|mlp)", r"layers/\d+/attn", r"layers/\d+/mlp"])
  args = parser.parse_args()
  from reasoning_rl import lora
  from reasoning_rl.host_memory import keep_freed_memory
  from reasoning_rl.models import load

  keep_freed_memory()  # as launch/train.py does
  model, _ = load(smollm2_gguf())
  batch = jax.tree.map(jnp.asarray, random_batch(32, 64, 64))
  rows = [("full fine-tuning", *time_step(model, None, batch, args.repeats))]
  for target in args.targets:
    settings = lora.LoraSettings(rank=args.rank, alpha=2.0 * args.rank, target_modules=target)
    rows.append((f"LoRA r={args.rank} on {target}",
                 *time_step(lora.apply_lora(model, settings), settings, batch, args.repeats)))
  print(f"SmolLM2-135M train step, 32 rows x (64 + 64) tokens; best of {args.repeats}")
  print("| trains | s / step | vs full | first step (compile) s |")
  print("|---|---|---|---|")
  for name, first, best in rows:
    print(f"| {name} | {best:.1f} | {best / rows[0][2]:.2f}x | {first:.0f} |")


if __name__ == "__main__":
  main()
