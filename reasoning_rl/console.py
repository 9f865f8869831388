"""Where a training run's messages go: a quiet terminal, full logs in the workdir.

A run's terminal shows the progress line (`metrics.ProgressBar`), warnings and errors, and the
summary printed at the end. Everything libraries log (Orbax's INFO lines about every save, JAX's
backend choice, our own INFO lines) goes to `WORKDIR/logs/train.log`; `verbose=True` shows it on
the terminal too. Terminal lines are written through tqdm so they never tear the progress line.
"""

from __future__ import annotations

import logging
import os
import pathlib
import sys

from reasoning_rl import storage

LOG_DIR = "logs"
LOG_FILE = "train.log"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _AboveProgressLine(logging.Handler):
  """Writes records with `tqdm.write`, which clears and redraws a live progress line.

  A library's record loses its traceback here, and Orbax's and gcsfs's records stay off the
  terminal (the log file keeps both): Orbax logs each failed background thread of a save, with its
  stack, and gcsfs each retry of a failing request, while the failure itself reaches the run as
  one exception that the launcher reports in one line."""

  def __init__(self, level: int, *, verbose: bool):
    super().__init__(level)
    self.verbose = verbose

  def emit(self, record: logging.LogRecord) -> None:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel

    if not self.verbose and (f"{os.sep}orbax{os.sep}" in record.pathname
                             or record.name.startswith("gcsfs")):
      return
    if (record.exc_info or record.exc_text) and not record.name.startswith("reasoning_rl"):
      record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None,
                                      "stack_info": None})
    try:
      tqdm.write(self.format(record))
    except Exception:  # pylint: disable=broad-except
      self.handleError(record)


class _LogFile(logging.FileHandler):
  """The workdir's log file. When a write fails (a full disk, a vanished mount) it says so once
  on the terminal and drops later records, instead of printing a traceback for each of them
  (Python's default `handleError`): the run's own error, if the failure matters, is one line."""

  failed = False

  def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
    if self.failed:
      return
    self.failed = True
    error = sys.exc_info()[1]
    logging.getLogger("reasoning_rl").warning(
        "writing %s failed (%s): further log lines are dropped", self.baseFilename, error)

  def emit(self, record: logging.LogRecord) -> None:
    if not self.failed:
      super().emit(record)


def quiet_until_logs_have_a_file(*, verbose: bool = False) -> None:
  """Before the workdir's log file exists (start-up, JAX's backend probing, config checks), the
  terminal shows WARNING and up only, or everything with `verbose`; `send_logs_to_workdir`
  then routes INFO lines to the file."""
  logging.getLogger().setLevel(logging.INFO if verbose else logging.WARNING)
  try:
    from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel

    absl_logging.set_verbosity(absl_logging.INFO if verbose else absl_logging.WARNING)
  except ImportError:
    pass


def _log_unraisable(unraisable) -> None:
  """`sys.unraisablehook`: an exception Python had to ignore goes to the log file, not the
  terminal. After a failed asynchronous checkpoint save, for one, tensorstore's pending writes
  complete into Orbax's closed event loop and Python would print a traceback for each (hundreds
  of lines under the run's one error line)."""
  logging.getLogger("reasoning_rl").info(
      "exception ignored in %r: %s", unraisable.object, unraisable.exc_value,
      exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))


def stop_logging_to_workdir() -> None:
  """Closes the workdir's log file handler (`send_logs_to_workdir`), if any: for a start that is
  refused and leaves the workdir as it found it."""
  root = logging.getLogger()
  for handler in list(root.handlers):
    if isinstance(handler, _LogFile):
      root.removeHandler(handler)
      handler.close()


def send_logs_to_workdir(workdir: str | os.PathLike[str], *, verbose: bool = False) -> pathlib.Path:
  """Routes every Python logger (absl's included) to WORKDIR/logs/train.log at INFO; the terminal
  gets WARNING and up, or everything with `verbose`. Returns the log file's path."""
  # On a remote workdir the log is written to a local staging file whose new lines
  # storage.sync_staged appends to WORKDIR/logs/train.log (with every metrics row and at exit).
  path = storage.staged(workdir, f"{LOG_DIR}/{LOG_FILE}")
  path.parent.mkdir(parents=True, exist_ok=True)
  root = logging.getLogger()
  for handler in list(root.handlers):  # absl's stderr handler, installed by app.run
    root.removeHandler(handler)
  to_file = _LogFile(path, encoding="utf-8")
  to_file.setFormatter(logging.Formatter(_FORMAT))
  to_terminal = _AboveProgressLine(logging.INFO if verbose else logging.WARNING, verbose=verbose)
  to_terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
  root.addHandler(to_file)
  root.addHandler(to_terminal)
  root.setLevel(logging.INFO)
  logging.getLogger("reasoning_rl").setLevel(logging.INFO)
  sys.unraisablehook = _log_unraisable
  try:  # absl routes its own records through the root logger; keep its level from filtering INFO
    from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel

    absl_logging.set_verbosity(absl_logging.INFO)
    absl_logging.set_stderrthreshold(absl_logging.FATAL)
  except ImportError:
    pass
  return path
