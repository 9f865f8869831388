"""launch/gcp/supervise.py, the trainer under every cloud launcher, run with a stand-in trainer
(tests/fake_trainer.py as launch/train.py of a small project): signals forwarded, exit codes
mapped, the code pinned, a repeated crash stopped, the log copied; the records on a local workdir
and on the GCS emulator. The real trainer under it: test_gcp_xpk.py, test_gcp_jobset.py,
test_gcp_tpu_vm.py."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests import gcs_emulator
from tests.conftest import REPO

SUPERVISE = REPO / "launch" / "gcp" / "supervise.py"
spec = importlib.util.spec_from_file_location("gcp_supervise", SUPERVISE)
supervise = importlib.util.module_from_spec(spec)
spec.loader.exec_module(supervise)


def fake_project(root: pathlib.Path) -> pathlib.Path:
  """A project whose launch/train.py is the stand-in trainer, with configs/ and setup.cfg."""
  (root / "launch").mkdir(parents=True)
  shutil.copy(REPO / "tests" / "fake_trainer.py", root / "launch" / "train.py")
  (root / "configs").mkdir()
  (root / "configs" / "fake.py").write_text("def get_config():\n  return {}\n")
  (root / "setup.cfg").write_text("[metadata]\nname = fake\n")
  return root


def start(project, workdir, *flags, env=None, steps=10, log=None):
  command = [sys.executable, str(SUPERVISE), *flags, *([f"--log={log}"] if log else []), "--",
             "launch/train.py", "--config=configs/fake.py", f"--config.workdir={workdir}",
             f"--config.total_steps={steps}"]
  return subprocess.Popen(command, cwd=project, env={**os.environ, **(env or {})},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(project, workdir, *flags, env=None, steps=10, log=None) -> subprocess.CompletedProcess:
  process = start(project, workdir, *flags, env=env, steps=steps, log=log)
  out, err = process.communicate(timeout=120)
  return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def metrics_steps(workdir) -> list[int]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() \
      else []


def wait_for(condition, timeout_s=60):
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.05)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_wrapper_reaches_the_trainer_once(tmp_path, signum, code):
  """The wrapper is what a launcher signals; the trainer (in its own session) hears it from the
  wrapper only, saves at the step it reached and its exit code comes back unchanged."""
  project, workdir = fake_project(tmp_path / "p"), tmp_path / "run"
  process = start(project, workdir, steps=200, env={"FAKE_TRAINER_STEP_S": "0.1"})
  wait_for(lambda: len(metrics_steps(workdir)) >= 3)
  process.send_signal(signum)
  out, err = process.communicate(timeout=60)
  assert process.returncode == code, err
  saved = int((workdir / "fake_checkpoint").read_text())
  assert saved == metrics_steps(workdir)[-1] >= 3  # the checkpoint is at the step it reached
  assert "reported as" not in err


@pytest.mark.parametrize("trainer_exit, flags, reported", [
    (0, [], 0), (2, [], 2), (3, [], 3), (4, [], 4), (143, [], 143), (130, [], 130),
    (5, [], 5), (5, ["--lost_peer_as_preempted"], 143),
    (1, [], 1), (1, ["--crash_as_preempted"], 143), (139, [], 139)])
def test_exit_codes_as_the_launchers_read_them(tmp_path, trainer_exit, flags, reported):
  project = fake_project(tmp_path / "p")
  result = run(project, tmp_path / "run", *flags, env={"FAKE_TRAINER_EXIT": str(trainer_exit)})
  assert result.returncode == reported, result.stderr


def test_a_crash_at_the_same_step_is_reported_as_repeated(tmp_path):
  """A crash in step 4, then again in step 4 after the restart: 1 then 6 (every launcher stops
  on 6). A crash at another step later is a first crash again."""
  project, workdir = fake_project(tmp_path / "p"), tmp_path / "run"
  workdir.mkdir()
  (workdir / "crash_at_step").write_text("4")
  first = run(project, workdir)
  assert first.returncode == 1 and metrics_steps(workdir) == [1, 2, 3]
  record = json.loads((workdir / "launcher" / "crash-p0.json").read_text())
  assert (record["step"], record["exit_code"]) == (3, 1)
  again = run(project, workdir, "--crash_as_preempted")
  assert again.returncode == 6, again.stderr
  assert again.stderr.count("\n") == 1 and "crashed (exit 1) at step 3 again" in again.stderr
  (workdir / "fake_checkpoint").write_text("3")  # the run moved on: a crash at step 6 is new
  (workdir / "crash_at_step").write_text("6")
  assert run(project, workdir).returncode == 1


def test_the_crash_record_is_per_process(tmp_path):
  """Host 1's first crash at a step host 0 already crashed at is still a first crash for host 1
  (every host of a run crashes at once on a deterministic bug, and all must be retried once)."""
  project, workdir = fake_project(tmp_path / "p"), tmp_path / "run"
  workdir.mkdir()
  (workdir / "crash_at_step").write_text("2")
  host = {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0"}
  assert run(project, workdir, env=host).returncode == 1
  assert run(project, workdir, env={**host, "TPU_WORKER_ID": "1"}).returncode == 1
  assert run(project, workdir, env=host).returncode == 6
  assert sorted(p.name for p in (workdir / "launcher").glob("crash-*")) == [
      "crash-p0.json", "crash-p1.json"]


def test_a_resume_on_other_code_is_refused_in_one_line(tmp_path):
  project, workdir = fake_project(tmp_path / "p"), tmp_path / "run"
  assert run(project, workdir, steps=2).returncode == 0
  recorded = json.loads((workdir / "launcher" / "code.json").read_text())
  assert recorded["digest"] == supervise.code_identity(project)["digest"]
  (project / "configs" / "fake.py").write_text("def get_config():\n  return {'x': 1}\n")
  refused = run(project, workdir, steps=4)
  assert refused.returncode == 2
  assert refused.stderr.count("\n") == 1 and "a resume on other code is refused" in refused.stderr
  assert f"was started on code {recorded['digest'][:12]}" in refused.stderr
  assert metrics_steps(workdir) == [1, 2]  # the trainer never ran
  allowed = run(project, workdir, "--allow_code_change", steps=4)
  assert allowed.returncode == 0 and metrics_steps(workdir) == [1, 2, 3, 4]
  assert json.loads((workdir / "launcher" / "code.json").read_text())["digest"] == (
      supervise.code_identity(project)["digest"])
  assert run(project, workdir, steps=5).returncode == 0  # the new code is the run's now


def test_the_digest_covers_the_code_and_nothing_else(tmp_path):
  project = fake_project(tmp_path / "p")
  before = supervise.code_identity(project)["digest"]
  (project / "notes.txt").write_text("not code")
  (project / "launch" / "__pycache__").mkdir()
  (project / "launch" / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"x")
  assert supervise.code_identity(project)["digest"] == before
  (project / "launch" / "train.py").write_text("# changed\n")
  assert supervise.code_identity(project)["digest"] != before


def test_the_log_goes_to_the_workdir(tmp_path):
  project, workdir = fake_project(tmp_path / "p"), tmp_path / "run"
  log = tmp_path / "logs" / "host-0.log"
  result = run(project, workdir, steps=3, log=log, env={"REASONING_RL_LOG_COPY_S": "0.2"})
  assert result.returncode == 0 and result.stdout == "" and result.stderr == ""
  copied = (workdir / "logs" / "hosts" / "host-0.log").read_text()
  assert copied == log.read_text() and "fake trainer: step 3" in copied


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  with gcs_emulator.serving(tmp_path_factory.mktemp("gcs"), "runs") as server:
    yield server


def test_records_on_gcs(tmp_path, emulator):
  """The code and crash records on a gs:// workdir (the emulator), read and written by the
  project's storage layer; the stand-in trainer itself writes a local directory."""
  project = fake_project(tmp_path / "p")
  env = {**emulator.env, "FAKE_TRAINER_EXIT": "1"}
  workdir = "gs://runs/supervised"
  command = [sys.executable, str(SUPERVISE), "--", "launch/train.py",
             f"--config.workdir={workdir}"]
  first = subprocess.run(command, cwd=project, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120)
  assert first.returncode == 1, first.stderr
  again = subprocess.run(command, cwd=project, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120)
  assert again.returncode == 6, again.stderr
  from reasoning_rl import storage

  code = json.loads((storage.path(workdir) / "launcher" / "code.json").read_text())
  assert code["digest"] == supervise.code_identity(project)["digest"]


def test_reported_codes_by_rule():
  mapped = lambda code, **kw: supervise.reported_code(  # noqa: E731
      code, **{"signalled": False, "repeated": False, "lost_peer_as_preempted": False,
               "crash_as_preempted": False, **kw})
  assert mapped(1, signalled=True) == 1  # after a forwarded stop: whatever the trainer says
  assert mapped(1, repeated=True, crash_as_preempted=True) == 6
  assert mapped(5, repeated=True) == 5  # a lost peer is never a crash
  assert mapped(6) == 6
