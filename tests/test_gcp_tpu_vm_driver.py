"""The tpu_vm recipe's own logic, executed unchanged against the local `gcloud`
(tests/fake_gcloud.py) with a project whose trainer is the stand-in (tests/fake_trainer.py) and
a `uv` that installs nothing, so that each scenario takes seconds: preemptions restart without
counting toward --max_restarts and a crash repeated at the same step stops the run; reinstalls get
the commit the recipe pinned; a dropped connection reconnects without a second trainer; a second
driver on the workdir is refused while the first holds its lock; a hangup leaves the run going
and a new driver picks it up; workers that drive themselves run to the end with their logs in
the workdir. The real trainer through the same recipe: test_gcp_tpu_vm.py."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import time

from tests.conftest import REPO
from tests.multihost_runs import metrics_rows
from tests.support.cloud import fake_uv_script


TOTAL_STEPS = 30


def git(*args, cwd) -> str:
  return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                        capture_output=True, text=True, check=True).stdout.strip()


def fake_project(root: pathlib.Path) -> str:
  """A git repository of a project whose launch/train.py is the stand-in trainer, beside the
  real supervisor and reasoning_rl (linked); returns its URL."""
  (root / "launch" / "gcp").mkdir(parents=True)
  shutil.copy(REPO / "tests" / "fake_trainer.py", root / "launch" / "train.py")
  shutil.copy(REPO / "launch" / "gcp" / "supervise.py", root / "launch" / "gcp" / "supervise.py")
  (root / "reasoning_rl").symlink_to(REPO / "reasoning_rl")
  (root / "setup.cfg").write_text("[metadata]\nname = fake\n")
  git("init", "-q", cwd=root)
  git("add", ".", cwd=root)
  git("commit", "-q", "-m", "fake project", cwd=root)
  return f"file://{root}"


def fake_cloud(tmp_path: pathlib.Path, step_s: float = 0.3) -> dict:
  """The environment of a shell whose `gcloud` is the local stand-in and whose workers' `uv`
  makes environments running this test's Python."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  shim = bin_dir / "gcloud"
  shim.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests' / 'fake_gcloud.py'} \"$@\"\n")
  shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
  uv = bin_dir / "uv"
  uv.write_text(fake_uv_script(tmp_path / "uv_calls", venv_ok=True))
  uv.chmod(0o755)
  path = f"{bin_dir}:{os.environ['PATH']}"
  worker_env = {"PATH": path, "FAKE_TRAINER_STEP_S": str(step_s), "REASONING_RL_LOG_COPY_S": "0.5",
                "REASONING_RL_RESTART_DELAY_S": "1"}
  return {**os.environ, "PATH": path, "FAKE_GCLOUD_STATE": str(tmp_path / "cloud"),
          "FAKE_GCLOUD_HOSTS": "2", "FAKE_GCLOUD_WORKER_ENV": json.dumps(worker_env),
          "FAKE_GCLOUD_GRACE_S": "20", "POLL_S": "0.2", "SETTLE_S": "2"}


def make_recipe(tmp_path: pathlib.Path, source: str, workdir: pathlib.Path, *flags) -> pathlib.Path:
  result = subprocess.run(
      [sys.executable, "launch/gcp/commands.py", "--config=configs/debug_cpu.py", "--mode=tpu_vm",
       "--accelerator_type=v5p-16", "--project=p", "--zone=z", "--name=rl", f"--source={source}",
       f"--workdir={workdir}", "--workdir_is_shared", "--spot",
       f"--override=--config.total_steps={TOTAL_STEPS}", "--dry_run", *flags],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  path = tmp_path / f"recipe{len(list(tmp_path.glob('recipe*')))}.sh"
  path.write_text(result.stdout)
  return path


def _signals_as_a_terminal_gives_them() -> None:
  """A shell started from a terminal has Ctrl-C and hangup at their default actions. A test
  process started in the background (`cmd &` in a script, nohup) inherits SIGINT / SIGQUIT /
  SIGHUP ignored, and bash cannot trap a signal ignored on entry: the recipe's INT and HUP traps
  would never run (both tests below failed that way under `nohup pytest … &`)."""
  for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
    signal.signal(signum, signal.SIG_DFL)


class Driver:
  """One run of a recipe in a session of its own (a terminal's), its output in a file."""

  def __init__(self, recipe: pathlib.Path, env: dict, tmp_path: pathlib.Path, label: str):
    self.log = tmp_path / f"{label}.out"
    with open(self.log, "wb") as out:
      self.process = subprocess.Popen(["bash", str(recipe)], cwd=tmp_path, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_signals_as_a_terminal_gives_them)

  @property
  def output(self) -> str:
    return self.log.read_text()

  def wait(self, timeout_s: float = 120) -> int:
    try:
      return self.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      os.killpg(self.process.pid, signal.SIGKILL)
      raise AssertionError(f"the driver did not end: {self.output[-3000:]}") from None


def wait_for(condition, what: str, driver: Driver | None = None, timeout_s: float = 120):
  deadline = time.monotonic() + timeout_s
  while not condition():
    if driver is not None and driver.process.poll() is not None:
      raise AssertionError(f"the driver ended before {what}: {driver.output[-3000:]}")
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.1)


def steps(workdir: pathlib.Path) -> list[int]:
  return [row["step"] for row in metrics_rows(workdir)]


def homes(tmp_path: pathlib.Path, incarnation: int) -> list[pathlib.Path]:
  return sorted((tmp_path / "cloud" / "rl" / "hosts" / str(incarnation)).glob("*/worker*"))


def calls(tmp_path: pathlib.Path) -> list[list[str]]:
  return [json.loads(line) for line in
          (tmp_path / "cloud" / "calls.log").read_text().splitlines()]


def verbs(tmp_path: pathlib.Path) -> list[str]:
  return [c[3] for c in calls(tmp_path) if c[:3] == ["compute", "tpus", "queued-resources"]
          and c[3] in ("create", "delete")]


def commands_sent(tmp_path: pathlib.Path, word: str) -> int:
  """ssh calls whose worker command contains `word`."""
  return sum(1 for c in calls(tmp_path) for a in c if a.startswith("--command=") and word in a)


def preempt(tmp_path: pathlib.Path, incarnation: int) -> None:
  """A Spot preemption: SIGTERM to the pid each host recorded, then SUSPENDED."""
  for home in homes(tmp_path, incarnation):
    os.kill(int((home / "reasoning_rl" / "train.pid").read_text()), signal.SIGTERM)
  (tmp_path / "cloud" / "rl" / "state").write_text("SUSPENDED")


def starts(workdir: pathlib.Path, process: int) -> int:
  path = workdir / f"starts-p{process}"
  return len(path.read_text().splitlines()) if path.exists() else 0


def test_preemptions_do_not_count_and_a_repeated_crash_stops(tmp_path):
  """--max_restarts=1: two preemptions are recreated and resumed, a crash is restarted in place
  once, the same crash again stops the run (6) and the queued resource is deleted. Every install
  gets the commit the recipe pinned, though the repository moved on meanwhile."""
  origin = tmp_path / "origin"
  source = fake_project(origin)
  pinned = git("rev-parse", "HEAD", cwd=origin)
  workdir = tmp_path / "run"
  env = fake_cloud(tmp_path)
  driver = Driver(make_recipe(tmp_path, source, workdir, "--max_restarts=1"), env, tmp_path, "d")
  wait_for(lambda: len(steps(workdir)) >= 2, "step 2", driver)
  (origin / "NEW").write_text("moved on")  # the repository's HEAD moves after the recipe was made
  git("add", "NEW", cwd=origin)
  git("commit", "-q", "-m", "later", cwd=origin)
  for incarnation in (0, 1):
    before = len(steps(workdir))
    wait_for(lambda b=before: len(steps(workdir)) >= b + 2, "progress", driver)
    preempt(tmp_path, incarnation)
    wait_for(lambda i=incarnation: len(homes(tmp_path, i + 1)) == 2 and all(
        (h / "reasoning_rl" / "train.pid").exists() for h in homes(tmp_path, i + 1)),
        "the trainers on the recreated resource", driver)
  before = len(steps(workdir))
  wait_for(lambda: len(steps(workdir)) >= before + 1, "progress", driver)
  crash_at = steps(workdir)[-1] + 3
  (workdir / "crash_at_step").write_text(str(crash_at))
  code = driver.wait()
  out = driver.output
  assert code == 6, out[-3000:]
  assert "preemption 1 (not counted toward --max_restarts)" in out
  assert "preemption 2 (not counted toward --max_restarts)" in out
  assert "restart 1/1: the trainers crashed (exit code 1)" in out
  assert "the trainers stopped with exit code 6: not restarted" in out
  assert verbs(tmp_path) == ["create", "delete", "create", "delete", "create", "delete"]
  assert not (tmp_path / "cloud" / "rl" / "state").exists()  # deleted at the end
  # each incarnation installed once (the crash restarted in place) and got the pinned commit
  assert commands_sent(tmp_path, "install_worker.sh") == 3
  for incarnation in (0, 1, 2):
    for home in homes(tmp_path, incarnation):
      assert git("rev-parse", "HEAD", cwd=home / "reasoning_rl" / "src") == pinned
  assert not (homes(tmp_path, 2)[0] / "reasoning_rl" / "src" / "NEW").exists()
  assert steps(workdir)[-1] == crash_at - 1  # the crash happened in the step after it


def test_reconnect_lock_and_hangup(tmp_path):
  """A dropped connection to worker 0 reconnects (no second install, no second trainer); a second
  driver on the workdir is refused in one line while the first holds the lock, and touches
  nothing; a hangup ends the first driver but not the run; a new driver drives it to the end."""
  source = fake_project(tmp_path / "origin")
  workdir = tmp_path / "run"
  env = fake_cloud(tmp_path, step_s=0.4)
  recipe = make_recipe(tmp_path, source, workdir)
  first = Driver(recipe, env, tmp_path, "first")
  wait_for(lambda: len(steps(workdir)) >= 2, "step 2", first)

  second = Driver(recipe, env, tmp_path, "second")
  assert second.wait(60) == 2
  assert second.output.count("\n") == 1 and second.output.startswith(
      f"error: --workdir={workdir}: driven by ") and ":rl (heartbeat" in second.output
  assert verbs(tmp_path) == ["create"]

  follows = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_follow(int(p))]
  assert len(follows) == 1
  os.kill(follows[0], signal.SIGKILL)  # the connection drops
  wait_for(lambda: "following worker 0 again" in first.output, "a reconnection", first)

  os.killpg(first.process.pid, signal.SIGHUP)  # the terminal closes
  assert first.wait(60) == 129
  assert "hangup: rl goes on undriven" in first.output
  assert (tmp_path / "cloud" / "rl" / "state").read_text() == "ACTIVE"  # not deleted
  assert json.loads((workdir / "launcher" / "driver.lock").read_text())["record"]["owner"] is None
  progress = len(steps(workdir))
  wait_for(lambda: len(steps(workdir)) > progress + 1, "training on, undriven")

  third = Driver(recipe, env, tmp_path, "third")
  assert third.wait(120) == 0, third.output[-3000:]
  assert "the run finished" in third.output
  assert steps(workdir) == list(range(1, TOTAL_STEPS + 1))
  assert [starts(workdir, p) for p in (0, 1)] == [1, 1]  # one trainer per worker, ever
  assert commands_sent(tmp_path, "install_worker.sh") == 1
  assert verbs(tmp_path) == ["create", "delete"]


def _is_follow(pid: int) -> bool:
  """A fake gcloud process running the recipe's follow (tail of worker 0's log)."""
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
      parts = cmdline.read().split(b"\0")
  except OSError:
    return False
  return any(p.endswith(b"fake_gcloud.py") for p in parts) and any(
      b"tail -n" in p for p in parts)


def test_workers_drive_themselves(tmp_path):
  """--drive=workers: the recipe creates the queued resource with a boot script and ends; each
  worker installs the pinned commit, trains, restarts after a first crash, and copies its log to
  WORKDIR/logs/hosts/ until the run is done."""
  origin = tmp_path / "origin"
  source = fake_project(origin)
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "crash_once_at_step").write_text("5")  # each worker crashes once, then runs on
  env = fake_cloud(tmp_path, step_s=0.1)
  recipe = make_recipe(tmp_path, source, workdir, "--drive=workers")
  launched = subprocess.run(["bash", str(recipe)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
  assert launched.returncode == 0, launched.stdout + launched.stderr
  assert "its workers install and train on their own" in launched.stdout

  wait_for(lambda: steps(workdir)[-1:] == [TOTAL_STEPS] and all(
      (h / "reasoning_rl" / "exit_code").read_text().strip() == "0" for h in homes(tmp_path, 0)),
      "the end of the run", timeout_s=180)
  logs = sorted((workdir / "logs" / "hosts").glob("*.log"))
  assert [p.name for p in logs] == ["rl-w-0.log", "rl-w-1.log"]
  wait_for(lambda: all("fake trainer: step" in p.read_text() for p in logs), "the logs")
  text = logs[0].read_text()
  assert "installed: reasoning_rl from" in text and "fake trainer: crashed in step 5" in text
  assert f"fake trainer: step {TOTAL_STEPS}" in text
  assert verbs(tmp_path) == ["create"]  # nobody deleted it: its workers ran the run
  create = next(c for c in calls(tmp_path) if c[3:4] == ["create"])
  assert any(a.startswith("--metadata-from-file=startup-script=") for a in create)
  subprocess.run([sys.executable, "launch/gcp/commands.py", "--mode=down", "--project=p",
                  "--zone=z", "--name=rl"], cwd=REPO, env=env, check=True, timeout=120)


def test_ctrl_c_stops_the_run_and_deletes_the_slice(tmp_path):
  """An explicit Ctrl-C (SIGINT to the terminal's process group) deletes the queued resource:
  its hosts' shutdown sends SIGTERM to the trainers, which save the step they reached."""
  source = fake_project(tmp_path / "origin")
  workdir = tmp_path / "run"
  driver = Driver(make_recipe(tmp_path, source, workdir), fake_cloud(tmp_path), tmp_path, "d")
  wait_for(lambda: len(steps(workdir)) >= 2, "step 2", driver)
  os.killpg(driver.process.pid, signal.SIGINT)
  assert driver.wait(120) == 130, driver.output[-3000:]
  assert verbs(tmp_path) == ["create", "delete"]
  assert not (tmp_path / "cloud" / "rl" / "state").exists()
  assert int((workdir / "fake_checkpoint").read_text()) == steps(workdir)[-1] < TOTAL_STEPS


def test_a_worker_never_starts_a_second_trainer(tmp_path):
  """The start command, run twice on one worker: the second finds the first trainer alive (its
  recorded pid, running supervise.py) and starts nothing; once it ended, a start works again."""
  from launch.gcp import tpu_vm

  home = tmp_path / "home"
  (home / "reasoning_rl" / "src").mkdir(parents=True)
  sleeper = tmp_path / "launch" / "gcp" / "supervise.py"  # a trainer that runs until told
  sleeper.parent.mkdir(parents=True)
  sleeper.write_text("import pathlib, sys, time\n"
                     "while not pathlib.Path(sys.argv[1]).exists():\n  time.sleep(0.05)\n")
  stop = tmp_path / "stop"
  start = tpu_vm.worker_start(f"{sys.executable} {sleeper} {stop}")
  env = {**os.environ, "HOME": str(home)}

  def run(command):
    return subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True,
                          timeout=60)

  assert run(start).returncode == 0
  first = (home / "reasoning_rl" / "train.pid").read_text().strip()
  assert run(tpu_vm.worker_status()).stdout == "reasoning_rl worker: alive\n"
  again = run(start)
  assert again.stdout == "reasoning_rl worker: alive: not started again\n"
  assert (home / "reasoning_rl" / "train.pid").read_text().strip() == first
  stop.touch()
  wait_for(lambda: run(tpu_vm.worker_status()).stdout == "reasoning_rl worker: exit 0\n",
           "the trainer's end")
  assert run(start).returncode == 0
  assert (home / "reasoning_rl" / "train.pid").read_text().strip() != first
  (home / "reasoning_rl" / "train.pid").unlink()  # forget it: the status says "none"
  (home / "reasoning_rl" / "exit_code").unlink(missing_ok=True)
  assert run(tpu_vm.worker_status()).stdout == "reasoning_rl worker: none\n"
