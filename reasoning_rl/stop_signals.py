"""Stopping a run on a signal: SIGTERM (preemption) and SIGINT (Ctrl-C) become a flag.

`install_preemption_handler()` turns both signals into a flag the training loop polls with
`preemption_requested()`. The loop then saves (`Checkpointer.save(step, …, force=True)`), closes
the Checkpointer and exits with `interrupt_exit_code()`: 143 for SIGTERM, 130 for SIGINT. A second
Ctrl-C aborts at once with KeyboardInterrupt. In a process that allows it
(`deadlines.enable_process_exit`, launch/train.py) the signal also starts the stop deadline: if the
orderly path has not ended the process within `checkpoint.stop_deadline_s` (a save stuck on a
silent store, a step that outlasts a preemption notice), it ends there with the same code and one
line naming what it was still doing and the checkpoint a rerun resumes from.
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

from reasoning_rl import deadlines
from reasoning_rl.errors import ExitCode

_preemption_event = threading.Event()
_stop_signals: list[int] = []  # the signal that set the flag (first one only)


def install_preemption_handler(
    callback: Callable[[int], None] | None = None) -> Callable[[], None]:
  """Makes SIGTERM and SIGINT set the flag `preemption_requested()` reports, then call
  `callback(signum)`; returns a function that puts the previous handlers back.

  The handler does no I/O itself (a signal can arrive mid-save or mid-print); the loop polls the
  flag once per step, saves with `force=True`, closes the Checkpointer and exits with
  `interrupt_exit_code()`. A SIGINT arriving once the flag is set (the second Ctrl-C) raises
  KeyboardInterrupt at once and restores Python's default SIGINT handling. Must be called from
  the main thread (a Python rule for signal handlers). The flag is per process: on a multi-host
  slice the loop must agree on the step to save at across hosts (e.g.
  `jax.experimental.multihost_utils.reached_preemption_sync_point`) before saving; this function
  does not do that.
  """

  def handle(signum, frame):
    del frame
    if _preemption_event.is_set():
      if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt
      return
    _stop_signals[:] = [signum]
    _preemption_event.set()
    deadlines.exit_by(128 + signum, lambda: _stop_deadline_line(signum))
    if callback is not None:
      callback(signum)

  previous = {signum: signal.signal(signum, handle) for signum in (signal.SIGTERM, signal.SIGINT)}

  def uninstall() -> None:
    for signum, handler in previous.items():
      signal.signal(signum, handler)

  return uninstall


def _stop_deadline_line(signum: int) -> str:
  """The line of a stop that the orderly path did not finish in time (deadlines.exit_by)."""
  ending = "preempted" if signum == signal.SIGTERM else "interrupted"
  doing = deadlines.waiting_on()
  return (f"{ending} ({signal.Signals(signum).name}): not stopped within "
          f"checkpoint.stop_deadline_s={deadlines.settings.stop_deadline_s:g} s"
          + (f" (still {doing})" if doing else "") + "; exiting now without finishing it; a "
          f"rerun on the same workdir resumes from {deadlines.resume_point()}")


def preemption_requested() -> bool:
  """True once SIGTERM or SIGINT has arrived after `install_preemption_handler()`."""
  return _preemption_event.is_set()


def interrupt_exit_code() -> ExitCode:
  """The exit code for the signal that set the flag: 130 for SIGINT, 143 for SIGTERM (the
  default when the flag was set without a signal)."""
  return ExitCode(128 + (_stop_signals[0] if _stop_signals else signal.SIGTERM))


def clear_preemption_request() -> None:
  """Resets the flag (for tests, or a loop that chose to keep going)."""
  _stop_signals.clear()
  _preemption_event.clear()
