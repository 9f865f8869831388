"""The paged KV cache against the contiguous one: cache memory and decode speed, same tokens.

Usage: python -m benchmarks.paged_kv [--workloads demo,longtail] [--repeats 2] [--page_size 16]
           [--pool_fraction 0.5]

Workloads, SmolLM2-135M-Instruct (GGUF, float32), T=1, its EOS ids stop a completion:
- demo: the CPU demo's step (configs/smollm2_arithmetic.py): 4 held-out arithmetic prompts x 8
  samples, 64 new tokens, 32 slots.
- longtail: the same prompts and slots with 256 new tokens: most completions stop within ~60
  tokens, a few run to the budget (the long-tail mix of benchmarks/partial_rollouts.py).

Variants: contiguous (`Engine`: one row of max_prefill_length + max_new_tokens per slot), paged
with a pool as large as that (`rollout.kv_pages=0`), and paged with `--pool_fraction` of it
(the newest samples are preempted when it runs short, and continued later). Columns: resident
KV = the cache the engine allocates (K and V of every layer + positions), peak in use = the
most pages held at once (what a right-sized pool needs), tok/s = completion tokens / wall
seconds of `generate_groups` (median of the timed runs, after one compiling run), same tokens =
completions equal to the contiguous run's, preempted = samples sent back to the queue.
"""

from __future__ import annotations

import argparse
import statistics
import time


def demo_workload(max_new_tokens: int):
  """(model, prompts, stop ids, engine sizes) of the demo's step with `max_new_tokens`."""
  from configs.smollm2_arithmetic import get_config
  from reasoning_rl.build import build_template
  from reasoning_rl.data import tasks
  from reasoning_rl.models import load

  config = get_config()
  model, tokenizer = load(config.model.path)
  source = tasks.build_source(config.data.eval, field="data.eval")
  template = build_template(config, tokenizer)
  prompts = [template.encode(source.example(i)) for i in range(4)]
  sizes = dict(max_concurrent_decodes=32, max_prefill_length=config.rollout.max_prefill_length,
               max_decode_length=max_new_tokens, steps_per_call=config.rollout.steps_per_call)
  return model, prompts, tuple(tokenizer.eos_ids), sizes


WORKLOADS = {"demo": 64, "longtail": 256}


def kv_bytes(state) -> int:
  import jax
  cache = state.cache
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((cache.k, cache.v, cache.pos)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default="demo,longtail")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--page_size", type=int, default=16)
  parser.add_argument("--pool_fraction", type=float, default=0.5)
  args = parser.parse_args()

  from reasoning_rl.sampler import Engine, SamplingParams
  from reasoning_rl.sampler.paged import PagedEngine
  from reasoning_rl.sampler.rollout import DecodeUsage, stream_groups

  print(f"SmolLM2-135M float32, 8 samples per prompt, T=1; pages of {args.page_size}; medians "
        f"of {args.repeats} timed runs after a compiling one")
  print("| workload | variant | resident KV (MiB) | peak in use (MiB) | tok/s | same tokens | "
        "preempted |")
  print("|---|---|---:|---:|---:|---|---:|")
  for name in args.workloads.split(","):
    model, prompts, stop_ids, sizes = demo_workload(WORKLOADS[name])
    full = PagedEngine(model, page_size=args.page_size, **sizes)
    engines = {"contiguous": Engine(model, **sizes), "paged, full pool": full,
               f"paged, {args.pool_fraction:.0%} pool": PagedEngine(
                   model, page_size=args.page_size,
                   num_pages=int(full.num_pages * args.pool_fraction), **sizes)}
    def run(engine, usage=None):
      start = time.perf_counter()
      outputs = sorted(stream_groups(engine, prompts, num_samples=8,
                                     sampling=SamplingParams(temperature=1.0),
                                     max_new_tokens=WORKLOADS[name], stop_ids=stop_ids, seed=1,
                                     usage=usage),
                       key=lambda c: (c.prompt_id, c.sample_index))
      return time.perf_counter() - start, [c.completion_ids for c in outputs]

    usages = {variant: DecodeUsage() for variant in engines}
    tokens, peaks = {}, {}
    for variant, engine in engines.items():  # compiling runs
      _, tokens[variant] = run(engine, usages[variant])
      peaks[variant] = engine.pages.peak_in_use if isinstance(engine, PagedEngine) else 0
    seconds = {variant: [] for variant in engines}
    for _ in range(args.repeats):  # interleaved, so load on the machine hits every variant
      for variant, engine in engines.items():
        seconds[variant].append(run(engine)[0])
    reference = tokens["contiguous"]
    for variant, engine in engines.items():
      resident = kv_bytes(engine.init_decode_state())
      paged = isinstance(engine, PagedEngine)
      peak = resident * peaks[variant] / engine.num_pages if paged else resident
      rate = sum(map(len, tokens[variant])) / statistics.median(seconds[variant])
      same = sum(a == b for a, b in zip(reference, tokens[variant]))
      print(f"| {name} | {variant} | {resident / 2**20:.1f} | {peak / 2**20:.1f} | {rate:,.0f} | "
            f"{same}/{len(reference)} | {usages[variant].preempted} |", flush=True)

if __name__ == "__main__":
  main()
