"""A run's workdir: one trainer at a time, one config per run, and a writable place.

- `WorkdirLock`: an exclusive lock held for a trainer's whole life. It is an `fcntl.flock` on
  `WORKDIR/trainer.lock`, chosen over an O_EXCL lock file because the kernel drops a flock when
  its process dies however it dies (SIGKILL, OOM, a crashed host's NFS lease), so a stale lock can
  never block a restart and taking one over is race-free. The file also records the holder (host,
  PID, start time) for the refusal message; it is emptied on release. Only a refused start that
  created it deletes it (`release(remove=True)`), while still holding it; a taker re-checks after
  locking that its file is still the one at the path (else it retries on the new one), so a deleter
  and a taker cannot end up locking two different files. A non-empty file whose flock is free was
  left by a holder that died: it is taken over with a warning. flock does not reach across hosts on
  every network file system (some give host-local locks); where it does not, the lock guards against
  a second trainer on the same host only. A workdir on object storage (gs://) takes no lock: GCS has
  none to offer, and the batch scheduler running one job per workdir is the guard.
- `check_or_write_fingerprint`: the first start writes `run_config.json` (the resolved config and
  its `format_version`); a resume compares against it and refuses changed fields, so one run never
  mixes two configs.
- `check_workdir_writable`: one clear ConfigError for a workdir that cannot be written.
- `StartSnapshot`: what a trainer's start found in the workdir, so that a start refused before
  training (a bad config or data file, exit 2) leaves the workdir as it was: no lock file, no log
  lines, no directory it created.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import pathlib
import socket
from collections.abc import Iterable, Mapping
from typing import Any

from reasoning_rl import config_schema
from reasoning_rl import storage
from reasoning_rl.checkpoint_layout import resume_hint
from reasoning_rl.console import LOG_DIR, LOG_FILE
from reasoning_rl.errors import ConfigError, StorageTimeout
from reasoning_rl.plain_data import plain

log = logging.getLogger("reasoning_rl")

LOCK_FILE = "trainer.lock"
FINGERPRINT_FILE = "run_config.json"
# run_config.json: {"format_version": 1, <the resolved config's fields, nested as in the config>}.
# A file written before versions were holds the fields alone, which is version 1's layout, so it
# reads as version 1 (`run_config_fields`).
RUN_CONFIG_FORMAT_VERSION = 1

# Fields a resume may always change: where the run is written, how it is shown and stored, and
# the dry-run's planning target. None of them changes the train state or what a step computes.
# And the step's layout (reasoning_rl/step_layout.py): packing and the micro-batch count change
# memory and speed, the update only by float summation order; a resume after running out of
# memory may split the batch further, and an open layout may be chosen differently elsewhere.
ALWAYS_ALLOWED_CHANGES = (
    "workdir", "dry_run", "keep_freed_host_memory", "logging.*", "checkpoint.*", "storage.*",
    "target.*", "verifier.num_workers",
    "resume.*", "algo.packing", "algo.num_micro_batches",
)


# ------------------------------------------------------------------------------ writability


def check_workdir_writable(path: str | os.PathLike[str], *, field: str = "workdir") -> pathlib.Path:
  """Creates `path` if needed and proves a file can be written in it; returns it.

  Raises ConfigError (one line naming `field` and the path) when it is a file, lies under a file,
  is on a read-only mount or lacks permissions.
  """
  path = storage.path(path)
  remote = storage.is_remote(path)
  try:
    if path.exists() and not path.is_dir():
      raise ConfigError(f"{field}={path}: is a file, not a directory; choose another {field}")
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".write_probe_{socket.gethostname()}_{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
  except (ConfigError, StorageTimeout):  # a store that does not answer is not a bad config
    raise
  except OSError as error:
    reason = ("read-only file system" if error.errno == errno.EROFS
              else error.strerror or str(error))
    raise ConfigError(f"{field}={path}: cannot be written ({reason}); choose a writable "
                      f"{field} or fix its permissions") from None
  except Exception as error:  # pylint: disable=broad-except  # gcsfs's HTTP errors
    if not remote:
      raise
    raise ConfigError(f"{field}={path}: cannot be written ({type(error).__name__}: {error}); "
                      "check the bucket name and that this machine's credentials may write to it "
                      "(gcloud auth application-default login, or the VM's service account)"
                      ) from None
  return path


def storage_failure_line(error: OSError, workdir: str | os.PathLike[str]) -> str:
  """One line for a run that could not write its files: the path, the errno, and the newest
  checkpoint a rerun resumes from."""
  code = errno.errorcode.get(error.errno, "") if error.errno else ""
  what = f"{error.strerror or error} ({code})" if code else str(error)
  where = error.filename or storage.path(workdir)
  return f"{where}: {what}; {resume_hint(storage.path(workdir) / 'checkpoints')}"


def check_output_file_writable(path: str | os.PathLike[str], *, flag: str = "--output"
                               ) -> pathlib.Path:
  """For a file a tool writes at the end: its directory must exist and be writable, and the path
  must not be a directory. Checked before any slow work (loading a model) starts."""
  path = pathlib.Path(path)
  if path.is_dir():
    raise ConfigError(f"{flag} {path}: is a directory; give a file path")
  if not path.parent.is_dir():
    raise ConfigError(f"{flag} {path}: directory {path.parent} does not exist; create it first")
  check_workdir_writable(path.parent, field=flag)
  return path


# ------------------------------------------------------------------------------ lock


def _holder_text(holder: Mapping[str, Any]) -> str:
  return (f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, started "
          f"{holder.get('started', '?')}")


def _read_holder(fd: int) -> dict[str, Any] | None:
  os.lseek(fd, 0, os.SEEK_SET)
  text = os.read(fd, 4096).decode("utf-8", "replace").strip()
  if not text:
    return None
  try:
    holder = json.loads(text)
  except ValueError:
    return {"host": "?", "pid": "?", "started": f"(unreadable lock file: {text[:40]!r})"}
  return holder if isinstance(holder, dict) else None


class WorkdirLock:
  """Exclusive ownership of a workdir by one trainer process (see the module docstring).

  `with WorkdirLock(workdir):` … ; entering raises ConfigError naming the holder (host, PID,
  start time) when another live process holds the workdir.
  """

  def __init__(self, workdir: str | os.PathLike[str]):
    self.remote = storage.is_remote(workdir)
    self.path = storage.path(workdir) / LOCK_FILE
    self._fd: int | None = None

  def acquire(self) -> "WorkdirLock":
    if self._fd is not None:
      return self
    if self.remote:
      # Object storage has no advisory locks; the scheduler (one job per workdir) is the guard.
      log.info("workdir %s is on object storage: no trainer lock is taken there",
               self.path.parent)
      return self
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      if not _same_file(fd, self.path):  # a refused start removed it meanwhile: lock the new one
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        return self.acquire()
    except BlockingIOError:
      holder = _read_holder(fd) or {}
      os.close(fd)
      raise ConfigError(
          f"workdir {self.path.parent} is in use by another trainer ({_holder_text(holder)}); "
          "wait for it to finish, stop it, or choose another workdir") from None
    except OSError as error:
      os.close(fd)
      raise ConfigError(f"workdir {self.path.parent}: cannot lock {self.path} ({error.strerror}); "
                        "put the workdir on a file system that supports flock") from None
    previous = _read_holder(fd)
    if previous is not None:
      log.warning("taking over the lock %s left by a trainer that did not release it (%s)",
                  self.path, _holder_text(previous))
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    self._fd = fd
    return self

  def release(self, *, remove: bool = False) -> None:
    """Empties and unlocks the file; with `remove` (a refused start that created it) deletes it
    first, while it is still locked."""
    if self._fd is None:
      return
    try:
      if remove:
        self.path.unlink(missing_ok=True)
      os.ftruncate(self._fd, 0)  # empty = released cleanly
    finally:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc_info) -> None:
    self.release()


def _same_file(fd: int, path: pathlib.Path) -> bool:
  try:
    here, there = os.fstat(fd), os.stat(path)
  except FileNotFoundError:
    return False
  return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


class StartSnapshot:
  """The workdir as a trainer's start found it: whether it, its lock file and its log existed, and
  the log's length. `undo` puts it back after a refused start (the logs must no longer be written:
  `console.stop_logging_to_workdir` first). For a gs:// workdir only the local staging copy of the
  log exists before the run syncs anything, and it is what `undo` trims."""

  def __init__(self, workdir: str | os.PathLike[str]):
    self.remote = storage.is_remote(workdir)
    self.workdir = None if self.remote else pathlib.Path(workdir).absolute()
    # the directories this start would create: the workdir and its missing parents, deepest first
    self.missing_dirs = []
    if not self.remote:
      directory = self.workdir
      while not directory.exists() and directory != directory.parent:
        self.missing_dirs.append(directory)
        directory = directory.parent
    self.lock_existed = self.remote or (self.workdir / LOCK_FILE).exists()
    self.log = storage.staged(workdir, f"{LOG_DIR}/{LOG_FILE}")
    self.logs_dir_existed = self.log.parent.exists()
    self.log_size = self.log.stat().st_size if self.log.exists() else None

  def undo(self, *, logs: bool) -> None:
    """With `logs` (this start wrote to the log, and holds the lock), trims the log back or
    removes it and the logs directory it created; then removes the directories this start
    created (the workdir, its missing parents) that are empty. Best effort: a file system that
    refuses is left as it is."""
    try:
      if logs and self.log_size is None:
        self.log.unlink(missing_ok=True)
        if not self.logs_dir_existed:
          self.log.parent.rmdir()
      elif logs and self.log.exists():
        os.truncate(self.log, self.log_size)
      for directory in self.missing_dirs:
        directory.rmdir()
    except OSError:
      pass


# ------------------------------------------------------------------------------ fingerprint


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping) and value:
      flat.update(_flatten(value, name + "."))
    else:
      flat[name] = value
  return flat


def _allowed(field: str, patterns: Iterable[str]) -> bool:
  return any(field == p or (p.endswith(".*") and field.startswith(p[:-1])) for p in patterns)


def read_json_object(path) -> dict:
  """The JSON object a workdir file holds (run_config.json, model/lora.json). Raises OSError when
  it cannot be read and ValueError when it is not JSON or not an object; each caller turns both
  into its own error naming the file and the fix."""
  record = json.loads(path.read_text())
  if not isinstance(record, dict):
    raise ValueError(f"a {type(record).__name__}, not an object")
  return record


def check_or_write_fingerprint(workdir: str | os.PathLike[str], resolved_config: Mapping[str, Any],
                               allow_changes: Iterable[str] = ()) -> list[str]:
  """Writes `run_config.json` at a run's first start; on a resume refuses a changed config.

  Args:
    workdir: the run's directory.
    resolved_config: the full config as a nested dict (e.g. `config.to_dict()`).
    allow_changes: dotted fields (e.g. "total_steps") or prefixes ("eval.*") this resume may
      change, on top of `ALWAYS_ALLOWED_CHANGES`.

  Returns the changes that were allowed, as "field: old -> new" lines (run_config.json is then
  rewritten with the new values, so the next resume compares against them).

  Raises:
    ConfigError: listing every other changed, added or removed field as old -> new.
  """
  path = storage.path(workdir) / FINGERPRINT_FILE
  current = plain(resolved_config, json_safe=True)
  if not path.exists():
    _write_run_config(path, current)
    return []
  try:
    saved = read_json_object(path)
  except (OSError, ValueError) as error:
    raise ConfigError(f"{path}: unreadable ({error}); restore it from a backup, or delete it to "
                      "accept the current config as this run's") from None
  old, new = _flatten(run_config_fields(path, saved)), _flatten(current)
  absent = "<absent>"
  lines = {}
  for field in sorted(set(old) | set(new)):
    before, after = old.get(field, absent), new.get(field, absent)
    if _in_current_form(field, before, absent) != after:
      lines[field] = f"{field}: {json.dumps(before)} -> {json.dumps(after)}"
  patterns = (*ALWAYS_ALLOWED_CHANGES, *allow_changes)
  refused = [line for field, line in lines.items() if not _allowed(field, patterns)]
  if refused:
    raise ConfigError(
        f"{path.parent} was started with another config; changed fields: {'; '.join(refused)}. "
        "Resume with the old values, use a new workdir, or allow these fields explicitly")
  if lines:
    log.warning("resuming %s with changed fields: %s", path.parent, "; ".join(lines.values()))
    _write_run_config(path, current)
  return list(lines.values())


# Fields whose type changed, {old value: the current value of the same meaning}.
RETYPED_VALUES = {"algo.remat": {False: "none", True: "full"}}


def _in_current_form(field: str, value: Any, absent: str) -> Any:
  """A run_config.json value as the current config would write the same setting: a declared field
  the run's version did not have yet ran as its default (the behaviour before the field existed),
  and a retyped field's older value maps to its current one."""
  if value == absent and field in config_schema.FIELDS:
    return plain(config_schema.default(field), json_safe=True)
  retyped = RETYPED_VALUES.get(field, {})
  return retyped.get(value, value) if isinstance(value, bool) else value


def run_config_fields(path, record: Mapping[str, Any]) -> dict[str, Any]:
  """The config fields of run_config.json (`record`, the object read from `path`), its
  `format_version` taken out. Raises ConfigError naming the file when it is of another version
  (a newer reasoning_rl wrote it)."""
  fields = dict(record)
  version = fields.pop("format_version", 1)  # unversioned: version 1's layout (see the constant)
  if version != RUN_CONFIG_FORMAT_VERSION:
    raise ConfigError(
        f"{path}: format_version {version!r}, but this reasoning_rl reads version "
        f"{RUN_CONFIG_FORMAT_VERSION} only; resume the run with the reasoning_rl that wrote it, or "
        "use a new workdir")
  return fields


def _write_run_config(path, config: Mapping[str, Any]) -> None:
  record = {"format_version": RUN_CONFIG_FORMAT_VERSION, **config}
  storage.atomic_write(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
