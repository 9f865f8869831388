"""`launch/gcp/commands.py --mode=xpk`: the generated `xpk workload create` is accepted by xpk's
own argument parser (xpk from PyPI in a throwaway environment), and the container command of
xpk's own image build (--base-docker-image + --script-dir) trains debug_cpu when run the way that
image runs it: from xpk's copy of the repository with the base image's environment."""

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

import pytest

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
  # what xpk 1.16.0 restarts on: 143 (preempted, and a lost peer reported as 143), not 2 / 3 / 4
  restarts = set(parsed["restart_exit_codes"])
  assert 143 in restarts and not restarts & {0, 2, 3, 4, 5}


def copy_script_dir(source: pathlib.Path, target: pathlib.Path) -> None:
  """What xpk puts in /app: the directory's files less the .dockerignore's patterns (matched here
  on names, which is how this repository's patterns are written)."""
  patterns = [line.strip().removeprefix("**/") for line in
              (source / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]

  def ignored(_directory, names):
    return {n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)}

  shutil.copytree(source, target, ignore=ignored, symlinks=True)


@pytest.mark.slow
def test_container_of_xpks_image_build_trains_from_its_copy(tmp_path):
  """The image xpk builds FROM the base: the repository copied to /app (its working directory)
  and the base image's /opt/reasoning_rl/venv (here: this checkout's .venv). The trainer must
  run the copy's code: its modules get their bytecode written beside them."""
  app = tmp_path / "image" / "app"
  copy_script_dir(REPO, app)
  assert not (app / ".venv").exists() and not (app / ".git").exists()
  assert not list(app.rglob("__pycache__"))
  image_root = tmp_path / "image" / "opt" / "reasoning_rl"
  (image_root / "venv" / "bin").mkdir(parents=True)
  python = image_root / "venv" / "bin" / "python"
  python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
  python.chmod(0o755)
  workdir = tmp_path / "run"
  s = gcp.slice_for("v5p-8")
  command = gcp.xpk_command(
      s, name="rl", project="p", zone="z", cluster="c", base_image="base", grace_s=60,
      train=gcp.train_command("configs/debug_cpu.py", str(workdir), [
          "--config.total_steps=1", "--config.eval.num_examples=4",
          "--config.logging.rollouts_every_steps=0"]))
  container = shlex.split(next(a for a in command if a.startswith("--command=")).split("=", 1)[1])
  assert container[:2] == ["bash", "-c"]
  assert container[2].startswith(f"cd {gcp.XPK_SCRIPT_DIR} && ")
  # the image's paths, on this machine
  script = container[2].replace(f"{gcp.XPK_SCRIPT_DIR} ", f"{app} ").replace(
      gcp.IMAGE_ROOT, str(image_root))
  env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  run = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
  assert [row["step"] for row in metrics_rows(workdir)] == [1]
  assert list((app / "reasoning_rl" / "__pycache__").glob("trainer.*.pyc")), "not run from /app"
