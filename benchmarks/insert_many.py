"""Placing a rollout's slots: one `Engine.insert` per slot vs `Engine.insert_many` (one call per
cache bucket), on SmolLM2's shape with random weights.

Usage: python -m benchmarks.insert_many [--rows 32,64] [--dtypes float32,bfloat16] [--samples 8]
           [--prompt_length 64] [--max_decode_length 128] [--repeats 4]

For each row count and dtype: rows / samples prompts are prefilled once (8 per call), and each
prompt's prefix is placed in `samples` slots with its own request (as a GRPO rollout fills its
slots), into a fresh decode state, both ways; each slot's cache holds prompt_length +
max_decode_length entries (the CPU demo's: 64-token prompts at most, 128 new tokens). The table
gives the median of the repeats after the first, and the first call's time (it traces and compiles
the program; each side runs in a fresh engine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from benchmarks.prefill import load_model
from reasoning_rl.sampler import Engine, SamplingParams, sample_key


def placed_prefixes(engine: Engine, prompts: np.ndarray, samples: int) -> list:
  prepared = [engine.prepare_prompt(prompt) for prompt in prompts]
  prefixes = engine.prefill_many(
      params=engine.params, padded_tokens=[padded for padded, _ in prepared],
      true_lengths=[length for _, length in prepared],
      requests=[engine.make_request(key=sample_key(0, p, 0), sampling=SamplingParams(),
                                    max_new_tokens=1) for p in range(len(prompts))])
  return [prefixes[p].with_request(engine.make_request(
              key=sample_key(0, p, g), sampling=SamplingParams(), max_new_tokens=1))
          for p in range(len(prompts)) for g in range(samples)]


def seconds(engine: Engine, placed: list, batched: bool) -> float:
  state = engine.init_decode_state()
  jax.block_until_ready(state)
  start = time.perf_counter()
  if batched:
    state = engine.insert_many(placed, state, range(len(placed)))
  else:
    for slot, prefix in enumerate(placed):
      state = engine.insert(prefix, state, slot)
  jax.block_until_ready(state)
  return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="32,64")
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--samples", type=int, default=8)
  parser.add_argument("--prompt_length", type=int, default=64)
  parser.add_argument("--max_decode_length", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=4)
  args = parser.parse_args()
  print(f"smollm2_shape on {jax.devices()[0].platform}; {args.prompt_length}-token prompts, "
        f"{args.samples} slots per prompt, caches of {args.prompt_length} + "
        f"{args.max_decode_length} entries")
  print("| cache | slots | insert per slot, ms | insert_many, ms | per row: before → after, ms "
        "| speed-up | first call: insert per slot, insert_many, s |")
  print("| --- | ---: | ---: | ---: | --- | ---: | --- |")
  for dtype in args.dtypes.split(","):
    model = load_model("smollm2_shape", dtype)
    for rows in (int(r) for r in args.rows.split(",")):
      prompts = np.random.RandomState(rows).randint(
          0, model.config.vocab_size, (rows // args.samples, args.prompt_length))
      calls = {}
      for batched in (False, True):  # a fresh engine each, so each side compiles its programs
        engine = Engine(model, max_concurrent_decodes=rows,
                        max_prefill_length=args.prompt_length,
                        max_decode_length=args.max_decode_length, steps_per_call=4)
        placed = placed_prefixes(engine, prompts, args.samples)
        calls[batched] = [seconds(engine, placed, batched) for _ in range(args.repeats)]
      single, batched = (statistics.median(calls[side][1:]) for side in (False, True))
      print(f"| {dtype} | {rows} | {1e3 * single:.0f} | {1e3 * batched:.0f} | "
            f"{1e3 * single / rows:.2f} → {1e3 * batched / rows:.2f} | {single / batched:.1f}× | "
            f"{calls[False][0]:.1f}, {calls[True][0]:.1f} |", flush=True)


if __name__ == "__main__":
  main()
