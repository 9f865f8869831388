"""Full fine-tuning vs LoRA on the CPU demo, in one run: seconds per step split into sampling,
training and weight sync, bytes per sync, peak host memory, and held-out accuracy before → after.

Each side is `launch/train.py` as a user runs it, one after the other on the same machine:
configs/smollm2_arithmetic.py (full) and configs/smollm2_arithmetic_lora.py (rank-16 LoRA on every
projection; the same task, batch, evaluation and seed). Per-step times are the medians of the metrics rows' `time/*`
over the steps after the first (which compiles); peak host memory is the process's maximum resident
set (`wait4`'s ru_maxrss), model load and evaluations included.

  python -m benchmarks.lora_vs_full [--steps 40] [--workdir /tmp/lora_vs_full] [--only lora]
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

from reasoning_rl.metrics import read_metrics

REPO = pathlib.Path(__file__).resolve().parent.parent
SIDES = {"lora": "configs/smollm2_arithmetic_lora.py", "full": "configs/smollm2_arithmetic.py"}


def run_side(config: str, workdir: pathlib.Path, steps: int) -> dict:
  """Runs one training command; returns its wall time, peak RSS and exit code."""
  if workdir.exists():
    shutil.rmtree(workdir)
  command = [sys.executable, str(REPO / "launch" / "train.py"), f"--config={config}",
             f"--config.workdir={workdir}", f"--config.total_steps={steps}",
             "--config.logging.progress_bar=False"]
  start = time.perf_counter()
  process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
  _, status, usage = os.wait4(process.pid, 0)
  wall = time.perf_counter() - start
  stderr = process.stderr.read()
  code = os.waitstatus_to_exitcode(status)
  if code != 0:
    raise SystemExit(f"{config} exited {code}:\n{stderr[-3000:]}")
  return {"wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20}


def summarize(workdir: pathlib.Path, run: dict) -> dict:
  rows = read_metrics(workdir / "metrics.jsonl")[1:]  # step 1 compiles
  # medians: a step slowed by another process on the machine moves a mean, not a median
  median = lambda key: statistics.median(r[key] for r in rows)
  evals = sorted((workdir / "eval").glob("step_*.json"))
  first, last = (json.loads(p.read_text()) for p in (evals[0], evals[-1]))
  return {**run, "sample_s": median("time/sample_s"), "verify_s": median("time/verify_s"),
          "train_s": median("time/train_s"), "sync_s": median("time/sync_s"),
          "step_s": median("time/step_s"), "sync_mib": median("sync/bytes") / 2**20,
          "heldout_before": first["accuracy"], "heldout_after": last["accuracy"],
          "steps": last["step"]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--workdir", default="/tmp/lora_vs_full")
  parser.add_argument("--only", choices=sorted(SIDES), default=None)
  args = parser.parse_args()
  results = {}
  for side, config in SIDES.items():
    if args.only and side != args.only:
      continue
    workdir = pathlib.Path(args.workdir) / side
    print(f"running {side}: {config} ...", flush=True)
    results[side] = summarize(workdir, run_side(config, workdir, args.steps))
  print(f"\n| | {' | '.join(results)} |\n|---|{'---|' * len(results)}")
  rows = [("seconds per step (median of steps 2..N)", "step_s", "{:.1f}"),
          ("  sampling", "sample_s", "{:.1f}"), ("  scoring", "verify_s", "{:.2f}"),
          ("  training", "train_s", "{:.1f}"), ("  weight sync", "sync_s", "{:.3f}"),
          ("MiB sent per sync", "sync_mib", "{:.1f}"),
          ("peak host memory (GiB)", "peak_rss_gib", "{:.2f}"),
          ("wall time of the command (s)", "wall_s", "{:.0f}"),
          ("held-out accuracy before", "heldout_before", "{:.0%}"),
          ("held-out accuracy after", "heldout_after", "{:.0%}")]
  for label, key, fmt in rows:
    print(f"| {label} | {' | '.join(fmt.format(r[key]) for r in results.values())} |")


if __name__ == "__main__":
  main()
