"""A stand-in for launch/train.py in the launcher tests: the exit codes, signals, resume and
metrics of a run without JAX, so that a launcher's logic (restarts, reconnects, locks, pinning)
runs in seconds. The real trainer's side of the same contracts is tested with configs/debug_cpu.

  python launch/train.py --config=C --config.workdir=W [--config.total_steps=N]

Steps take $FAKE_TRAINER_STEP_S seconds (default 0.2). Process 0 of the run (TPU_WORKER_ID and
MEGASCALE_SLICE_ID as a TPU host has them) appends {"step": s} to W/metrics.jsonl after each
step; every process appends "pid step" to W/starts-pN at its start. SIGTERM / SIGINT: the step
under way ends, process 0 writes the step to W/fake_checkpoint, exit 128 + the signal. A start
resumes from W/fake_checkpoint. W/crash_at_step holding S: every process exits 1 while training
step S; W/crash_once_at_step: the same, once per process. $FAKE_TRAINER_EXIT: exit with that code
at once.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import time


def process_index(environ) -> int:
  hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h] or ["localhost"]
  return int(environ.get("MEGASCALE_SLICE_ID") or 0) * len(hosts) + int(
      environ.get("TPU_WORKER_ID") or 0)


def main(argv: list[str]) -> int:
  options = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
  if "FAKE_TRAINER_EXIT" in os.environ:
    return int(os.environ["FAKE_TRAINER_EXIT"])
  workdir = pathlib.Path(options["config.workdir"])
  total = int(options.get("config.total_steps", 10))
  step_s = float(os.environ.get("FAKE_TRAINER_STEP_S", "0.2"))
  process = process_index(os.environ)
  stops: list[int] = []
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda signum, frame: stops.append(signum))
  workdir.mkdir(parents=True, exist_ok=True)
  checkpoint = workdir / "fake_checkpoint"
  step = int(checkpoint.read_text()) if checkpoint.exists() else 0
  with open(workdir / f"starts-p{process}", "a") as starts:
    starts.write(f"{os.getpid()} {step}\n")
  crash_file, once_file = workdir / "crash_at_step", workdir / "crash_once_at_step"
  crashed_once = workdir / f"crashed-p{process}"
  while step < total and not stops:
    time.sleep(step_s)
    once = once_file.exists() and not crashed_once.exists()
    for path in [crash_file] + ([once_file] if once else []):
      if path.exists() and int(path.read_text()) == step + 1:
        crashed_once.touch()
        print(f"fake trainer: crashed in step {step + 1}", flush=True)
        return 1
    step += 1
    if process == 0:
      with open(workdir / "metrics.jsonl", "a") as metrics:
        metrics.write(json.dumps({"step": step}) + "\n")
    print(f"fake trainer: step {step}", flush=True)
  if process == 0:
    checkpoint.write_text(str(step))
  return 128 + stops[0] if stops else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
