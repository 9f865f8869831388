"""How the sampler should see a LoRA policy: adapters applied in decode, or weights merged?

For SmolLM2-135M-Instruct with the LoRA demo's adapters (rank 16 on every layer's attention, B
made non-zero as after training), two engines run the same group rollouts (the rollouts
benchmark's chat questions, G samples at temperature 1, EOS stops):

- adapters: the engine's model carries the adapters; a sync sends the adapters alone and the
  engine keeps its copy of the base;
- merged: the engine's model is plain; a sync computes W + α/r · A B on the trainer (jitted) and
  sends every weight.

Per sync: bytes sent and seconds (merge included, until the engine holds the weights); per rollout:
completion tokens/s (medians of interleaved runs after one compiling run each). Greedy outputs of
the two are compared as a check (they differ only by float rounding of the merge).

  python -m benchmarks.lora_sampler [--rank 16] [--targets 'layers/\\d+/attn'] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.rollouts import run_once, smollm2_workload


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--targets", default=r"layers/\d+/attn")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--num_prompts", type=int, default=4)
  parser.add_argument("--num_samples", type=int, default=8)
  parser.add_argument("--max_new_tokens", type=int, default=64)
  parser.add_argument("--slots", type=int, default=32)
  parser.add_argument("--steps_per_call", type=int, default=16)
  args = parser.parse_args()

  from reasoning_rl import lora
  from reasoning_rl.sampler import Engine, SamplingParams, generate_groups
  from reasoning_rl.sampler.engine import prefill_bucket

  base, prompts, stop_ids = smollm2_workload(args.num_prompts)
  settings = lora.LoraSettings(rank=args.rank, alpha=2.0 * args.rank,
                               target_modules=args.targets)
  model = lora.apply_lora(base, settings)
  adapters = nnx.state(model, nnx.LoRAParam)
  keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(adapters))))
  adapters = jax.tree.map(lambda a: 0.01 * jax.random.normal(next(keys), a.shape, a.dtype),
                          adapters)
  nnx.update(model, adapters)
  _, frozen = lora.split_adapters(nnx.state(model))
  merge = jax.jit(lambda a, b: lora.merge_into_base(a, b, settings))

  sizes = dict(max_concurrent_decodes=args.slots, max_decode_length=args.max_new_tokens,
               max_prefill_length=prefill_bucket(max(map(len, prompts)), 1 << 30),
               steps_per_call=args.steps_per_call)
  engines = {"adapters": Engine(model, **sizes), "merged": Engine(lora.merged_model(model), **sizes)}
  send = {"adapters": lambda: adapters, "merged": lambda: merge(adapters, frozen)}

  sync_s = {name: [] for name in engines}
  sync_bytes = {}
  for _ in range(args.repeats + 1):
    for name, engine in engines.items():
      start = time.perf_counter()
      weights = send[name]()
      jax.block_until_ready(engine.update_params(weights, adapters_only=name == "adapters"))
      sync_s[name].append(time.perf_counter() - start)
      sync_bytes[name] = lora.num_bytes(weights)

  seconds = {name: [] for name in engines}
  tokens = {}
  first = {}
  for name, engine in engines.items():  # compiles every shape the runs meet
    first[name], completions = run_once(engine, generate_groups, prompts, args, stop_ids)
    tokens[name] = sum(len(c.completion_ids) for c in completions)
  for _ in range(args.repeats):
    for name, engine in engines.items():
      elapsed, completions = run_once(engine, generate_groups, prompts, args, stop_ids)
      seconds[name].append(elapsed)
      tokens[name] = sum(len(c.completion_ids) for c in completions)
  greedy = {name: [c.completion_ids for c in generate_groups(
      engine, prompts, num_samples=1, sampling=SamplingParams(temperature=0.0),
      max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, seed=1)]
      for name, engine in engines.items()}
  same = sum(a == b for a, b in zip(greedy["adapters"], greedy["merged"], strict=True))

  print(f"SmolLM2-135M, LoRA rank {args.rank} on {args.targets!r}; {args.num_prompts} prompts x "
        f"{args.num_samples} samples, T=1, max_new_tokens={args.max_new_tokens}, {args.slots} "
        f"slots; medians of {args.repeats} (syncs: after one warm-up)")
  print("| sampler gets | MiB per sync | sync s | rollout tok/s | first rollout (s) |")
  print("|---|---|---|---|---|")
  for name in engines:
    rate = tokens[name] / statistics.median(seconds[name])
    print(f"| {name} | {sync_bytes[name] / 2**20:.1f} | {statistics.median(sync_s[name][1:]):.3f}"
          f" | {rate:.0f} | {first[name]:.1f} |")
  print(f"greedy completions identical: {same} of {len(prompts)}")
  np.testing.assert_equal(len(greedy["adapters"]), len(prompts))


if __name__ == "__main__":
  main()
