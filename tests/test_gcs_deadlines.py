"""Every wait on storage has a deadline (issue 49): a gs:// debug run behind a relay that goes
silent (tests/storage_relay.py: sockets stay open, nothing is relayed) exits 4 within
`storage.timeout_s` naming the checkpoint a rerun resumes from; SIGTERM ends it within
`checkpoint.stop_deadline_s` while a save waits on the silent store (143); a slowed store only
slows the run; and across all of these stops the run loses no step: it ends with one metrics row
per step, equal to an uninterrupted local run's.

Against a real emulator (fake-gcs-server, tests/gcs_emulator.py) behind the relay; only
STORAGE_EMULATOR_HOST is set, as a user would.
"""

import asyncio
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from reasoning_rl import checkpoint_manifest, deadlines
from reasoning_rl.checkpointing import Checkpointer
from reasoning_rl.errors import StorageTimeout
from reasoning_rl.metrics import read_metrics
from reasoning_rl.trainer import SaveCadence
from tests import gcs_emulator
from tests.multihost_runs import REPO, environment
from tests.storage_relay import Relay
from tests.support.runs import stable


BUCKET = "rrl-deadlines"
STEPS = 6
COMMON = (f"--config.total_steps={STEPS}", "--config.checkpoint.every_steps=1",
          "--config.checkpoint.keep=10", "--config.eval.num_examples=4",
          "--config.logging.progress_bar=False")


# ------------------------------------------------------------------------------ the layers alone


@pytest.fixture
def short_deadlines():
  saved = (deadlines.settings.timeout_s, deadlines.settings.stop_deadline_s)
  deadlines.configure(timeout_s=0.5)
  deadlines.reset()
  yield
  deadlines.configure(timeout_s=saved[0], stop_deadline_s=saved[1])
  deadlines.reset()


def test_a_wait_past_its_deadline_stalls_the_store_and_later_calls_fail_at_once(
    short_deadlines):
  deadlines.set_resume_point(lambda: "step 7 (gs://b/run/checkpoints/7)")
  try:
    assert deadlines.call(lambda x: x + 1, 1, what="a quick call", where="gs://b/x") == 2
    with pytest.raises(ValueError, match="its own error"):  # errors come back as they are
      deadlines.call(lambda: (_ for _ in ()).throw(ValueError("its own error")),
                     what="a failing call", where="gs://b/x")
    start = time.monotonic()
    with pytest.raises(StorageTimeout) as raised:
      deadlines.call(time.sleep, 30, what="Orbax's commit of checkpoint step 8",
                     where="gs://b/run/checkpoints/8")
    assert 0.4 < time.monotonic() - start < 10
    message = str(raised.value)
    assert message.startswith("gs://b/run/checkpoints/8: storage stalled: Orbax's commit of "
                              "checkpoint step 8 did not finish within 0 s")
    assert message.endswith("resumes from step 7 (gs://b/run/checkpoints/7)")
    assert deadlines.stalled() == message
    start = time.monotonic()
    ran = []
    for attempt in (lambda: deadlines.call(ran.append, 1, what="a later call", where="x"),
                    lambda: asyncio.run(deadlines.within(asyncio.sleep(0), what="a request",
                                                         where="y"))):
      with pytest.raises(StorageTimeout) as again:
        attempt()
      assert str(again.value) == message  # the run's one line stays the same
    assert ran == [] and time.monotonic() - start < 1  # nothing ran, nothing waited
  finally:
    deadlines.set_resume_point(None)


def test_a_request_past_its_deadline_is_cancelled(short_deadlines):
  cancelled = []

  async def silent_server():
    try:
      await asyncio.sleep(30)
    except asyncio.CancelledError:
      cancelled.append(True)
      raise

  start = time.monotonic()
  with pytest.raises(StorageTimeout, match="gs://b/o: storage stalled: a GET request"):
    asyncio.run(deadlines.within(silent_server(), what="a GET request", where="gs://b/o"))
  assert cancelled == [True] and time.monotonic() - start < 10
  assert deadlines.deadline_for(20 * 2**20) == pytest.approx(0.5 + 2.0)  # 10 MiB/s on top


_HARD_EXIT = textwrap.dedent("""
    import signal, sys, threading, time
    from reasoning_rl import deadlines, stop_signals
    deadlines.configure(stop_deadline_s=float(sys.argv[1]))
    if sys.argv[2] == "owner":
      deadlines.enable_process_exit()
    stop_signals.install_preemption_handler()
    deadlines.set_resume_point(lambda: "step 3 (/w/checkpoints/3)")
    deadlines.set_phase("saving checkpoint step 4")
    print("ready", flush=True)
    threading.Event().wait(60)  # a stop path stuck for good
    print("never")
""")


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stuck_stop_ends_at_the_stop_deadline_with_the_signals_code(signum, code):
  child = subprocess.Popen([sys.executable, "-c", _HARD_EXIT, "2", "owner"], cwd=REPO,
                           env={**environment(devices=1), "PYTHONPATH": str(REPO)},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert child.stdout.readline().strip() == "ready"
  child.send_signal(signum)
  start = time.monotonic()
  out, err = child.communicate(timeout=60)
  assert child.returncode == code, err
  assert 1.5 < time.monotonic() - start < 30
  name = signal.Signals(signum).name
  assert err.strip().splitlines()[-1] == (
      f"{'preempted' if code == 143 else 'interrupted'} ({name}): not stopped within "
      "checkpoint.stop_deadline_s=2 s (still saving checkpoint step 4); exiting now without "
      "finishing it; a rerun on the same workdir resumes from step 3 (/w/checkpoints/3)")
  assert "never" not in out


_STALLED_EXIT = textwrap.dedent("""
    import concurrent.futures, sys, threading, time
    from reasoning_rl import deadlines
    from reasoning_rl.errors import StorageTimeout
    deadlines.configure(timeout_s=0.5, stop_deadline_s=60)
    deadlines.enable_process_exit()
    pool = concurrent.futures.ThreadPoolExecutor(1)  # its worker is joined at exit, as Orbax's
    pool.submit(threading.Event().wait)  # blocked for good, like a request to a silent store
    try:
      deadlines.call(time.sleep, 30, what="a commit", where="gs://b/c")
    except StorageTimeout as error:
      print("error:", error, flush=True)
    sys.exit(4)
""")


def test_after_a_stall_the_exit_does_not_wait_for_threads_blocked_on_storage():
  start = time.monotonic()
  child = subprocess.run([sys.executable, "-c", _STALLED_EXIT], cwd=REPO, capture_output=True,
                         env={**environment(devices=1), "PYTHONPATH": str(REPO)}, text=True,
                         timeout=120)
  assert child.returncode == 4, child.stderr
  assert child.stdout.startswith("error: gs://b/c: storage stalled: a commit did not finish")
  assert time.monotonic() - start < 30  # not the 60 s stop deadline, not for ever


def test_a_library_user_is_never_hard_exited():
  """Without the process owner's `enable_process_exit` (a notebook) a signal only sets the
  stop flag."""
  child = subprocess.Popen([sys.executable, "-c", _HARD_EXIT.replace("wait(60)", "wait(4)"),
                            "0.5", "library"], cwd=REPO,
                           env={**environment(devices=1), "PYTHONPATH": str(REPO)},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert child.stdout.readline().strip() == "ready"
  child.send_signal(signal.SIGTERM)
  out, _ = child.communicate(timeout=60)
  assert child.returncode == 0 and out.strip() == "never"


def test_time_based_saves_follow_the_clock_and_skip_while_a_save_is_in_flight():
  now = [0.0]
  cadence = SaveCadence(every_steps=100, every_minutes=1.0, total_steps=10,
                        clock=lambda: now[0])
  due = []
  for step in range(1, 11):
    now[0] += 25.0  # a 25 s step
    in_flight = step == 6
    if cadence.due(step, saving=in_flight):
      due.append(step)
      cadence.saved()
  # 75 s after the start (step 3), 75 s after that (6 is in flight: 7), then 9 and the last
  assert due == [3, 7, 10]
  assert not SaveCadence(5, 0.0, 10).by_time
  assert [s for s in range(1, 11) if SaveCadence(5, 0.0, 10).due(s)] == [5, 10]


# ------------------------------------------------------------------------------ whole runs


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  with gcs_emulator.serving(tmp_path_factory.mktemp("gcs"), BUCKET) as server:
    yield server


@pytest.fixture
def relay(emulator):
  r = Relay(int(emulator.url.rsplit(":", 1)[1]))
  yield r
  r.close()


def test_a_stalled_store_at_start_up_is_exit_4_not_a_bad_workdir(emulator, short_deadlines):
  """check_workdir_writable turns gcsfs's errors into 'cannot be written' (exit 2); a store that
  stopped answering is a storage failure (exit 4) instead."""
  from reasoning_rl.workdir import check_workdir_writable

  with pytest.raises(StorageTimeout):
    deadlines.call(time.sleep, 30, what="an earlier call", where=f"gs://{BUCKET}/x")
  with pytest.raises(StorageTimeout, match="an earlier call"):
    check_workdir_writable(f"gs://{BUCKET}/run", field="config.workdir")


def _complete_steps(emulator, prefix: str) -> list[int]:
  return emulator.complete_checkpoints(BUCKET, prefix)


def _start(workdir, relay, tmp_path, *overrides):
  env = {**environment(devices=1), "STORAGE_EMULATOR_HOST": relay.url,
         "REASONING_RL_CACHE": str(tmp_path / "cache")}
  command = [sys.executable, str(REPO / "launch" / "train.py"), "--config=configs/debug_cpu.py",
             f"--config.workdir={workdir}", *COMMON, *overrides]
  return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _wait_for_step(process, emulator, prefix, step, timeout_s=600):
  deadline = time.monotonic() + timeout_s
  while max(_complete_steps(emulator, prefix), default=0) < step:
    assert process.poll() is None, process.communicate()[1][-3000:]
    assert time.monotonic() < deadline, f"checkpoint {step} never appeared"
    time.sleep(0.1)


def _resumes_from(line: str) -> int:
  found = re.search(r"resumes from step (\d+)", line)
  assert found, line
  return int(found.group(1))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted run, local, on the runs' one device (another device count sums in
  another order)."""
  workdir = tmp_path_factory.mktemp("reference")
  done = subprocess.run(
      [sys.executable, str(REPO / "launch" / "train.py"), "--config=configs/debug_cpu.py",
       f"--config.workdir={workdir}", *COMMON], cwd=REPO, env=environment(devices=1),
      capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return read_metrics(workdir / "metrics.jsonl")


def test_a_run_survives_a_slow_store_a_silent_one_and_stops_losing_no_step(
    emulator, relay, reference, tmp_path):
  """Four processes on one gs:// workdir, checkpoints every step, storage behind the relay:
  1. the store is slow and SIGTERM arrives: the orderly stop waits for the slow saves and saves
     the step it is at (143, every checkpoint complete, nothing lost);
  2. the store goes silent after a checkpoint: exit 4 once storage.timeout_s passed, one line
     naming the checkpoint a rerun resumes from;
  3. SIGTERM while a save waits on the silent store: exit 143 at checkpoint.stop_deadline_s;
  4. the store is back: the run finishes.
  The metrics then hold each step once and equal an uninterrupted local run's. (This process
  reads the workdir from the emulator directly, past the relay.)"""
  prefix = f"deadlines-{time.time_ns()}"
  workdir = f"gs://{BUCKET}/{prefix}"

  relay.slow(300_000)  # bytes per second: each 1 MB checkpoint takes seconds
  first = _start(workdir, relay, tmp_path, "--config.checkpoint.stop_deadline_s=300")
  _wait_for_step(first, emulator, prefix, 1)
  first.send_signal(signal.SIGTERM)
  _, err = first.communicate(timeout=600)
  assert first.returncode == 143, err[-3000:]
  relay.relay()
  stopped = [r["step"] for r in read_metrics(f"{workdir}/metrics.jsonl")][-1]
  with Checkpointer(f"{workdir}/checkpoints") as ckpt:
    assert ckpt.all_steps()[-1] == stopped  # the stop saved the step it was at
    for step in ckpt.all_steps():  # each complete, checksums included, before the exit
      assert checkpoint_manifest.verify_checksums(f"{workdir}/checkpoints/{step}"), step

  second = _start(workdir, relay, tmp_path, "--config.storage.timeout_s=10")
  _wait_for_step(second, emulator, prefix, stopped + 1)
  relay.silence()
  silent_at = time.monotonic()
  _, err = second.communicate(timeout=300)
  waited = time.monotonic() - silent_at
  line = err.strip().splitlines()[-1]
  assert second.returncode == 4, err[-3000:]
  assert line.startswith("error: StorageTimeout: gs://") and "storage stalled" in line, line
  assert 9 < waited < 10 + 60, waited  # the deadline, the way out and a loaded machine's slack
  relay.relay()
  resumes = _resumes_from(line)
  assert max(_complete_steps(emulator, prefix)) in (resumes, resumes + 1)

  third = _start(workdir, relay, tmp_path, "--config.checkpoint.stop_deadline_s=8")
  resumed = max(_complete_steps(emulator, prefix))
  _wait_for_step(third, emulator, prefix, resumed + 1)
  relay.silence()
  time.sleep(1.0)  # the next save is now waiting on the silent store
  third.send_signal(signal.SIGTERM)
  signalled = time.monotonic()
  _, err = third.communicate(timeout=300)
  waited = time.monotonic() - signalled
  line = err.strip().splitlines()[-1]
  assert third.returncode == 143, err[-3000:]
  assert line.startswith("preempted (SIGTERM): not stopped within "
                         "checkpoint.stop_deadline_s=8 s"), line
  assert 7 < waited < 8 + 30, waited
  relay.relay()
  resumes = _resumes_from(line)
  assert max(_complete_steps(emulator, prefix)) in (resumes, resumes + 1)

  fourth = _start(workdir, relay, tmp_path)
  _, err = fourth.communicate(timeout=600)
  assert fourth.returncode == 0, err[-3000:]
  rows = read_metrics(f"{workdir}/metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert stable(rows) == stable(reference)
  # every step's checkpoint is complete: those the stops cut short were redone by the reruns
  assert _complete_steps(emulator, prefix) == list(range(1, STEPS + 1))
  assert checkpoint_manifest.verify_checksums(f"{workdir}/checkpoints/{STEPS}")
