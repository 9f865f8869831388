"""One driver per workdir: a lock object in the workdir, written only if it is unchanged since it
was read, kept alive by a heartbeat, taken over once its heartbeat is older than a timeout.

  python launch/gcp/workdir_lock.py acquire WORKDIR --owner=WHO [--stale_s=600]
  python launch/gcp/workdir_lock.py heartbeat WORKDIR --owner=WHO [--every_s=60] [--while_pid=P]
  python launch/gcp/workdir_lock.py release WORKDIR --owner=WHO
  (each also takes --deadline_s: how long a storage call retries, default 120)

The TPU VM recipe (launch/gcp/tpu_vm.py) holds it while it drives a run, so that a second recipe
started on the same workdir (another terminal, another machine, the same one after a reboot)
stops with one line instead of starting a second trainer on a live run.

The lock is WORKDIR/launcher/driver.lock, {"owner": WHO, "acquired": t} ({"owner": null} once
released). On gs:// every write carries a generation precondition (Cloud Storage's
ifGenerationMatch: 0 to create it only where there is none, the generation last read to replace
it), so of two drivers racing for it exactly one succeeds. Its age is the object's `updated` time,
set by Cloud Storage (not by the holder's clock). A local or mounted workdir gets the same rules
from a file, its generation counted in it, compare-and-swap under an flock.

acquire: creates the lock, or takes over one whose heartbeat is older than --stale_s, or finds it
already ours (a restarted driver). heartbeat: rewrites it every --every_s; ends with exit 2 when
someone else holds it now, and releases it when the process --while_pid is gone (the driver died
without its exit trap). Exit codes: 0 done, 2 held by another driver (one line saying who and
since when), 4 the store could not be read or written.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pathlib
import sys
import time

LOCK_NAME = "launcher/driver.lock"
HELD, STORAGE = 2, 4  # reasoning_rl.errors.ExitCode.BAD_INPUT / STORAGE, without importing it
TIMEOUT_S = 30.0  # every storage request


class Store:
  """The lock object: read() -> (record, generation, age in seconds) or None; create / replace
  return False when the precondition failed (someone else wrote it first). A released lock is a
  record without an owner (an overwrite, which carries a precondition; Cloud Storage's deletes
  take one too, but the emulator the tests use ignores it there)."""

  def read(self):
    raise NotImplementedError

  def create(self, record: dict) -> bool:
    raise NotImplementedError

  def replace(self, record: dict, generation: int) -> bool:
    raise NotImplementedError



class GcsStore(Store):
  """gs://BUCKET/.../launcher/driver.lock with google-cloud-storage (a dependency of gcsfs, hence
  of the project); the emulator where STORAGE_EMULATOR_HOST is set."""

  def __init__(self, workdir: str, deadline_s: float = 120.0):
    from google.cloud import storage  # pylint: disable=import-outside-toplevel
    from google.cloud.storage.retry import DEFAULT_RETRY  # pylint: disable=import-outside-toplevel

    bucket, _, prefix = workdir[len("gs://"):].partition("/")
    name = f"{prefix.rstrip('/')}/{LOCK_NAME}" if prefix else LOCK_NAME
    if os.environ.get("STORAGE_EMULATOR_HOST"):
      from google.auth import credentials  # pylint: disable=import-outside-toplevel
      client = storage.Client(project="emulator",
                              credentials=credentials.AnonymousCredentials())
    else:
      client = storage.Client()
    self.bucket = client.bucket(bucket)
    self.name = name
    # each call: requests of TIMEOUT_S, retried (transient errors) until deadline_s has passed
    self.calls = {"timeout": TIMEOUT_S, "retry": DEFAULT_RETRY.with_deadline(deadline_s)}

  def read(self):
    blob = self.bucket.get_blob(self.name, **self.calls)
    if blob is None:
      return None
    try:
      record = json.loads(blob.download_as_bytes(if_generation_match=blob.generation,
                                                 **self.calls))
    except self._precondition_failed():
      return self.read()  # replaced between the two requests
    age = time.time() - blob.updated.timestamp()
    return record, int(blob.generation), age

  def _write(self, record: dict, generation: int) -> bool:
    try:
      self.bucket.blob(self.name).upload_from_string(
          json.dumps(record), content_type="application/json", if_generation_match=generation,
          timeout=TIMEOUT_S, retry=self.calls["retry"])
    except self._precondition_failed():
      return False
    return True

  def create(self, record: dict) -> bool:
    return self._write(record, 0)

  def replace(self, record: dict, generation: int) -> bool:
    return self._write(record, generation)

  @staticmethod
  def _precondition_failed():
    from google.api_core import exceptions  # pylint: disable=import-outside-toplevel

    return exceptions.PreconditionFailed


class FileStore(Store):
  """The same rules on a file: {"generation": g, "record": ...}; compare-and-swap under an flock
  of a companion file; age from the file's modification time."""

  def __init__(self, workdir: str):
    self.path = pathlib.Path(workdir) / LOCK_NAME
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.guard = self.path.with_name(self.path.name + ".guard")

  def _locked(self):
    handle = open(self.guard, "a")  # noqa: SIM115
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle

  def _current(self):
    if not self.path.exists():
      return None
    stored = json.loads(self.path.read_text())
    return stored["record"], stored["generation"], time.time() - self.path.stat().st_mtime

  def read(self):
    with self._locked():
      return self._current()

  def _swap(self, record: dict, expected: int) -> bool:
    with self._locked():
      current = self._current()
      if (current[1] if current else 0) != expected:
        return False
      tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
      tmp.write_text(json.dumps({"generation": expected + 1, "record": record}))
      os.replace(tmp, self.path)
      return True

  def create(self, record: dict) -> bool:
    return self._swap(record, 0)

  def replace(self, record: dict, generation: int) -> bool:
    return self._swap(record, generation)


def store_for(workdir: str, deadline_s: float = 120.0) -> Store:
  return GcsStore(workdir, deadline_s) if workdir.startswith("gs://") else FileStore(workdir)


class Held(Exception):
  """Another driver holds the lock."""


def acquire(store: Store, owner: str, stale_s: float) -> str:
  """Takes the lock for `owner`; returns how ("acquired", "already ours", "taken over from X").
  Raises Held naming the holder."""
  for _ in range(5):  # a lost race re-reads: the winner is then a holder like any other
    found = store.read()
    record = {"owner": owner, "acquired": time.time()}
    if found is None:
      if store.create(record):
        return "acquired"
      continue
    held, generation, age = found
    if not held.get("owner"):  # released
      if store.replace(record, generation):
        return "acquired"
      continue
    if held.get("owner") == owner:
      return "already ours" if store.replace(held, generation) else "lost"
    if age > stale_s:
      if store.replace(record, generation):
        return f"taken over from {held.get('owner')} (its heartbeat is {age:.0f} s old)"
      continue
    raise Held(f"driven by {held.get('owner')} (heartbeat {age:.0f} s ago, stale after "
               f"{stale_s:.0f} s)")
  raise Held("contended: others wrote the lock at every try")


def refresh(store: Store, owner: str) -> bool:
  """One heartbeat: rewrites our lock (a new `updated` time); False when it is not ours now."""
  found = store.read()
  if found is None or found[0].get("owner") != owner:
    return False
  return store.replace(found[0], found[1])


def release(store: Store, owner: str) -> bool:
  found = store.read()
  if found is None or found[0].get("owner") != owner:
    return False
  return store.replace({"owner": None, "released": time.time()}, found[1])


def holder(store: Store) -> str | None:
  """Who holds the lock now (None: nobody)."""
  found = store.read()
  return found[0].get("owner") if found else None


def alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="workdir_lock.py", description=__doc__.split("\n\n")[0])
  parser.add_argument("action", choices=["acquire", "heartbeat", "release"])
  parser.add_argument("workdir")
  parser.add_argument("--owner", required=True)
  parser.add_argument("--stale_s", type=float, default=600.0)
  parser.add_argument("--every_s", type=float, default=60.0)
  parser.add_argument("--while_pid", type=int, default=0)
  parser.add_argument("--deadline_s", type=float, default=120.0,
                      help="how long a storage call retries transient failures")
  args = parser.parse_args(argv)
  where = f"{args.workdir.rstrip('/')}/{LOCK_NAME}"
  try:
    store = store_for(args.workdir, args.deadline_s)
    if args.action == "acquire":
      print(f"workdir lock {where}: {acquire(store, args.owner, args.stale_s)}", flush=True)
      return 0
    if args.action == "release":
      release(store, args.owner)
      return 0
    while True:
      time.sleep(args.every_s)
      if args.while_pid and not alive(args.while_pid):
        release(store, args.owner)
        return 0
      if not refresh(store, args.owner):
        print(f"error: workdir lock {where}: no longer held by {args.owner}", file=sys.stderr)
        return HELD
  except Held as held:
    print(f"error: --workdir={args.workdir}: {held}; stop that driver first, or wait until its "
          "lock goes stale", file=sys.stderr)
    return HELD
  except Exception as error:  # noqa: BLE001  (any storage failure: one line)
    print(f"error: workdir lock {where}: {type(error).__name__}: {error}", file=sys.stderr)
    return STORAGE


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
