"""Launching a debug training run (configs/debug_cpu.py unless told) as several local processes
(the multi-process tests)."""

from __future__ import annotations

import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import time

from reasoning_rl.multihost import runtime

REPO = pathlib.Path(__file__).resolve().parent.parent
DEVICES_PER_PROCESS = 2
DEBUG_CONFIG = "configs/debug_cpu.py"


def free_port_block(size: int = 8) -> int:
  """A base port such that base .. base + size - 1 are free and lie below the kernel's ephemeral
  range. Ports inside that range (where `bind(0)` and every outgoing connection draw theirs) can
  be taken between this check and the processes' own binds: by gloo's listeners or by a
  connection's source port. CI once saw a weight transfer's socket fail that way
  ("recv() failed errno: 107") on a rerun."""
  low, _ = runtime.ephemeral_port_range()
  rng = random.Random()
  for _ in range(200):
    base = rng.randrange(10_000, max(10_001, low - size))
    if all(_free(base + i) for i in range(size)):
      return base
  raise RuntimeError("no free port block below the ephemeral range")


def _free(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", port))
      return True
    except OSError:
      return False


def train_command(workdir, overrides=(), *, port=None, num_processes=1, process_id=0,
                  config=DEBUG_CONFIG):
  command = [sys.executable, str(REPO / "launch" / "train.py"), f"--config={config}",
             f"--config.workdir={workdir}", *overrides]
  if port is not None:
    command += [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}",
                f"--process_id={process_id}"]
  return command


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a subprocess with `devices` simulated CPU devices: the suite's other flags
  (tests/conftest.py) kept, the device count replaced."""
  others = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
            if not flag.startswith("--xla_force_host_platform_device_count")]
  return " ".join(others + [f"--xla_force_host_platform_device_count={devices}"])


def environment(devices: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = xla_flags(devices)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"
  return env


def start_processes(workdir, overrides=(), *, num_processes=4, log_dir=None,
                    config=DEBUG_CONFIG):
  """Starts the processes of one run; returns [Popen] (stdout+stderr to log files)."""
  port = free_port_block(num_processes + 2)
  log_dir = pathlib.Path(log_dir or workdir).parent
  log_dir.mkdir(parents=True, exist_ok=True)
  processes = []
  for index in range(num_processes):
    log = open(log_dir / f"{pathlib.Path(workdir).name}.p{index}.log", "ab")  # noqa: SIM115
    processes.append(subprocess.Popen(
        train_command(workdir, overrides, port=port, num_processes=num_processes,
                      process_id=index, config=config),
        cwd=REPO, env=environment(DEVICES_PER_PROCESS), stdout=log, stderr=subprocess.STDOUT))
  return processes


def wait_all(processes, timeout_s: float = 600) -> list[int]:
  deadline = time.monotonic() + timeout_s
  codes = []
  for process in processes:
    try:
      codes.append(process.wait(timeout=max(1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
      for p in processes:
        p.kill()
      raise
  return codes


def run_single(workdir, overrides=(), *, devices: int = 8, timeout_s: float = 600,
               config=DEBUG_CONFIG):
  return subprocess.run(train_command(workdir, overrides, config=config), cwd=REPO,
                        env=environment(devices),
                        capture_output=True, text=True, timeout=timeout_s)


def metrics_rows(workdir) -> list[dict]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
