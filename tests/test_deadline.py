"""The killable helper processes behind the math verifier's deadline."""

import concurrent.futures
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest

from reasoning_rl.verifiers import deadline


def _spin_forever():
  while True:
    pass


def _swallowing_spin(seconds):
  """Catches every exception it can: an in-thread 'interrupt' could never stop this."""
  end = time.monotonic() + seconds
  while time.monotonic() < end:
    try:
      sum(range(1000))
    except BaseException:
      pass
  return "finished"


def _pid():
  return os.getpid()


def _unpicklable():
  return threading.Lock()  # pickling it raises TypeError, not PicklingError


def _fail(message):
  raise ValueError(message)


@pytest.fixture(scope="module")
def runner():
  r = deadline.DeadlineRunner(preload="os")
  yield r
  r.close()


def test_result_and_reuse(runner):
  first = runner.run(_pid, timeout_s=30)
  assert first != os.getpid()
  assert runner.run(_pid, timeout_s=30) == first  # the idle helper is reused


def test_exception_comes_back_and_helper_survives(runner):
  before = runner.run(_pid, timeout_s=30)
  with pytest.raises(ValueError, match="bad input"):
    runner.run(_fail, "bad input", timeout_s=30)
  assert runner.run(_pid, timeout_s=30) == before


def test_a_function_sent_by_name_is_imported_by_the_helper_only(tmp_path, monkeypatch):
  """`FunctionByName`: the caller sends module and name; the helper imports the module and calls
  the function there, and the calling process never loads it."""
  (tmp_path / "probe_sent_by_name.py").write_text("def triple(x):\n  return 3 * x\n")
  monkeypatch.syspath_prepend(str(tmp_path))  # the helper inherits the path when it starts
  runner = deadline.DeadlineRunner(preload="os")
  try:
    assert runner.run(deadline.FunctionByName("probe_sent_by_name", "triple"), 14,
                      timeout_s=30) == 42
    with pytest.raises(AttributeError):
      runner.run(deadline.FunctionByName("probe_sent_by_name", "missing"), timeout_s=30)
  finally:
    runner.close()
  assert "probe_sent_by_name" not in sys.modules


def test_unpicklable_result_is_an_error_and_helper_survives(runner):
  before = runner.run(_pid, timeout_s=30)
  with pytest.raises(deadline.HelperFailed, match="not picklable"):
    runner.run(_unpicklable, timeout_s=30)
  assert runner.run(_pid, timeout_s=30) == before


def test_timeout_kills_the_helper(runner):
  before = runner.run(_pid, timeout_s=30)
  t0 = time.monotonic()
  with pytest.raises(deadline.DeadlineExceeded):
    runner.run(_spin_forever, timeout_s=0.3)
  assert time.monotonic() - t0 < 5
  with pytest.raises(ProcessLookupError):  # killed and reaped
    os.kill(before, 0)
  assert runner.run(_pid, timeout_s=30) not in (before, None)


def test_code_that_swallows_exceptions_still_times_out(runner):
  """The failure of in-thread interrupts: this would have run its full 60 s."""
  t0 = time.monotonic()
  with pytest.raises(deadline.DeadlineExceeded):
    runner.run(_swallowing_spin, 60.0, timeout_s=0.3)
  assert time.monotonic() - t0 < 5
  assert runner.run(_swallowing_spin, 0.01, timeout_s=30) == "finished"


def test_concurrent_callers_get_their_own_helpers(runner):
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    slow = [pool.submit(runner.run, _spin_forever, timeout_s=0.5) for _ in range(2)]
    fast = pool.submit(runner.run, _pid, timeout_s=30)
    assert fast.result() != os.getpid()
    for future in slow:
      with pytest.raises(deadline.DeadlineExceeded):
        future.result()


def _run_in_daemon(queue):
  r = deadline.DeadlineRunner(preload="os")
  try:
    r.run(_spin_forever, timeout_s=0.3)
    queue.put("no timeout")
  except deadline.DeadlineExceeded:
    queue.put(r.run(_pid, timeout_s=30) != os.getpid())
  finally:
    r.close()


def test_works_inside_a_daemonic_process():
  """VerifierPool workers are daemonic; multiprocessing would refuse to give them children."""
  ctx = multiprocessing.get_context("spawn")
  queue = ctx.Queue()
  process = ctx.Process(target=_run_in_daemon, args=(queue,), daemon=True)
  process.start()
  assert queue.get(timeout=120) is True
  process.join(30)
  assert process.exitcode == 0


_FORK_SCENARIO = """
import os, sys
from reasoning_rl.verifiers import deadline
runner = deadline.DeadlineRunner(preload="os")
parent_helper = runner.run(os.getpid, timeout_s=60)
read_end, write_end = os.pipe()
child = os.fork()
if child == 0:
  os.write(write_end, str(runner.run(os.getpid, timeout_s=60)).encode())
  os._exit(0)
os.close(write_end)
child_helper = int(os.read(read_end, 64).decode())
os.waitpid(child, 0)
assert child_helper not in (parent_helper, os.getpid(), child), (child_helper, parent_helper)
assert runner.run(os.getpid, timeout_s=60) == parent_helper  # the parent's helper is untouched
print("ok")
"""


def test_a_forked_child_starts_its_own_helpers():
  # In a fresh interpreter: forking this pytest process, whose JAX threads are running, is unsafe.
  result = subprocess.run([sys.executable, "-c", _FORK_SCENARIO], capture_output=True, text=True,
                          timeout=180)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "ok"
