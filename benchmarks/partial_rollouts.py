"""Partial rollouts on a long-tail length mix: step time and idle decode slots, with and without.

Both runs are `launch/train.py` on the same config (default: configs/smollm2_arithmetic.py, the CPU
demo, whose untrained samples at a 256-token budget run ~90 tokens on average and 6–9 % to the
budget), one after the other in this invocation, with a longer budget so the tail is long: most
completions end early and a few run to `--max_new_tokens`. "Without" is the synchronous loop (each step waits
for its longest completion); "with" is `partial_rollouts.enabled=True` at its defaults (twice
the prompts in flight, max_lag 2). Same slots, same prompts per step, same seed; held-out
evaluation is cut to one example (it is not what is measured).

From each run's metrics rows, steps 2..N (step 1 compiles most programs), means per step:
`time/step_s` and the part of it compiling (`time/compile_s`: a partial run also compiles an
append program per token bucket the first time it continues samples), sampling
(`time/sample_s`), training (`time/train_s`), the share of decode slot-steps with no sample
(`throughput/decode_idle_slot_frac`), completion tokens trained per step, and trained completion
tokens per second of step time net of compiling. With partial rollouts also the trained tokens'
lag behind the weights training on them.

Usage: python -m benchmarks.partial_rollouts [--steps 6] [--max_new_tokens 256]
         [--config configs/smollm2_arithmetic.py] [--modes off,on] [--extra OVERRIDE ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def run(mode: str, workdir: pathlib.Path, args) -> tuple[list[dict], float]:
  command = [sys.executable, str(REPO / "launch" / "train.py"), f"--config={args.config}",
             f"--config.workdir={workdir}", f"--config.total_steps={args.steps}",
             f"--config.rollout.max_new_tokens={args.max_new_tokens}",
             "--config.eval.num_examples=1", "--config.eval.instruction_variants=()",
             "--config.checkpoint.every_steps=1000", "--config.logging.progress_bar=False",
             f"--config.partial_rollouts.enabled={mode == 'on'}", *args.extra]
  start = time.perf_counter()
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
  wall = time.perf_counter() - start
  if result.returncode != 0:
    raise SystemExit(f"{mode}: train.py exited {result.returncode}\n{result.stderr[-4000:]}")
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return rows, wall


def summarize(rows: list[dict], num_samples: int, num_prompts: int) -> dict:
  measured = rows[1:]

  def mean(key):
    values = [r[key] for r in measured if key in r]
    return statistics.fmean(values) if values else float("nan")

  trained = [r["response_length/mean"] * num_samples * num_prompts for r in measured]
  net = [r["time/step_s"] - r["time/compile_s"] for r in measured]
  return {
      "step_s": mean("time/step_s"), "compile_s": mean("time/compile_s"),
      "sample_s": mean("time/sample_s"), "train_s": mean("time/train_s"),
      "idle": mean("throughput/decode_idle_slot_frac"),
      "trained_tokens": statistics.fmean(trained),
      "tokens_per_s": sum(trained) / sum(net),
      "truncated": mean("response_length/truncated_frac"),
      "lag_mean": mean("rollout/partial/token_lag_mean"),
      "lag_max": max((r.get("rollout/partial/token_lag_max", 0) for r in measured), default=0),
      "per_step": [round(r["time/step_s"], 1) for r in rows],
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/smollm2_arithmetic.py")
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--max_new_tokens", type=int, default=256)
  parser.add_argument("--modes", default="off,on")
  parser.add_argument("--prompts", type=int, default=4, help="must match the config's")
  parser.add_argument("--samples", type=int, default=8, help="must match the config's")
  parser.add_argument("--extra", nargs="*", default=[], help="more --config.x=y overrides")
  args = parser.parse_args()
  results = {}
  with tempfile.TemporaryDirectory() as scratch:
    for mode in args.modes.split(","):
      rows, wall = run(mode, pathlib.Path(scratch) / mode, args)
      results[mode] = {**summarize(rows, args.samples, args.prompts), "wall_s": wall}
      print(f"{mode}: {json.dumps(results[mode])}", flush=True)
  print()
  print("| partial rollouts | s / step | compiling | sampling | training | idle decode slots "
        "| trained completion tokens / step | at budget | trained tokens / s (net of compiling) "
        "| token lag mean / max | run wall s |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
  for mode, r in results.items():
    lag = f"{r['lag_mean']:.2f} / {r['lag_max']}" if mode == "on" else "0 / 0"
    print(f"| {mode} | {r['step_s']:.1f} | {r['compile_s']:.1f} | {r['sample_s']:.1f} | "
          f"{r['train_s']:.1f} | {r['idle']:.0%} | {r['trained_tokens']:.0f} | "
          f"{r['truncated']:.0%} | {r['tokens_per_s']:.1f} | {lag} | {r['wall_s']:.0f} |")
  for mode, r in results.items():
    print(f"{mode} per step (s): {r['per_step']}")


if __name__ == "__main__":
  main()
