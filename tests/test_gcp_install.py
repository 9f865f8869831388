"""launch/gcp/install_worker.sh, the one install of TPU VM workers, the image and the notebook:
run for real in a fresh directory (jax[tpu] installs here and runs on the CPU), run again (an
update, not a failure), then the environment it made trains debug_cpu."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.multihost_runs import metrics_rows
from tests.support.cloud import fake_uv_script


SCRIPT = REPO / "launch" / "gcp" / "install_worker.sh"


def install(source, root: pathlib.Path, env: dict) -> subprocess.CompletedProcess:
  return subprocess.run(["bash", str(SCRIPT), str(source), str(root)], env=env,
                        capture_output=True, text=True, timeout=600)


def machine_env(home: pathlib.Path) -> dict:
  """A fresh HOME, and the machine's uv cache (so the packages come from it, not the network);
  uv from this environment's PATH (the test extra installs it)."""
  cache_home = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
  return {**os.environ, "HOME": str(home),
          "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR") or str(cache_home / "uv"),
          "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}


@pytest.mark.slow
def test_install_script_makes_an_environment_that_trains(tmp_path):
  env = machine_env(tmp_path / "home")
  root = tmp_path / "worker" / "reasoning_rl"
  first = install(REPO, root, env)
  assert first.returncode == 0, first.stderr
  assert first.stdout.startswith(f"installed: reasoning_rl from {root}/src on Python 3.1")
  assert first.stdout.rstrip().endswith("jax 0.10.2, libtpu 0.0.42.1"), first.stdout
  python = root / "venv" / "bin" / "python"
  made = python.stat().st_ino
  again = install(REPO, root, env)  # idempotent: an update, the same environment
  assert again.returncode == 0, again.stderr
  assert again.stdout == first.stdout and python.stat().st_ino == made
  workdir = tmp_path / "run"
  run = subprocess.run([str(python), "launch/train.py", "--config=configs/debug_cpu.py",
                        "--config.total_steps=2", f"--config.workdir={workdir}"],
                       cwd=root / "src", env={**env, "JAX_PLATFORMS": "cpu"},
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert [row["step"] for row in metrics_rows(workdir)] == [1, 2]


def fake_uv(tmp_path: pathlib.Path, venv_ok: bool) -> dict:
  """The environment of a host whose `uv` is `fake_uv_script`'s."""
  bin_dir = tmp_path / "fake_bin"
  bin_dir.mkdir(exist_ok=True)
  uv = bin_dir / "uv"
  uv.write_text(fake_uv_script(tmp_path / "uv_calls", venv_ok))
  uv.chmod(0o755)
  return {**os.environ, "HOME": str(tmp_path / "home"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_second_run_of_a_git_source_updates_instead_of_cloning_again(tmp_path):
  env = fake_uv(tmp_path, venv_ok=True)
  origin = tmp_path / "origin"
  subprocess.run(["git", "clone", "--quiet", "--depth=1", f"file://{REPO}", str(origin)],
                 check=True)
  root = tmp_path / "r"
  first = install(f"file://{origin}", root, env)
  assert first.returncode == 0, first.stderr
  (origin / "NEW_FILE").write_text("x")
  subprocess.run(["git", "-C", str(origin), "add", "NEW_FILE"], check=True)
  subprocess.run(["git", "-C", str(origin), "-c", "user.name=t", "-c", "user.email=t@t",
                  "commit", "--quiet", "-m", "update"], check=True)
  second = install(f"file://{origin}", root, env)
  assert second.returncode == 0, second.stderr
  assert (root / "src" / "NEW_FILE").read_text() == "x"  # updated in place
  calls = (tmp_path / "uv_calls").read_text().splitlines()
  assert sum(c.startswith("venv") for c in calls) == 1  # the environment was kept
  assert sum(c.startswith("pip install") for c in calls) == 2
  assert f"-e {root}/src jax[tpu]==0.10.2" in calls[-1]


def test_no_python_is_one_clear_line(tmp_path):
  env = fake_uv(tmp_path, venv_ok=False)
  result = install(REPO, tmp_path / "r", env)
  assert result.returncode == 1
  assert result.stderr.count("\n") == 1, result.stderr
  assert result.stderr.startswith("error: install_worker.sh: no Python >= 3.11 on this host and "
                                  "uv could not download Python 3.12")


def test_a_linked_checkout_is_never_reset_by_a_later_git_source(tmp_path):
  """A directory source is linked in place; a later git source must clone beside it, not fetch
  and reset the user's own checkout through the link."""
  env = fake_uv(tmp_path, venv_ok=True)
  checkout = tmp_path / "checkout"
  subprocess.run(["git", "clone", "--quiet", "--depth=1", f"file://{REPO}", str(checkout)],
                 check=True)
  (checkout / "UNCOMMITTED").write_text("mine")
  root = tmp_path / "r"
  assert install(checkout, root, env).returncode == 0
  assert (root / "src").is_symlink()
  second = install(f"file://{REPO}", root, env)
  assert second.returncode == 0, second.stderr
  assert not (root / "src").is_symlink() and (root / "src" / ".git").is_dir()
  assert (checkout / "UNCOMMITTED").read_text() == "mine"
  remote = subprocess.run(["git", "-C", str(checkout), "remote", "get-url", "origin"],
                          capture_output=True, text=True, check=True).stdout.strip()
  assert remote == f"file://{REPO}"


def test_a_git_source_installs_the_pinned_commit_not_the_newest(tmp_path):
  """REASONING_RL_REF=<commit> (what the TPU VM recipe pins): the first install and a reinstall
  after the remote moved on both get that commit, and say so."""
  env = fake_uv(tmp_path, venv_ok=True)
  origin = tmp_path / "origin"
  subprocess.run(["git", "clone", "--quiet", "--depth=1", f"file://{REPO}", str(origin)],
                 check=True)
  pinned = subprocess.run(["git", "-C", str(origin), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
  root = tmp_path / "r"
  pin = {**env, "REASONING_RL_REF": pinned}
  first = install(f"file://{origin}", root, pin)
  assert first.returncode == 0, first.stderr
  assert first.stdout.startswith(f"installed: reasoning_rl from {root}/src at {pinned} on Python")
  (origin / "NEW_FILE").write_text("x")
  subprocess.run(["git", "-C", str(origin), "add", "NEW_FILE"], check=True)
  subprocess.run(["git", "-C", str(origin), "-c", "user.name=t", "-c", "user.email=t@t",
                  "commit", "--quiet", "-m", "later"], check=True)
  again = install(f"file://{origin}", root, pin)
  assert again.returncode == 0, again.stderr
  assert f" at {pinned} " in again.stdout and not (root / "src" / "NEW_FILE").exists()
  newest = install(f"file://{origin}", root, env)  # unpinned: the remote's HEAD
  assert newest.returncode == 0 and (root / "src" / "NEW_FILE").exists()


def test_an_archive_with_another_digest_is_refused(tmp_path):
  env = fake_uv(tmp_path, venv_ok=True)
  archive = tmp_path / "project.tar.gz"
  subprocess.run(["git", "archive", "--format=tar.gz", "--prefix=reasoning_rl/", "-o",
                  str(archive), "HEAD"], cwd=REPO, check=True)
  import hashlib

  digest = hashlib.sha256(archive.read_bytes()).hexdigest()
  ok = install(archive, tmp_path / "r", {**env, "REASONING_RL_SHA256": digest})
  assert ok.returncode == 0, ok.stderr
  refused = install(archive, tmp_path / "r", {**env, "REASONING_RL_SHA256": "0" * 64})
  assert refused.returncode == 1 and refused.stderr.count("\n") == 1
  assert refused.stderr.startswith(f"error: install_worker.sh: archive {archive} has sha256 "
                                   f"{digest}, not the {'0' * 64} the run was started from")
