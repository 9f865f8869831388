"""Soak: a long debug_cpu run under random faults; are steps lost or repeated, does memory grow?

Usage: python -m benchmarks.soak [--steps 500] [--kills 6] [--worker_kills 6] [--seed 0]
                                 [--no_disk_full] [--no_reference]

One training run (`launch/train.py`, configs/debug_cpu.py with 2 verifier worker processes, an
evaluation every 50 steps, a checkpoint every 5) is driven to `--steps` through faults drawn from
a seeded random generator:

- SIGKILL of the trainer `--kills` times, each after a random number (3..60) of new metrics rows;
  the run is then started again on the same workdir, as a scheduler would;
- SIGKILL of a verifier worker `--worker_kills` times (the pool must replace it and re-issue its
  item: the run goes on and its rewards do not change);
- one full disk: the workdir lives on a size-limited tmpfs (when this machine allows mounting
  one), a ballast file takes its free space mid-run, the run must stop with exit 4 and one error
  line; the ballast is removed and the run started again.

Reported: steps lost (missing from metrics.jsonl) and repeated (more than one row), both must be
0; steps whose metrics differ from an uninterrupted reference run of the same config (timings and
pool counters aside); and the trainer's resident memory, sampled with every new row, as growth per
100 steps (a least-squares slope over each launch's rows after its first 20).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
MIB = 2**20
VOLATILE = ("time/", "throughput/", "verifier/pool/")
WARM_UP_ROWS = 20  # rows after a (re)start not used for the memory slope (compiles, caches)


def overrides(workdir: pathlib.Path, steps: int) -> list[str]:
  return [f"--config.workdir={workdir}", f"--config.total_steps={steps}",
          "--config.verifier.num_workers=2", "--config.eval.every_steps=50",
          "--config.checkpoint.every_steps=5", "--config.logging.progress_bar=False"]


# ------------------------------------------------------------------------------- processes


def _read(path: str) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return f.read()
  except OSError:
    return ""


def children(pid: int) -> list[int]:
  """Direct children of `pid` (from /proc)."""
  found = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      stat = _read(f"/proc/{entry}/stat")
      # the command name in field 2 may hold spaces; the parent pid follows its closing paren
      if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
        found.append(int(entry))
  return found


def verifier_workers(trainer: int) -> list[int]:
  """The pool's worker processes: children of the trainer's multiprocessing forkserver."""
  workers = []
  for child in children(trainer):
    if "forkserver" in _read(f"/proc/{child}/cmdline"):
      workers += children(child)
  return workers


def rss_bytes(pid: int) -> int | None:
  for line in _read(f"/proc/{pid}/status").splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) * 1024
  return None


def metrics_steps(workdir: pathlib.Path) -> list[int]:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  steps = []
  for line in path.read_text().splitlines():
    try:
      steps.append(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError):
      pass  # a row being written
  return steps


# ------------------------------------------------------------------------------- the full disk


@contextlib.contextmanager
def small_disk(directory: pathlib.Path, size_mib: int):
  """A tmpfs of `size_mib` mounted at `directory`, or None where mounting is not allowed."""
  directory.mkdir(parents=True, exist_ok=True)
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs",
                            str(directory)], capture_output=True, text=True).returncode == 0
  try:
    yield directory if mounted else None
  finally:
    if mounted:
      subprocess.run(["umount", "-l", str(directory)], check=False)


def fill(directory: pathlib.Path) -> pathlib.Path:
  """A ballast file that takes every free byte of `directory`'s file system."""
  ballast = directory / "ballast.bin"
  fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  try:
    for size in (MIB, 4096, 1):
      block = b"\0" * size
      with contextlib.suppress(OSError):
        while os.write(fd, block):
          pass
  finally:
    os.close(fd)
  return ballast


# ------------------------------------------------------------------------------- one launch


@dataclasses.dataclass
class Launch:
  """What one start of train.py did."""

  exit_code: int
  fault: str  # "kill", "disk_full" or "" (ran to its end)
  rows: list[tuple[int, int]]  # (step, trainer RSS bytes) sampled as rows appeared
  worker_kills: int
  stderr_lines: int
  last_error_line: str


def launch(workdir, steps, *, log, kill_after_rows=None, disk_full_after_rows=None,
           disk=None, worker_kill_rows=()) -> Launch:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  command = [sys.executable, str(REPO / "launch" / "train.py"), "--config=configs/debug_cpu.py",
             *overrides(workdir, steps)]
  errors = pathlib.Path(log).with_suffix(".stderr")
  with open(log, "ab") as out, open(errors, "wb") as err:  # files, not pipes: never blocks it
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err)
  start_rows = len(metrics_steps(workdir))
  rows, fault, worker_kills, ballast = [], "", 0, None
  pending_worker_kills = sorted(worker_kill_rows)
  while process.poll() is None:
    steps_now = metrics_steps(workdir)
    new = len(steps_now) - start_rows
    if steps_now and (not rows or rows[-1][0] != steps_now[-1]):
      rss = rss_bytes(process.pid)
      if rss is not None:
        rows.append((steps_now[-1], rss))
    if pending_worker_kills and new >= pending_worker_kills[0]:
      workers = verifier_workers(process.pid)
      if workers:
        with contextlib.suppress(ProcessLookupError):
          os.kill(random.Random(new).choice(workers), 9)
          worker_kills += 1
        pending_worker_kills.pop(0)
    if kill_after_rows is not None and new >= kill_after_rows:
      process.kill()
      fault = "kill"
      break
    if disk_full_after_rows is not None and ballast is None and new >= disk_full_after_rows:
      ballast = fill(disk)
      fault = "disk_full"
    time.sleep(0.05)
  process.wait()
  if ballast is not None:
    ballast.unlink()
  stderr = errors.read_bytes()
  lines = [line for line in stderr.decode(errors="replace").splitlines() if line.strip()]
  with open(log, "ab") as out:
    out.write(stderr)
  return Launch(process.returncode, fault, rows, worker_kills, len(lines),
                lines[-1] if lines else "")


# ------------------------------------------------------------------------------- reporting


def growth_per_100_steps(rows: list[tuple[int, int]]) -> float | None:
  """MiB per 100 steps: least-squares slope of RSS over step, after the warm-up rows."""
  steady = rows[WARM_UP_ROWS:]
  if len(steady) < 20:
    return None
  steps, rss = np.array(steady, dtype=float).T
  return float(np.polyfit(steps, rss, 1)[0]) * 100 / MIB


def stable_rows(workdir: pathlib.Path) -> dict[int, dict]:
  rows = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    rows[row["step"]] = {k: v for k, v in row.items() if not k.startswith(VOLATILE)}
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=500)
  parser.add_argument("--kills", type=int, default=6)
  parser.add_argument("--worker_kills", type=int, default=6)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no_disk_full", action="store_true")
  parser.add_argument("--no_reference", action="store_true")
  parser.add_argument("--keep", help="keep the run here instead of a temporary directory")
  args = parser.parse_args()
  rng = random.Random(args.seed)
  root = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="soak-"))
  root.mkdir(parents=True, exist_ok=True)
  log = root / "train.log"
  started = time.monotonic()
  with small_disk(root / "disk", 256) if not args.no_disk_full else contextlib.nullcontext() as disk:
    workdir = (disk or root) / "run"
    faults = ["kill"] * args.kills + (["disk_full"] if disk is not None else [])
    rng.shuffle(faults)
    launches: list[Launch] = []
    worker_kills_left = args.worker_kills
    while True:
      fault = faults.pop(0) if faults else None
      # spread the worker kills over the launches, a few rows into each
      count = min(worker_kills_left, rng.randint(0, 2)) if faults else worker_kills_left
      kill_rows = sorted(rng.randint(2, 40) for _ in range(count))
      result = launch(workdir, args.steps, log=log,
                      kill_after_rows=rng.randint(3, 60) if fault == "kill" else None,
                      disk_full_after_rows=rng.randint(3, 60) if fault == "disk_full" else None,
                      disk=disk, worker_kill_rows=kill_rows)
      worker_kills_left -= result.worker_kills
      launches.append(result)
      steps_done = metrics_steps(workdir)
      print(f"launch {len(launches):2d}: exit {result.exit_code:4d}  fault {result.fault or '-':9s}"
            f"  rows now {len(steps_done):4d}  worker kills {result.worker_kills}"
            f"  stderr lines {result.stderr_lines}"
            + (f"  last: {result.last_error_line}" if result.exit_code not in (0, -9) else ""),
            flush=True)
      if result.exit_code == 0 and (not steps_done or steps_done[-1] == args.steps):
        break
      if result.exit_code not in (-9, 4) or len(launches) > args.kills + 10:
        sys.exit(f"unexpected exit {result.exit_code}; log: {log}")
    soak_s = time.monotonic() - started
    steps = metrics_steps(workdir)
    lost = sorted(set(range(1, args.steps + 1)) - set(steps))
    repeated = len(steps) - len(set(steps))
    soak_rows = stable_rows(workdir)
    kept = workdir if disk is None else root / "run"
    if disk is not None:
      shutil.copytree(workdir, kept, dirs_exist_ok=True)

  print(f"\nsoak: {args.steps} steps in {soak_s:.0f} s over {len(launches)} launches: "
        f"{sum(r.fault == 'kill' for r in launches)} trainer SIGKILLs, "
        f"{sum(r.worker_kills for r in launches)} verifier-worker SIGKILLs, "
        f"{sum(r.fault == 'disk_full' for r in launches)} full disk "
        f"(exit codes {[r.exit_code for r in launches]})")
  for r in launches:
    if r.fault == "disk_full":
      print(f"full disk: exit {r.exit_code}, {r.stderr_lines} stderr lines, the last: "
            f"{r.last_error_line}")
  print(f"steps lost: {len(lost)} {lost[:10]}   steps repeated: {repeated}")
  slopes = [(len(r.rows), growth_per_100_steps(r.rows)) for r in launches]
  print("trainer RSS growth per 100 steps, by launch (rows sampled: MiB): "
        + ", ".join(f"{n}: {s:+.1f}" if s is not None else f"{n}: -" for n, s in slopes))
  if not args.no_reference:
    reference_dir = root / "reference"
    started = time.monotonic()
    reference = launch(reference_dir, args.steps, log=root / "reference.log")
    if reference.exit_code != 0:
      sys.exit(f"reference run failed ({reference.exit_code}); log: {root / 'reference.log'}")
    expected = stable_rows(reference_dir)
    differing = sorted(s for s in expected if soak_rows.get(s) != expected[s])
    print(f"reference (no faults): {time.monotonic() - started:.0f} s; steps whose metrics differ "
          f"from it: {len(differing)} {differing[:10]}")
    slope = growth_per_100_steps(reference.rows)
    first, last = reference.rows[WARM_UP_ROWS], reference.rows[-1]
    print(f"reference trainer RSS: {first[1] / MIB:.0f} MiB at step {first[0]} -> "
          f"{last[1] / MIB:.0f} MiB at step {last[0]}; growth {slope:+.1f} MiB per 100 steps")
  print(f"workdirs and logs: {root}")


if __name__ == "__main__":
  main()
