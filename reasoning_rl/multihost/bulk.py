"""The bulk channel: large host values (rollouts, evaluation records) as files in the workdir.

The coordination service's key-value store lives in process 0 and every message through it is
held in that one process's memory and relayed by it; one large value there stalls every host's
next exchange. The run's workdir is already storage every host reaches (checkpoints need it: a
local or shared directory, or `gs://`), so bulk values go there instead, and the key-value store
carries only a small descriptor of each file (`exchange.Exchange` refuses values over
`exchange.MAX_VALUE_BYTES`).

One value = one file `WORKDIR/exchange/<name>/<call>_p<process>.json.z`: JSON compressed with zlib,
written whole or not at all (local: temporary file + rename; GCS: one object upload).
`put` returns the descriptor {file, bytes, crc32} the writer then sends through the exchange;
`get` reads the file a descriptor names, checks its size and CRC-32 and decodes it. A reader
never sees a torn or stale file: the file is complete before its descriptor is published, and a
file whose bytes do not match its descriptor (a previous run's file under the same name, a
truncated upload) raises `OSError` naming the file (exit code 4, like any storage failure).

Clean-up: the writer deletes its own files. A file written before exchange call k is announced
in call k and read right after it; once this process completes a gather numbered above k, every
process has passed call k and its reads, so the file is deleted at the next `put` or `sweep`.
The directory therefore holds about one step's files. Files a killed run left behind are removed
by process 0 when the next run starts (`clear`), before any process writes.

Why JSON + zlib and not arrays: rollouts are ragged (completions of different lengths) and carry
text, and the exchange already speaks this format. What cost every host — reading and decoding
every rollout out of process 0's store — is gone either way: a file is written once and read only
by the processes that train on it.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from typing import Any

from reasoning_rl import storage

DIRECTORY = "exchange"  # below the workdir
TRACE_ENV = "REASONING_RL_EXCHANGE_TRACE"  # a directory: one JSON line per store / file operation


def _builtin(value):
  """numpy scalars and arrays as plain JSON values."""
  if hasattr(value, "tolist"):
    return value.tolist()
  raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode(value: Any) -> bytes:
  return zlib.compress(json.dumps(value, default=_builtin).encode(), 1)


def _write_whole(file, data: bytes) -> None:
  """`file` appears with all of `data` or not at all: one object upload on GCS; locally a
  temporary file renamed over it, without `storage.atomic_write`'s fsync. The file lives about
  one step and protects nothing across a crash (the run restarts from a checkpoint and process 0
  clears the directory), so waiting for the disk would only lengthen every step; the rename
  alone makes readers on this host or a shared filesystem (close-to-open) see it whole."""
  if storage.is_remote(file):
    storage.atomic_write(file, data)
    return
  file.parent.mkdir(parents=True, exist_ok=True)
  staging = file.with_name(f".{file.name}.tmp{os.getpid()}")
  staging.write_bytes(data)
  os.replace(staging, file)


class Trace:
  """Appends one JSON line per channel operation to `$REASONING_RL_EXCHANGE_TRACE/p<process>.jsonl`
  (off when the variable is unset): what `benchmarks/multihost.py --channels` and the multi-process
  test count."""

  def __init__(self, process_index: int):
    directory = os.environ.get(TRACE_ENV)
    self.file = None
    if directory:
      os.makedirs(directory, exist_ok=True)
      self.file = os.path.join(directory, f"p{process_index}.jsonl")

  def record(self, channel: str, op: str, name: str, num_bytes: int, seconds: float) -> None:
    if self.file is None:
      return
    with open(self.file, "a", encoding="utf-8") as handle:
      handle.write(json.dumps({"channel": channel, "op": op, "name": name, "bytes": num_bytes,
                               "s": round(seconds, 6)}) + "\n")


class BulkChannel:
  """Files for the values of one multi-process run (see the module docstring).

  Args:
    exchange: the run's `exchange.Exchange`; its call counter names the files and its completed
      gathers tell when a file has been read by everyone.
    workdir: the run's workdir (local path or gs:// URL).
  """

  def __init__(self, exchange, workdir):
    self.exchange = exchange
    self.directory = storage.path(workdir) / DIRECTORY
    self.trace = Trace(exchange.process_index)
    self._written: list[tuple[int, Any]] = []  # (exchange calls made when written, file)

  def clear(self) -> None:
    """Removes every file a previous run left (process 0, before any process writes)."""
    if self.directory.exists():
      for file in storage.list_files(self.directory):
        file.unlink(missing_ok=True)

  def put(self, name: str, value: Any) -> dict:
    """Writes `value` to a new file; returns its descriptor, to publish in the next exchange call
    (the readers' `get` needs it)."""
    self.sweep()
    start = time.perf_counter()
    data = encode(value)
    calls = self.exchange.calls
    file = self.directory / name / f"{calls + 1}_p{self.exchange.process_index}.json.z"
    _write_whole(file, data)
    self._written.append((calls, file))
    self.trace.record("file", "write", name, len(data), time.perf_counter() - start)
    return {"file": storage.relative_name(file, self.directory), "bytes": len(data),
            "crc32": zlib.crc32(data)}

  def get(self, name: str, descriptor: dict) -> Any:
    """The value a `put` on some process wrote, checked against its descriptor."""
    start = time.perf_counter()
    file = self.directory / descriptor["file"]
    try:
      data = file.read_bytes()
    except FileNotFoundError as error:
      raise OSError(f"{file}: the bulk file another process announced is missing; every process "
                    "must see the same workdir (a shared filesystem or gs://)") from error
    if len(data) != descriptor["bytes"] or zlib.crc32(data) != descriptor["crc32"]:
      raise OSError(f"{file}: {len(data)} bytes with CRC-32 {zlib.crc32(data)}, but its writer "
                    f"announced {descriptor['bytes']} bytes with CRC-32 {descriptor['crc32']}; "
                    "the workdir's storage lost or altered the file")
    value = json.loads(zlib.decompress(data))
    self.trace.record("file", "read", name, len(data), time.perf_counter() - start)
    return value

  def sweep(self) -> None:
    """Deletes this process's files that every process has read (see the module docstring)."""
    done = self.exchange.last_gather
    keep = []
    for calls, file in self._written:
      if done > calls + 1:
        file.unlink(missing_ok=True)
      else:
        keep.append((calls, file))
    self._written = keep
