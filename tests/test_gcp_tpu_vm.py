"""The tpu_vm recipe of launch/gcp/commands.py, executed unchanged against a local `gcloud`
(tests/fake_gcloud.py), for a multislice run of the real trainer: one queued resource of 2 nodes
(slices), whose 2 hosts become 2 local CPU processes of one JAX run (the launcher maps the hosts'
TPU_WORKER_* and MEGASCALE_* variables onto the coordinator flags,
reasoning_rl/multihost/tpu_env.py); the install script runs on each host; a preemption (SIGTERM to
the pid each host recorded, the supervisor, which passes it on; then the queued resource
SUSPENDED) makes both trainers save the step they reached and exit 143, and is followed by delete,
recreate, reinstall and a resume with no step lost, though --max_restarts is 0 (preemptions do
not count); the queued resource is deleted at the end. The recipe's own logic (reconnecting, the
lock, hangups, crashes, pinning, workers that drive themselves) runs with a stand-in trainer in
test_gcp_tpu_vm_driver.py."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import stat
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.multihost_runs import metrics_rows, xla_flags

TOTAL_STEPS = 12  # a step takes ~1 s after the first: the notice lands well before the end


def uv_cache_dir() -> str:
  """The uv cache of the machine, shared by the fake hosts (their HOME is their own directory)."""
  cache_home = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
  return os.environ.get("UV_CACHE_DIR") or str(cache_home / "uv")


def warm_uv_cache(tmp_path: pathlib.Path, cache: str) -> None:
  """One online install of what the hosts install, so that the hosts' installs can run offline
  from the cache (each host's uv would otherwise revalidate the index: ~25 s here)."""
  uv = pathlib.Path(sys.executable).parent / "uv"
  env = {**os.environ, "UV_CACHE_DIR": cache}
  subprocess.run([str(uv), "venv", "-q", str(tmp_path / "warm")], env=env, check=True)
  python = tmp_path / "warm" / "bin" / "python"
  subprocess.run([str(uv), "pip", "install", "-q", "--python", str(python), "-e", str(REPO),
                  "jax[tpu]==0.10.2"], env=env, check=True, timeout=600)


def fake_cloud(tmp_path: pathlib.Path) -> dict:
  """The environment of a shell whose `gcloud` is the local stand-in."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  shim = bin_dir / "gcloud"
  shim.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests' / 'fake_gcloud.py'} \"$@\"\n")
  shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
  warm_uv_cache(tmp_path, uv_cache_dir())
  worker_env = {"JAX_PLATFORMS": "cpu", "UV_CACHE_DIR": uv_cache_dir(), "UV_OFFLINE": "1",
                "XLA_FLAGS": xla_flags(2)}
  return {**os.environ, "PATH": f"{bin_dir}:{pathlib.Path(sys.executable).parent}:"
          f"{os.environ['PATH']}", "FAKE_GCLOUD_STATE": str(tmp_path / "cloud"),
          # one worker per node: 2 slices of v5p-16 as 2 processes, the cost of the one-slice run
          "FAKE_GCLOUD_HOSTS": "1", "FAKE_GCLOUD_WORKER_ENV": json.dumps(worker_env),
          "POLL_S": "0.2", "SETTLE_S": "10"}


def recipe(tmp_path: pathlib.Path, workdir: pathlib.Path) -> pathlib.Path:
  result = subprocess.run(
      [sys.executable, "launch/gcp/commands.py", "--config=configs/debug_cpu.py", "--mode=tpu_vm",
       "--accelerator_type=v5p-16", "--num_slices=2", "--project=p", "--zone=z", "--name=rl",
       f"--source={REPO}",
       f"--workdir={workdir}", "--workdir_is_shared", "--max_restarts=0", "--spot",
       f"--override=--config.total_steps={TOTAL_STEPS}",
       "--override=--config.checkpoint.every_steps=100",  # the preemption's save is the only one
       "--override=--config.eval.num_examples=4",
       "--override=--config.logging.rollouts_every_steps=0",
       "--dry_run"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  path = tmp_path / "recipe.sh"
  path.write_text(result.stdout)
  return path


def hosts_of(tmp_path: pathlib.Path, incarnation: int) -> list[pathlib.Path]:
  """The homes of the workers of one incarnation of the queued resource, node by node."""
  return sorted((tmp_path / "cloud" / "rl" / "hosts" / str(incarnation)).glob("*/worker*"))


def told(home: pathlib.Path) -> dict:
  """The TPU_WORKER_* / MEGASCALE_* values a host was given (its tpu-env metadata stand-in)."""
  lines = (home / "tpu-env").read_text().splitlines()
  return {key: value.strip().strip("'") for key, value in (line.split(":", 1) for line in lines)}


def calls(tmp_path: pathlib.Path) -> list[list[str]]:
  lines = (tmp_path / "cloud" / "calls.log").read_text().splitlines()
  return [json.loads(line) for line in lines]


def wait_for(condition, timeout_s: float, what: str, process) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    if process.poll() is not None:
      raise AssertionError(f"the recipe ended (exit {process.returncode}) before {what}")
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out waiting for {what}")
    time.sleep(0.1)


def preempt(tmp_path: pathlib.Path) -> list[int]:
  """SIGTERM to every host's trainer, then the queued resource reports SUSPENDED (the order of a
  Spot preemption: the hosts get their notice, then the service takes them)."""
  pids = [int((h / "reasoning_rl" / "train.pid").read_text()) for h in hosts_of(tmp_path, 0)]
  for pid in pids:
    os.kill(pid, signal.SIGTERM)
  (tmp_path / "cloud" / "rl" / "state").write_text("SUSPENDED")
  return pids


@pytest.mark.slow
def test_multislice_recipe_recovers_a_preemption_without_losing_a_step(tmp_path):
  workdir = tmp_path / "run"
  env = fake_cloud(tmp_path)
  process = subprocess.Popen(["bash", str(recipe(tmp_path, workdir))], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    wait_for(lambda: len(metrics_rows(workdir)) >= 1, 300, "step 1", process)
    preempt(tmp_path)
    output, _ = process.communicate(timeout=400)
  finally:
    if process.poll() is None:
      process.kill()
  assert process.returncode == 0, output
  from reasoning_rl.multihost.tpu_env import flags_from_tpu_environment

  first_hosts = hosts_of(tmp_path, 0)
  assert [h.parent.name for h in first_hosts] == ["rl-0", "rl-1"]  # one node per slice
  # slice k's only host is process k of the 2-process run; slice 0's host coordinates
  mapped = [flags_from_tpu_environment({**told(h), "JAX_COORDINATOR_PORT": "9000"})
            for h in first_hosts]
  assert [(f.process_id, f.num_processes, f.coordinator_address) for f in mapped] == [
      (0, 2, "localhost:9000"), (1, 2, "localhost:9000")]
  exit_codes = [(h / "reasoning_rl" / "exit_code").read_text().strip() for h in first_hosts]
  assert exit_codes == ["143", "143"], output  # each saved its checkpoint on the notice
  steps = [row["step"] for row in metrics_rows(workdir)]
  assert steps == list(range(1, TOTAL_STEPS + 1)), steps  # no step lost, none repeated
  assert "preemption 1 (not counted toward --max_restarts): queued resource SUSPENDED" in output
  assert "restart 1/" not in output
  queued = [c for c in calls(tmp_path) if c[:3] == ["compute", "tpus", "queued-resources"]]
  verbs = [c[3] for c in queued if c[3] in ("create", "delete")]
  assert verbs == ["create", "delete", "create", "delete"], verbs  # recreated, then down
  create = next(c for c in queued if c[3] == "create")
  assert {"--node-count=2", "--node-prefix=rl", "--accelerator-type=v5p-16", "--spot"} <= set(
      create)
  # every worker of every node was reached by the queued resource's own ssh / scp
  assert {c[3] for c in queued} == {"create", "describe", "delete", "scp", "ssh"}
  assert all("--node=all" in c for c in queued if c[3] == "scp")
  assert not [c for c in calls(tmp_path) if c[2] == "tpu-vm"]
  # the second incarnation's hosts installed afresh and resumed: both ran to the end
  assert [(h / "reasoning_rl" / "exit_code").read_text().strip()
          for h in hosts_of(tmp_path, 1)] == ["0", "0"]
  assert output.count("installed: reasoning_rl") == 4, output  # 2 hosts, twice
