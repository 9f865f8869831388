"""Soak on gs://: a debug run driven through stops and stalled storage; is any step lost?

Usage: python -m benchmarks.gcs_soak [--steps 40] [--faults 10] [--seed 0] [--no_reference]

One training run (`launch/train.py`, configs/debug_cpu.py, a checkpoint every step) on a gs://
workdir of a fake-gcs-server emulator started here, reached through tests/storage_relay.py. It is
driven to `--steps` through `--faults` faults drawn from a seeded random generator, each after
1..3 new complete checkpoints, the run then started again on the same workdir as a scheduler
would:

- sigterm: the orderly stop (exit 143); the step it was at must be saved (none redone);
- sigkill: the process dies at once; the steps after its newest checkpoint are redone;
- silence: the relay stops relaying with every socket open; the run must exit 4 once
  `storage.timeout_s` (10 s here) passed, naming the checkpoint a rerun resumes from;
- silent_sigterm: the store goes silent, then SIGTERM: exit 143 at `checkpoint.stop_deadline_s`
  (10 s here), naming the checkpoint a rerun resumes from;
- slow: the relay forwards 200 kB/s for the whole launch, which ends in a SIGTERM.

Reported per kind: how often, the exit codes, the longest time from the fault to the exit, and
the steps redone after it; then steps missing from metrics.jsonl or repeated (both must be 0), and
steps whose metrics differ from an uninterrupted local run of the same config (timings aside).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from benchmarks.soak import REPO, VOLATILE

BUCKET = "soak"
KINDS = ("sigterm", "sigkill", "silence", "silent_sigterm", "slow")
EXPECTED = {"sigterm": 143, "sigkill": -signal.SIGKILL, "silence": 4, "silent_sigterm": 143,
            "slow": 143}


def _command(workdir: str, steps: int) -> list[str]:
  return [sys.executable, str(REPO / "launch" / "train.py"), "--config=configs/debug_cpu.py",
          f"--config.workdir={workdir}", f"--config.total_steps={steps}",
          "--config.checkpoint.every_steps=1", "--config.checkpoint.keep=3",
          "--config.eval.num_examples=4", "--config.storage.timeout_s=10",
          "--config.checkpoint.stop_deadline_s=10", "--config.logging.progress_bar=False"]


def _complete(server, prefix: str) -> list[int]:
  return server.complete_checkpoints(BUCKET, prefix)


def _rows(server, prefix: str) -> list[dict]:
  url = (f"{server.url}/download/storage/v1/b/{BUCKET}/o/"
         f"{urllib.parse.quote(prefix + '/metrics.jsonl', safe='')}?alt=media")
  try:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
  except OSError:
    return []
  return [json.loads(line) for line in text.splitlines() if line.strip()]


def _stable(row: dict) -> dict:
  return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--faults", type=int, default=10)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no_reference", action="store_true")
  args = parser.parse_args()
  sys.path.insert(0, str(REPO))
  from tests import gcs_emulator
  from tests.multihost_runs import environment
  from tests.storage_relay import Relay

  rng = random.Random(args.seed)
  with tempfile.TemporaryDirectory() as scratch:
    reference = []
    if not args.no_reference:
      local = f"{scratch}/reference"
      subprocess.run(_command(local, args.steps), cwd=REPO, env=environment(devices=1),
                     check=True, capture_output=True)
      reference = [json.loads(line) for line in open(f"{local}/metrics.jsonl")]
    server = gcs_emulator.start(scratch)
    server.create_bucket(BUCKET)
    relay = Relay(int(server.url.rsplit(":", 1)[1]))
    env = {**environment(devices=1), "STORAGE_EMULATOR_HOST": relay.url,
           "REASONING_RL_CACHE": f"{scratch}/cache"}
    prefix = "run"
    workdir = f"gs://{BUCKET}/{prefix}"
    report = collections.defaultdict(lambda: {"count": 0, "codes": [], "exit_s": 0.0,
                                              "redone": 0})
    faults = [rng.choice(KINDS) for _ in range(args.faults)]
    started = time.monotonic()
    try:
      for kind in faults + [None]:
        before = max(_complete(server, prefix), default=0)
        if before >= args.steps:
          break
        if kind == "slow":
          relay.slow(200_000)
        process = subprocess.Popen(_command(workdir, args.steps), cwd=REPO, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kind is None:
          _, err = process.communicate(timeout=3600)
          assert process.returncode == 0, err[-3000:]
          break
        target = before + rng.randint(1, 3)
        while max(_complete(server, prefix), default=0) < min(target, args.steps - 1):
          if process.poll() is not None:
            break
          time.sleep(0.1)
        if process.poll() is not None:  # it finished or failed on its own
          _, err = process.communicate()
          report["(ended early)"]["codes"].append(process.returncode)
          relay.relay()
          continue
        if kind in ("silence", "silent_sigterm"):
          relay.silence()
          time.sleep(1.0 if kind == "silent_sigterm" else 0.0)
        fault_at = time.monotonic()
        if kind in ("sigterm", "silent_sigterm", "slow"):
          process.send_signal(signal.SIGTERM)
        elif kind == "sigkill":
          process.send_signal(signal.SIGKILL)
        _, err = process.communicate(timeout=600)
        took = time.monotonic() - fault_at
        relay.relay()
        rows = _rows(server, prefix)
        newest = max(_complete(server, prefix), default=0)
        entry = report[kind]
        entry["count"] += 1
        entry["codes"].append(process.returncode)
        entry["exit_s"] = max(entry["exit_s"], took)
        entry["redone"] += max(0, (rows[-1]["step"] if rows else 0) - newest)
        if process.returncode != EXPECTED[kind]:
          print(f"unexpected exit {process.returncode} after {kind}: {err.strip()[-500:]}")
    finally:
      relay.close()
      rows = _rows(server, prefix)
      server.stop()
  steps = [row["step"] for row in rows]
  missing = sorted(set(range(1, args.steps + 1)) - set(steps))
  repeated = sorted(s for s, n in collections.Counter(steps).items() if n > 1)
  differing = [a["step"] for a, b in zip(rows, reference) if _stable(a) != _stable(b)]
  print(f"gs:// soak: {args.steps} steps, faults {faults} (seed {args.seed}), "
        f"{time.monotonic() - started:.0f} s")
  print(f"{'fault':16s} {'count':>5s} {'exit codes':>22s} {'longest fault->exit':>20s} "
        f"{'steps redone':>12s}")
  for kind, entry in report.items():
    print(f"{kind:16s} {entry['count']:5d} {str(sorted(set(entry['codes']))):>22s} "
          f"{entry['exit_s']:19.1f}s {entry['redone']:12d}")
  print(f"steps missing: {missing}  repeated: {repeated}  differing from the reference: "
        f"{differing if reference else 'not compared'}")


if __name__ == "__main__":
  main()
