"""What a stop costs: the checkpoint SIGTERM asks for, for the debug and the demo model sizes.

Usage: python -m benchmarks.stop_save [--configs debug_cpu smollm2_arithmetic] [--runs debug_cpu]

1. The save alone. Each config's train state, as the trainer checkpoints it (parameters,
   optimizer state, counters; no frozen reference), is saved with the trainer's `Checkpointer`
   (asynchronous, as `checkpoint.async_save` defaults) and closed: to a local directory and to
   gs:// on a fake-gcs-server emulator on this machine. Reported: this process's bytes, seconds
   until `save` returns (the copy to host memory: the step could go on from here) and until
   `close` returns (committed by Orbax, CHECKSUMS.json written: what a stop waits for). The
   second of two saves is reported (the first pays Orbax's and tensorstore's start-up).
2. Whole runs (`--runs`): launch/train.py on each config named, local and gs://, sent SIGTERM
   right after a metrics row is written; seconds from the signal to the "checkpoint of step N
   saved" line and to the exit (143), with checkpoint.stop_deadline_s raised so the orderly path
   is timed. A signal in mid-step adds the rest of the step (time/step_s).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def _train_state(name: str, workdir: str):
  """(tree the trainer saves, its bytes) of configs/NAME.py."""
  import importlib

  from reasoning_rl import checkpointing
  from reasoning_rl.build import build

  config = importlib.import_module(f"configs.{name}").get_config()
  config.workdir = workdir
  run = build(config)
  run.scorer.close()
  if run.backend is not None:
    run.backend.stop()
  tree = run.state.replace(ref_params=None, frozen_params=None)
  return tree, checkpointing._local_bytes(tree)  # pylint: disable=protected-access


def _save_seconds(tree, where: str) -> tuple[float, float]:
  from reasoning_rl import checkpointing

  with checkpointing.Checkpointer(where, keep=2) as ckpt:
    ckpt.save(1, tree, {}, force=True)
    ckpt.wait()
    start = time.perf_counter()
    ckpt.save(2, tree, {}, force=True)
    returned = time.perf_counter() - start
    ckpt.wait()
    return returned, time.perf_counter() - start


def _sigterm_run(name: str, workdir: str, env: dict) -> tuple[float, float, int]:
  """(seconds to the saved line, seconds to the exit, exit code) of a run sent SIGTERM right
  after its first metrics row."""
  command = [sys.executable, str(REPO / "launch" / "train.py"), f"--config=configs/{name}.py",
             f"--config.workdir={workdir}", "--config.total_steps=1000",
             "--config.checkpoint.every_steps=1000", "--config.checkpoint.stop_deadline_s=1200",
             "--config.logging.progress_bar=False", "--config.eval.num_examples=1"]
  process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  lines: list[tuple[float, str]] = []
  threading.Thread(target=lambda: [lines.append((time.monotonic(), line))
                                   for line in process.stdout], daemon=True).start()
  rows = f"{workdir}/metrics.jsonl"
  from reasoning_rl import storage

  while process.poll() is None:
    path = storage.path(rows)
    if path.exists() and path.read_text().count("\n") >= 1:
      break
    time.sleep(0.05)
  signalled = time.monotonic()
  process.send_signal(signal.SIGTERM)
  code = process.wait(timeout=1800)
  ended = time.monotonic()
  time.sleep(0.5)
  saved = next((t for t, line in lines if "saved" in line and "checkpoint of step" in line), ended)
  return saved - signalled, ended - signalled, code


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--configs", nargs="+", default=["debug_cpu", "smollm2_arithmetic"])
  parser.add_argument("--runs", nargs="*", default=[])
  args = parser.parse_args()
  sys.path.insert(0, str(REPO))
  from tests import gcs_emulator

  with tempfile.TemporaryDirectory() as scratch:
    server = gcs_emulator.start(scratch)
    server.create_bucket("bench")
    os.environ["STORAGE_EMULATOR_HOST"] = server.url
    try:
      print("save alone: MiB of this process, seconds until save returns / until committed")
      for name in args.configs:
        tree, nbytes = _train_state(name, os.path.join(scratch, f"build-{name}"))
        for where in (os.path.join(scratch, f"ckpt-{name}"), f"gs://bench/ckpt-{name}"):
          returned, committed = _save_seconds(tree, where)
          kind = "gs:// (emulator)" if where.startswith("gs://") else "local"
          print(f"  {name:22s} {kind:17s} {nbytes / 2**20:8.1f} MiB  "
                f"{returned:6.2f} s  {committed:6.2f} s", flush=True)
      if args.runs:
        print("whole runs, SIGTERM after the first metrics row: seconds to 'saved' / to exit")
      env = {**os.environ, "REASONING_RL_CACHE": os.path.join(scratch, "cache")}
      for name in args.runs:
        for workdir in (os.path.join(scratch, f"run-{name}"), f"gs://bench/run-{name}"):
          saved, ended, code = _sigterm_run(name, workdir, env)
          kind = "gs:// (emulator)" if workdir.startswith("gs://") else "local"
          print(f"  {name:22s} {kind:17s} {saved:6.2f} s  {ended:6.2f} s  exit {code}",
                flush=True)
    finally:
      server.stop()


if __name__ == "__main__":
  main()
