"""Run a function under a wall-clock deadline in a helper process that is killed when time is up.

Why a process: a Python thread cannot be stopped from outside. Raising an asynchronous exception in
it (`PyThreadState_SetAsyncExc`, or a signal handler in the main thread) is only a request, and it
can land where it is swallowed — inside a weakref callback or a `__del__` ("Exception ignored in …")
— after which sympy simply grinds on for minutes while the caller waits. Worse, landing between a
lock's acquire and its `try` leaves the lock held forever. A process can always be killed.

Helpers are started with `subprocess` (not `multiprocessing`), so this works inside daemonic
worker processes such as `VerifierPool`'s, and from any thread; they are reused between calls (one
per concurrent caller) and replaced after a kill. A helper exits when its parent goes away.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from reasoning_rl.verifiers.request_loop import answer_requests

# Importing sympy and math-verify in a fresh interpreter takes a second or two, more on a loaded
# machine; that start-up is not charged to the caller's deadline but it is bounded.
STARTUP_TIMEOUT_S = 300.0


class DeadlineExceeded(Exception):
  """The function did not return within its deadline; its helper process was killed."""


class HelperFailed(RuntimeError):
  """The helper process died or could not start (not a timeout)."""


@dataclasses.dataclass(frozen=True)
class FunctionByName:
  """A module-level function named by module and name, callable like it: `DeadlineRunner.run`
  sends the name, and only the helper imports the module. A caller that never imports what the
  function needs stays light (`math_answers` judges with sympy and math-verify in its helpers,
  a second of imports its trainer process does without)."""

  module: str
  name: str

  def __call__(self, *args: Any) -> Any:
    return getattr(importlib.import_module(self.module), self.name)(*args)


class _Helper:
  """One helper interpreter connected by a socket pair; runs `(fn, args)` requests one at a time."""

  def __init__(self, preload: str):
    parent_sock, child_sock = socket.socketpair()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    code = (f"from reasoning_rl.verifiers.deadline import _serve; "
            f"_serve({child_sock.fileno()}, {preload!r})")
    self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(child_sock.fileno(),),
                                    env=env, stdin=subprocess.DEVNULL)
    child_sock.close()
    self.conn = Connection(parent_sock.detach())
    if not self.conn.poll(STARTUP_TIMEOUT_S):
      self.kill()
      raise HelperFailed(f"deadline helper did not start within {STARTUP_TIMEOUT_S:.0f}s")
    try:
      self.conn.recv()  # the "ready" message, sent once `preload` is imported
    except EOFError as e:
      self.kill()
      raise HelperFailed(f"deadline helper exited during start-up (code {self.process.wait()})") from e

  def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> tuple[bool, Any]:
    """(True, result) or (False, the exception `fn` raised); kills itself on timeout or death."""
    try:
      self.conn.send((fn, args))
      ready = self.conn.poll(timeout_s)
      if ready:
        ok, value = self.conn.recv()
    except (EOFError, OSError) as e:
      self.kill()
      raise HelperFailed(f"deadline helper died (exit code {self.process.poll()})") from e
    if not ready:
      self.kill()
      raise DeadlineExceeded(f"{getattr(fn, '__name__', fn)} did not return within {timeout_s}s")
    return ok, value

  def kill(self) -> None:
    self.process.kill()
    self.process.wait()
    self.conn.close()


class DeadlineRunner:
  """A pool of reusable helper processes; `run` may be called from any number of threads."""

  def __init__(self, preload: str):
    self._preload = preload
    self._idle: list[_Helper] = []
    self._lock = threading.Lock()
    atexit.register(self.close)
    # A forked child must not share its parent's helpers (two writers on one socket).
    os.register_at_fork(after_in_child=self._forget_inherited)

  def _forget_inherited(self) -> None:
    self._idle = []
    self._lock = threading.Lock()

  def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """`fn(*args)` in a helper; raises `DeadlineExceeded` after `timeout_s` seconds of wall time.

    `fn`, its arguments and its result must be picklable (`fn` a module-level function or a
    `FunctionByName`)."""
    with self._lock:
      helper = self._idle.pop() if self._idle else None
    if helper is None:
      helper = _Helper(self._preload)
    try:
      ok, value = helper.call(fn, args, timeout_s)
    except (DeadlineExceeded, HelperFailed):
      raise  # the helper is dead already
    except BaseException:
      helper.kill()  # interrupted mid-request (KeyboardInterrupt): its reply would be out of step
      raise
    with self._lock:
      self._idle.append(helper)
    if not ok:
      raise value
    return value

  def close(self) -> None:
    with self._lock:
      idle, self._idle = self._idle, []
    for helper in idle:
      helper.kill()


def _exit_when_orphaned(parent_pid: int) -> None:
  """A parent killed mid-request never closes the socket while we compute; notice it ourselves.
  (Not PR_SET_PDEATHSIG: that fires when the *thread* that started us ends, and callers are often
  short-lived pool threads.)"""
  while os.getppid() == parent_pid:
    time.sleep(1.0)
  os._exit(0)


def _serve(fd: int, preload: str) -> None:
  """The helper's main loop: import `preload`, say ready, then answer requests until EOF."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which kills us
  threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
  __import__(preload)

  def answer(request):
    fn, args = request
    try:
      return True, fn(*args)
    except Exception as e:  # sent back and re-raised in the caller
      return False, e

  def unsendable(request, error):
    return False, HelperFailed(f"result of {request[0]!r} is not picklable: {error}")

  answer_requests(Connection(fd), "ready", answer, unsendable)
