"""`launch/gcp/commands.py --mode=xpk`: the generated `xpk workload create` is accepted by xpk's
own argument parser (xpk from PyPI in a throwaway environment); the container command of xpk's own
image build (--base-docker-image + --script-dir) trains debug_cpu the way that image runs it, from
xpk's copy of the repository, inside a stand-in of xpk's container script (tests/xpk_container.py:
SIGTERM to its one child only, the rest killed when it exits), and a preemption there saves at
the step reached and ends with 143; and the container script xpk itself generates (its dry run's
manifest) delivers the same signal and the same exit codes, which its own pod failure policy then
restarts or fails as the launcher intends."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from tests import jobset_runner, xpk_container
from tests.conftest import REPO
from tests.multihost_runs import metrics_rows

spec = importlib.util.spec_from_file_location("gcp_commands",
                                              REPO / "launch" / "gcp" / "commands.py")
gcp = importlib.util.module_from_spec(spec)
sys.modules["gcp_commands"] = gcp
spec.loader.exec_module(gcp)

XPK_VERSION = "1.16.0"  # the newest xpk on PyPI when this was written

# Run inside the xpk environment: xpk's top-level parser (xpk/main.py builds it the same way)
# parses the arguments given as JSON; prints what it made of them, and the exit codes after which
# xpk 1.16.0's podFailurePolicy lets the JobSet restart the slice.
PARSE = """
import argparse, json, sys
from xpk.parser.core import set_parser
from xpk.commands.workload import get_restart_exit_codes
parser = argparse.ArgumentParser(prog="xpk")
set_parser(parser=parser)
args = parser.parse_args(json.loads(sys.argv[1]))
parsed = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
parsed["func"] = args.func.__name__
parsed["restart_exit_codes"] = sorted(get_restart_exit_codes(args))
print(json.dumps(parsed))
"""


def uv_cache_dir() -> str:
  cache_home = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
  return os.environ.get("UV_CACHE_DIR") or str(cache_home / "uv")


@pytest.fixture(scope="module")
def xpk_python(tmp_path_factory) -> pathlib.Path:
  """A throwaway environment with xpk from PyPI, made by uv with the machine's cache (online the
  first time, a few seconds afterwards)."""
  uv = pathlib.Path(sys.executable).parent / "uv"
  venv = tmp_path_factory.mktemp("xpk") / "venv"
  env = {**os.environ, "UV_CACHE_DIR": uv_cache_dir()}
  subprocess.run([str(uv), "venv", "-q", str(venv)], env=env, check=True, timeout=120)
  python = venv / "bin" / "python"
  installed = subprocess.run([str(uv), "pip", "install", "-q", "--python", str(python),
                              f"xpk=={XPK_VERSION}"], env=env, capture_output=True, text=True,
                             timeout=600)
  if installed.returncode != 0:
    pytest.skip(f"xpk {XPK_VERSION} could not be installed from PyPI: "
                f"{installed.stderr.strip().splitlines()[-1:]}")
  return python


def generated_xpk_command(*flags) -> list[str]:
  result = subprocess.run(
      [sys.executable, "launch/gcp/commands.py", "--config=configs/debug_cpu.py", "--mode=xpk",
       "--accelerator_type=v5p-16", "--cluster=c", "--project=p", "--zone=z", "--name=rl",
       "--workdir=gs://b/run", "--max_restarts=3", "--grace_s=60", "--dry_run", *flags],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  return shlex.split(result.stdout.splitlines()[1])


def xpk_parses(python: pathlib.Path, command: list[str]) -> dict:
  assert command[0] == "xpk"
  parsed = subprocess.run([str(python), "-c", PARSE, json.dumps(command[1:])], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
  assert parsed.returncode == 0, parsed.stderr[-3000:]  # argparse: exit 2 and its usage
  return json.loads(parsed.stdout)


@pytest.mark.parametrize("flags, image_fields", [
    (["--image=us-docker.pkg.dev/p/r/rl:1"],
     {"docker_image": "us-docker.pkg.dev/p/r/rl:1"}),
    (["--base_image=us-docker.pkg.dev/p/r/base:1"],
     {"docker_image": None, "base_docker_image": "us-docker.pkg.dev/p/r/base:1",
      "script_dir": "."})])
def test_xpk_parser_accepts_the_generated_command(xpk_python, flags, image_fields):
  command = generated_xpk_command("--num_slices=2", *flags)
  parsed = xpk_parses(xpk_python, command)
  given = next(a for a in command if a.startswith("--command=")).split("=", 1)[1]
  assert {key: parsed[key] for key in image_fields} == image_fields
  assert (parsed["func"], parsed["workload"], parsed["cluster"], parsed["tpu_type"],
          parsed["num_slices"], str(parsed["max_restarts"]),
          str(parsed["termination_grace_period_seconds"]), parsed["command"]) == (
              "workload_create", "rl", "c", "v5p-16", 2, "3", "60", given)
  # what xpk 1.16.0 restarts on: 143 (preempted; a lost peer and a first crash reported as
  # 143), not 2 / 3 / 4 / 6 (bad input, guard, storage, a crash repeated at the same step)
  restarts = set(parsed["restart_exit_codes"])
  assert 143 in restarts and not restarts & {0, 2, 3, 4, 5, 6}
  assert parsed["use_parallel_containers"] is False  # one process per VM, TPU7x included


def copy_script_dir(source: pathlib.Path, target: pathlib.Path) -> None:
  """What xpk puts in /app: the directory's files less the .dockerignore's patterns (matched here
  on names, which is how this repository's patterns are written)."""
  patterns = [line.strip().removeprefix("**/") for line in
              (source / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]

  def ignored(_directory, names):
    return {n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)}

  shutil.copytree(source, target, ignore=ignored, symlinks=True)


def xpk_image(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """The image xpk builds FROM the base: the repository copied to /app (its working directory)
  and the base image's /opt/reasoning_rl/venv (here: this test's Python). Returns (app, the
  image's /opt/reasoning_rl)."""
  app = tmp_path / "image" / "app"
  copy_script_dir(REPO, app)
  image_root = tmp_path / "image" / "opt" / "reasoning_rl"
  (image_root / "venv" / "bin").mkdir(parents=True)
  python = image_root / "venv" / "bin" / "python"
  python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
  python.chmod(0o755)
  return app, image_root


def local_command(line: str, app: pathlib.Path, image_root: pathlib.Path) -> str:
  """xpk's --command with the image's paths on this machine."""
  return line.replace(f"{gcp.XPK_SCRIPT_DIR} ", f"{app} ").replace(
      f"={gcp.XPK_SCRIPT_DIR} ", f"={app} ").replace(gcp.IMAGE_ROOT, str(image_root))


def checkpoint_steps(workdir) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_a_preempted_xpk_container_saves_at_the_step_it_reached(tmp_path):
  """debug_cpu from xpk's copy of the repository (its modules get their bytecode written beside
  them) in the stand-in of xpk's container: the kubelet's SIGTERM goes to the container's first
  process, which passes it to its one child, the supervisor (exec'd), which passes it to the
  trainer: it saves at the step it reached and 143 is the container's exit code; nothing is left
  for the container's end to kill. (With the former `bash -c '...; code=$?; ...'` wrapper the
  trainer never heard the SIGTERM and no checkpoint was written.)"""
  app, image_root = xpk_image(tmp_path)
  assert not (app / ".venv").exists() and not (app / ".git").exists()
  assert not list(app.rglob("__pycache__"))
  workdir = tmp_path / "run"
  command = gcp.xpk_command(
      gcp.slice_for("v5p-8"), name="rl", project="p", zone="z", cluster="c", base_image="base",
      grace_s=60, train=gcp.train_command("configs/debug_cpu.py", str(workdir), [
          "--config.total_steps=500", "--config.eval.num_examples=4",
          "--config.checkpoint.every_steps=100", "--config.logging.rollouts_every_steps=0"]))
  line = next(a for a in command if a.startswith("--command=")).split("=", 1)[1]
  env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  container = xpk_container.Container(
      xpk_container.script(local_command(line, app, image_root)), env=env, cwd=tmp_path,
      log_path=tmp_path / "container.log")
  deadline = time.monotonic() + 400
  while len(metrics_rows(workdir)) < 2:
    assert container.first.poll() is None, (tmp_path / "container.log").read_text()[-3000:]
    assert time.monotonic() < deadline, "no step 2"
    time.sleep(0.2)
  container.terminate()
  code = container.wait(timeout_s=300)
  log = (tmp_path / "container.log").read_text()
  assert code == 143, log[-3000:]
  reached = [row["step"] for row in metrics_rows(workdir)][-1]
  assert 2 <= reached < 500 and checkpoint_steps(workdir) == [reached], log[-3000:]
  assert container.left == []  # the trainer ended before the container did
  assert list((app / "reasoning_rl" / "__pycache__").glob("trainer.*.pyc")), "not run from /app"


def fake_project_image(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """An image whose /app holds the stand-in trainer as launch/train.py (tests/fake_trainer.py)
  beside the real supervisor."""
  app = tmp_path / "image" / "app"
  (app / "launch" / "gcp").mkdir(parents=True)
  shutil.copy(REPO / "tests" / "fake_trainer.py", app / "launch" / "train.py")
  shutil.copy(REPO / "launch" / "gcp" / "supervise.py", app / "launch" / "gcp" / "supervise.py")
  (app / "reasoning_rl").symlink_to(REPO / "reasoning_rl")
  image_root = tmp_path / "image" / "opt" / "reasoning_rl"
  (image_root / "venv" / "bin").mkdir(parents=True)
  python = image_root / "venv" / "bin" / "python"
  python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
  python.chmod(0o755)
  return app, image_root


@pytest.fixture(scope="module")
def xpk_manifest(xpk_python, tmp_path_factory) -> dict:
  """The JobSet xpk 1.16.0 itself generates for our command (`xpk workload create --dry-run
  --output-manifest-file`: no cluster is asked)."""
  command = [a if a != "--zone=z" else "--zone=us-central1-a"  # xpk derives a region from it
             for a in generated_xpk_command("--base_image=base:1",
                                            "--override=--config.total_steps=1000")]
  out = tmp_path_factory.mktemp("xpk_manifest") / "jobset.yaml"
  xpk = pathlib.Path(xpk_python).parent / "xpk"
  made = subprocess.run([str(xpk), *command[1:], "--dry-run", f"--output-manifest-file={out}"],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
  return yaml.safe_load(out.read_text())


def xpk_container_script(manifest: dict) -> str:
  container = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
      "containers"][0]
  assert container["command"][:2] == ["bash", "-c"]
  return container["command"][2]


@pytest.mark.parametrize("trainer_exit, codes, decisions", [
    (None, [143], ["RestartJobSet"]),  # SIGTERM: saved, restarted
    ("5", [143], ["RestartJobSet"]),  # a lost peer: restarted
    ("1", [143, 6], ["RestartJobSet", "FailJobSet"]),  # a crash: once more, then not again
    ("2", [2], ["FailJobSet"]),  # bad input: never restarted
])
def test_xpks_own_container_script_and_policy(xpk_manifest, tmp_path, trainer_exit, codes,
                                              decisions):
  """xpk's generated container script runs our command around the stand-in trainer: the SIGTERM
  sent to the container's first process reaches the trainer, which saves at the step it reached;
  the exit codes that come out make xpk's own podFailurePolicy (NotIn 42, 127-255: FailJob) and
  failurePolicy (FailJobSet on PodFailurePolicy) restart or stop the workload as intended."""
  script = xpk_container_script(xpk_manifest)
  app, image_root = fake_project_image(tmp_path)
  workdir = tmp_path / "run"
  controller = jobset_runner.Controller({**xpk_manifest, "spec": {
      **xpk_manifest["spec"], "failurePolicy": {**xpk_manifest["spec"]["failurePolicy"],
                                                "maxRestarts": 3}}})
  name = xpk_manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
      "containers"][0]["name"]
  env = {**os.environ, "FAKE_TRAINER_STEP_S": "0.1"}
  if trainer_exit is not None:
    env["FAKE_TRAINER_EXIT"] = trainer_exit
  for attempt, (expected, decision) in enumerate(zip(codes, decisions)):
    here = local_command(script, app, image_root).replace("gs://b/run", str(workdir))
    container = xpk_container.Container(here, env=env, cwd=tmp_path,
                                        log_path=tmp_path / f"c{attempt}.log")
    if trainer_exit is None:
      deadline = time.monotonic() + 60
      while len(metrics_rows(workdir)) < 3:
        assert time.monotonic() < deadline, (tmp_path / f"c{attempt}.log").read_text()
        time.sleep(0.05)
      container.terminate()
    code = container.wait(timeout_s=60)
    assert code == expected, (tmp_path / f"c{attempt}.log").read_text()
    assert controller.decide([jobset_runner.PodEnd(code, container=name)]) == decision
  if trainer_exit is None:
    assert int((workdir / "fake_checkpoint").read_text()) == metrics_rows(workdir)[-1]["step"]


def test_tpu7x_runs_one_container_per_vm(xpk_python, tmp_path):
  """xpk's TPU7x machines may run 2 containers per VM (its parallel containers); the project runs
  one process per VM, so the generated command asks for one: xpk's own manifest then has one
  container with the VM's 4 chips, and the pods are the slice's VMs."""
  result = subprocess.run(
      [sys.executable, "launch/gcp/commands.py", "--config=configs/debug_cpu.py", "--mode=xpk",
       "--accelerator_type=tpu7x-16", "--cluster=c", "--project=p", "--zone=us-central1-a",
       "--name=rl", "--workdir=gs://b/run", "--image=img:1", "--dry_run"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  command = shlex.split(result.stdout.splitlines()[1])
  out = tmp_path / "jobset.yaml"
  xpk = pathlib.Path(xpk_python).parent / "xpk"
  made = subprocess.run([str(xpk), *command[1:], "--dry-run", f"--output-manifest-file={out}"],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
  job = yaml.safe_load(out.read_text())["spec"]["replicatedJobs"][0]["template"]["spec"]
  containers = job["template"]["spec"]["containers"]
  assert len(containers) == 1 and containers[0]["resources"]["limits"] == {"google.com/tpu": 4}
  assert job["parallelism"] == gcp.slice_for("tpu7x-16").hosts == 2
