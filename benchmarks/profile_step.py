"""Where a GRPO training step's time goes: XLA:CPU ops of one fused step on SmolLM2-135M.

Runs the step of `benchmarks/train_step.py` (one micro-batch, β > 0 so the reference forward is
included) under `jax.profiler.trace` and prints, from the trace, the time spent per kind of XLA op
and result shape, split into matmuls (YNNPACK / XNNPACK / oneDNN / Eigen dot thunks) and everything
else, with the threads' busy share of the wall time.

Usage: python -m benchmarks.profile_step [--completions 8] [--completion_length 256]
         [--prompt_length 64] [--beta 0.04] [--micro_batches 1] [--system_allocator] [--top 25]
         [--trace_dir /tmp/reasoning_rl_profile]
"""

import argparse
import collections
import glob
import gzip
import json
import re
import shutil
import time

import jax
import jax.numpy as jnp

from benchmarks.train_step import add_step_arguments, build_jax_step, random_batch

_MATMUL = re.compile(r"^(ynn_fusion|xnn_fusion|onednn|dot|custom-call)")
# Events that wrap others (the executor, loops, Python frames) would count their children twice.
_WRAPPERS = re.compile(r"^(\$|ThunkExecutor|while|SlinkyThreadPool|PjitFunction)")


def result_shapes(hlo_text: str) -> dict[str, str]:
  """Instruction name -> result shape, from the optimised HLO."""
  return {m.group(1): m.group(2) for m in
          re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) [a-z\-]+\(", hlo_text, re.M)}


def main():
  parser = argparse.ArgumentParser()
  add_step_arguments(parser, completions=8, micro_batches=1)
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--trace_dir", default="/tmp/reasoning_rl_profile")
  args = parser.parse_args()

  b, p, t = args.completions, args.prompt_length, args.completion_length
  _, step, state = build_jax_step(args)
  batch = jax.tree.map(jnp.asarray, random_batch(b, p, t))
  shapes = result_shapes(step.compile(state, batch).lower(state, batch).compile().as_text())
  state, stats = step(state, batch)  # compile + warm-up
  jax.block_until_ready(stats)
  shutil.rmtree(args.trace_dir, ignore_errors=True)
  start = time.perf_counter()
  with jax.profiler.trace(args.trace_dir):
    state, stats = step(state, batch)
    jax.block_until_ready(stats)
  wall = time.perf_counter() - start

  trace_file = glob.glob(f"{args.trace_dir}/**/*.trace.json.gz", recursive=True)[0]
  events = [e for e in json.load(gzip.open(trace_file))["traceEvents"]
            if e.get("ph") == "X" and not _WRAPPERS.match(e["name"])]
  by_kind = collections.Counter()
  count = collections.Counter()
  totals = collections.Counter()
  for e in events:
    kind = re.sub(r"\.\d+$", "", e["name"])
    key = (kind, shapes.get(e["name"], "?"))
    by_kind[key] += e["dur"] / 1e6
    count[key] += 1
    totals["matmul" if _MATMUL.match(kind) else "other"] += e["dur"] / 1e6
  busy = sum(totals.values())
  print(f"one step, {b} completions x {t} tokens after {p}-token prompts, beta={args.beta}: "
        f"{wall:.1f} s wall (profiled); ops busy {busy:.1f} thread-s on {jax.local_devices()[0]} "
        f"= {busy / wall:.2f} threads busy on average")
  print(f"matmul thunks {totals['matmul']:.1f} thread-s, other ops {totals['other']:.1f} thread-s")
  print("| op kind | result shape | count | thread-s | share of busy |")
  print("|---|---|---:|---:|---:|")
  for (kind, shape), seconds in by_kind.most_common(args.top):
    print(f"| {kind} | {shape.split('{')[0]} | {count[(kind, shape)]} | {seconds:.2f} | "
          f"{seconds / busy:.0%} |")


if __name__ == "__main__":
  main()
