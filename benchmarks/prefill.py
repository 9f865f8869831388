"""Prompt by prompt vs batched prefill: what the prefills of a B-row greedy run cost, and their
share of the run.

Usage: python -m benchmarks.prefill [--model smollm2|smollm2_shape|small] [--rows 64,256]
           [--prefill_batches one,8,64,256] [--prompt_length 64] [--new_tokens 64]
           [--steps_per_call 32] [--repeats 2]

For each B in --rows: B prompts of `prompt_length` random tokens decode exactly `new_tokens`
greedy tokens each in B slots (`benchmarks.sampler.run_ours`), the prompts prefilled either one
call per prompt (`one`: `Engine.prefill`, the JetStream call) or k per call (`Engine.prefill_many`
with `max_prefill_batch = k`; rollouts use 8). Prefill seconds = end to end − decode (the inserts
included), the fastest of `repeats` runs after a compiling one. `smollm2` loads the installed
GGUF; `smollm2_shape` is that shape with random weights (for an accelerator, where the GGUF is
not installed); `small` a tiny shape that checks the script on a CPU; `--dtype` sets both random models' dtypes.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.accelerator import SMALL_SHAPE, SMOLLM2_SHAPE
from benchmarks.sampler import run_ours


def load_model(name: str, dtype: str):
  if name == "smollm2":
    from benchmarks.installed import smollm2_gguf
    from reasoning_rl.models import load

    model, _ = load(smollm2_gguf())
    return model
  from reasoning_rl.models.config import ModelConfig
  from reasoning_rl.models.transformer import create_model

  shapes = {"smollm2_shape": SMOLLM2_SHAPE, "small": SMALL_SHAPE}
  if name not in shapes:
    raise SystemExit(f"--model: unknown {name!r}; use smollm2, smollm2_shape or small")
  kind = jnp.dtype(dtype)
  config = ModelConfig(model_type="llama", tie_word_embeddings=True, **shapes[name])
  return create_model(config, dtype=kind, param_dtype=kind)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="smollm2")
  parser.add_argument("--rows", default="64,256")
  parser.add_argument("--prefill_batches", default="one,8,64,256")
  parser.add_argument("--prompt_length", type=int, default=64)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--steps_per_call", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--dtype", default="float32",
                      help="random-weight models' compute and weight dtype (bfloat16 on a GPU)")
  args = parser.parse_args()
  model = load_model(args.model, args.dtype)
  print(f"{args.model} on {jax.devices()[0].platform}; prompts {args.prompt_length} tokens, "
        f"{args.new_tokens} new tokens, greedy")
  print("| rows | prefill | prefill s | decode s | end to end s | prefill share | "
        "end-to-end tok/s |")
  print("|---:|---|---:|---:|---:|---:|---:|")
  for rows in (int(r) for r in args.rows.split(",")):
    prompts = np.random.RandomState(rows).randint(
        0, model.config.vocab_size, (rows, args.prompt_length)).astype(np.int32)
    for choice in args.prefill_batches.split(","):
      batch = None if choice == "one" else int(choice)
      if batch is not None and batch > rows:
        continue
      runs = [run_ours(model, prompts, args.new_tokens, args.steps_per_call,
                       prefill_batch=batch) for _ in range(args.repeats)]
      decode_s, total_s = min(runs, key=lambda run: run[1])
      prefill_s = total_s - decode_s
      label = "one per call" if batch is None else f"{batch} per call"
      print(f"| {rows} | {label} | {prefill_s:.2f} | {decode_s:.2f} | {total_s:.2f} | "
            f"{100 * prefill_s / total_s:.0f} % | {rows * args.new_tokens / total_s:,.0f} |",
            flush=True)


if __name__ == "__main__":
  main()
