"""Deadlines: no wait on storage, and no stop of the process, lasts for ever.

A store can stop answering while keeping its connections open (fake-gcs-server under load does;
so does a half-open connection to GCS). Every client then waits on its socket: the trainer once
hung 16 minutes in its exit, SIGTERM ignored. Three layers bound that (docs/storage.md,
"Deadlines"):

1. Requests (`within`): every gcsfs request, all of gcsfs's retries of it included, gets
   `timeout_s` (config `storage.timeout_s`) plus a second per `MIN_RATE_BYTES_S` bytes it
   uploads. It covers every gs:// read, write and listing (etils.epath goes through gcsfs),
   whoever makes it. The request is cancelled at its deadline.
2. Waits on other threads' work (`call`): Orbax's saves, commits, restores and close (its arrays
   go through tensorstore's own HTTP client, on its own threads), and the checksum thread. The
   wait runs in a helper thread and is given up at its deadline (the helper stays behind,
   blocked; it is a daemon thread).
   Past a deadline of either layer the store counts as stalled: `StorageTimeout` (a
   CheckpointError: exit 4) names what was waiting, where, and the checkpoint a rerun resumes
   from; every later storage call fails at once with it, so the way out (copying the last
   metrics, closing the checkpoint manager) waits for nothing.
3. The end of the process, once its owner (launch/train.py) called `enable_process_exit()`: a
   stop signal (`exit_by`, from the SIGTERM / SIGINT handler) or a stall leaves the orderly path
   `stop_deadline_s` (config `checkpoint.stop_deadline_s`); past it one line is printed and the
   process ends with the decided code (143, 130 or 4) at once (`os._exit`). At interpreter exit
   after a stall, threads still blocked on storage are not waited for either. A library user
   (a notebook) never gets these hard exits: only the process's owner turns them on.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import itertools
import logging
import os
import sys
import threading
import time
from typing import Any, Awaitable, Callable, TypeVar

from reasoning_rl.errors import ExitCode, StorageTimeout

log = logging.getLogger("reasoning_rl")

T = TypeVar("T")

# A transfer of B bytes gets B / MIN_RATE_BYTES_S seconds beyond `timeout_s`: the slowest a
# healthy store is assumed to move data for one process (GCS moves hundreds of MB/s per VM).
MIN_RATE_BYTES_S = 10 * 2**20


@dataclasses.dataclass
class Settings:
  timeout_s: float = 120.0  # one storage call, its retries included (storage.timeout_s)
  stop_deadline_s: float = 25.0  # a stop signal to the process's end (checkpoint.stop_deadline_s)


settings = Settings()


def configure(*, timeout_s: float | None = None, stop_deadline_s: float | None = None) -> None:
  if timeout_s is not None:
    settings.timeout_s = float(timeout_s)
  if stop_deadline_s is not None:
    settings.stop_deadline_s = float(stop_deadline_s)


def apply_config(config) -> None:
  """The deadlines a training config sets (`storage.timeout_s`, `checkpoint.stop_deadline_s`)."""
  configure(timeout_s=config.storage.timeout_s,
            stop_deadline_s=config.checkpoint.stop_deadline_s)


def deadline_for(nbytes: int = 0) -> float:
  """Seconds a storage call moving `nbytes` may take."""
  return settings.timeout_s + max(0, nbytes) / MIN_RATE_BYTES_S


# ------------------------------------------------------------------------------ what waits

_in_flight: dict[int, tuple[str, str, float]] = {}  # token -> (what, where, since)
_tokens = itertools.count()
_registry_lock = threading.Lock()
_phase = ""  # what the run is doing, for the hard exit's line when no storage call is waiting


def set_phase(text: str) -> None:
  """What the run is doing now ("training step 7"), named by a hard exit if nothing waits on
  storage then."""
  global _phase
  _phase = text


@contextlib.contextmanager
def _tracked(what: str, where: str):
  token = next(_tokens)
  with _registry_lock:
    _in_flight[token] = (what, where, time.monotonic())
  try:
    yield
  finally:
    with _registry_lock:
      _in_flight.pop(token, None)


def waiting_on() -> str:
  """The oldest storage call in flight ("what (where) for N s"), else the phase, else ""."""
  with _registry_lock:
    entries = sorted(_in_flight.values(), key=lambda entry: entry[2])
  if entries:
    what, where, since = entries[0]
    return f"{what} ({where}) for {time.monotonic() - since:.0f} s"
  return _phase


_resume_point: Callable[[], str] | None = None


def set_resume_point(describe: Callable[[], str] | None) -> None:
  """`describe()` says, without any I/O, which checkpoint a rerun resumes from (the trainer's
  Checkpointer); every StorageTimeout and hard-exit line ends with it."""
  global _resume_point
  _resume_point = describe


def resume_point() -> str:
  if _resume_point is not None:
    try:
      return _resume_point()
    except Exception:  # pylint: disable=broad-except  # a message must not fail
      pass
  return "the newest complete checkpoint under WORKDIR/checkpoints"


# ------------------------------------------------------------------------------ stalls

_stall: str | None = None  # the first StorageTimeout's message


def stalled() -> str | None:
  """The message of the first storage deadline that passed in this process, or None."""
  return _stall


def reset() -> None:
  """Forgets a stall and a decided exit that never happened (tests; a notebook retrying)."""
  global _stall
  _stall = None
  _exit.disarm()


def _check_not_stalled() -> None:
  """After a stall every storage call fails at once, with the first one's message: the run's
  one line stays the same whichever call raises last on the way out."""
  if _stall is not None:
    raise StorageTimeout(_stall)


def timed_out(what: str, where: str, waited_s: float) -> StorageTimeout:
  """The StorageTimeout for `what` (a noun phrase: "a GET request", "Orbax's commit of
  checkpoint step 3") at `where` after `waited_s`; marks the store stalled (later calls fail at
  once) and, in a process that allows it, schedules its exit (code 4)."""
  global _stall
  doing = f" while {_phase}" if _phase else ""
  message = (f"{where}: storage stalled: {what} did not finish within {waited_s:.0f} s "
             f"(storage.timeout_s, retries included){doing}; a rerun on the same workdir resumes "
             f"from {resume_point()}")
  if _stall is None:
    _stall = message
    log.info("storage deadline passed: %s", message)  # the launcher prints the error line
    exit_by(ExitCode.STORAGE, lambda: f"error: StorageTimeout: {message} (the way out did not "
            f"finish within checkpoint.stop_deadline_s either; still {waiting_on()})")
  return StorageTimeout(message)


async def within(awaitable: Awaitable[T], *, what: str, where: str, nbytes: int = 0) -> T:
  """`await awaitable` with the deadline of a storage call moving `nbytes` (layer 1)."""
  if _stall is not None:
    if asyncio.iscoroutine(awaitable):
      awaitable.close()
    _check_not_stalled()
  limit = deadline_for(nbytes)
  with _tracked(what, where):
    scope = asyncio.timeout(limit)
    try:
      async with scope:
        return await awaitable
    except TimeoutError:
      if scope.expired():  # ours; a timeout of the request itself is gcsfs's error to report
        raise timed_out(what, where, limit) from None
      raise


def call(fn: Callable[..., T], *args: Any, what: str, where: str, nbytes: int = 0,
         **kwargs: Any) -> T:
  """`fn(*args, **kwargs)` in a helper thread, waited for until the deadline of a storage call
  moving `nbytes`; its result, or its exception re-raised here (layer 2).

  While waiting the calling thread still runs signal handlers (the main thread's SIGTERM)."""
  _check_not_stalled()
  limit = deadline_for(nbytes)
  outcome: dict[str, Any] = {}
  done = threading.Event()
  context = contextvars.copy_context()

  def target():
    with _tracked(what, where):
      try:
        outcome["value"] = context.run(fn, *args, **kwargs)
      except BaseException as error:  # pylint: disable=broad-except  # re-raised by the caller
        outcome["error"] = error
      finally:
        done.set()

  threading.Thread(target=target, name=f"storage: {what}", daemon=True).start()
  if not done.wait(limit):
    raise timed_out(what, where, limit)
  if "error" in outcome:
    raise outcome["error"]
  return outcome["value"]


# ------------------------------------------------------------------------------ the process's end


class _ProcessExit:
  """One daemon thread that ends the process at a decided deadline (layer 3)."""

  def __init__(self):
    self.enabled = False
    self._armed = threading.Event()
    self._disarmed = threading.Event()
    self.code: int | None = None
    self.line: str | Callable[[], str] = ""
    self.at = 0.0

  def enable(self) -> None:
    if self.enabled:
      return
    self.enabled = True
    threading.Thread(target=self._watch, name="deadlines: process exit", daemon=True).start()
    # Python calls these hooks in reverse order of registration, before it joins the remaining
    # threads. concurrent.futures registers one that joins every pool's workers (Orbax's among
    # them) when first imported: imported now, its hook runs after ours.
    import concurrent.futures.thread  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
      register(self._at_interpreter_exit)

  def arm(self, code: int, line: str | Callable[[], str], after_s: float) -> None:
    # No lock: this runs in signal handlers. The first decision stands.
    if not self.enabled or self._armed.is_set():
      return
    self.code, self.line, self.at = int(code), line, time.monotonic() + after_s
    self._disarmed.clear()
    self._armed.set()

  def disarm(self) -> None:
    self._armed.clear()
    self.code = None
    self._disarmed.set()

  def _watch(self) -> None:
    while True:
      self._armed.wait()
      if self._disarmed.wait(max(0.0, self.at - time.monotonic())):
        continue
      if self._armed.is_set() and self.code is not None:
        try:
          line = self.line() if callable(self.line) else self.line
        except Exception as error:  # pylint: disable=broad-except  # the exit must happen
          line = f"exiting ({error!r} while describing why)"
        _hard_exit(self.code, line)

  def _at_interpreter_exit(self) -> None:
    """Before Python joins the remaining threads: after a stall some of them wait on storage
    for ever (Orbax's, concurrent.futures workers), and joining them would hang the exit."""
    if _stall is not None:
      _hard_exit(self.code if self.code is not None else ExitCode.STORAGE, "")


_exit = _ProcessExit()


def enable_process_exit() -> None:
  """Lets this process end itself at the deadlines of layer 3 (the launcher's call)."""
  _exit.enable()


def exit_by(code: int, line: str | Callable[[], str], *, after_s: float | None = None) -> None:
  """Ends the process with `code`, printing `line` (or what `line()` returns then), if it is
  still running `after_s` (default `stop_deadline_s`) from now. The first call stands; a no-op
  unless `enable_process_exit()` was called. Safe in a signal handler (no lock, no I/O)."""
  _exit.arm(code, line, settings.stop_deadline_s if after_s is None else after_s)


def _hard_exit(code: int, line: str) -> None:
  try:
    if line:
      print(line, file=sys.stderr, flush=True)
      log.info("%s", line)  # the print above is the terminal's line
    for stream in (sys.stdout, sys.stderr):
      with contextlib.suppress(Exception):
        stream.flush()
    for handler in logging.getLogger().handlers + log.handlers:
      with contextlib.suppress(Exception):
        handler.flush()
  finally:
    os._exit(int(code))  # pylint: disable=protected-access
