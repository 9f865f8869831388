"""A checkpoint step's CHECKSUMS.json: the size and checksums of every file of the step.

Orbax itself keeps a CRC32C of its shard indices only, not of the array data, so once Orbax has
committed a step `checkpointing.Checkpointer` writes this manifest (process 0, in a background
thread) and checks a step against it before restoring. Where the figures come from depends on
the storage (storage.py, "Checksums"):
- gs://: Cloud Storage's own MD5 and CRC32C of each object, from one listing. Nothing is read
  back: at r1zero scale an earlier manifest downloaded ~42 GiB per save to hash it, and a
  restore downloaded it again before Orbax read it a third time.
- local: each file is read once and its CRC32C computed (in the form GCS lists, so a step
  copied to or from a bucket keeps a checkable manifest). A local filesystem keeps no checksums
  to ask for, and a file just written is normally still in the page cache.

The manifest carries its own version (`MANIFEST_VERSION`); one of any other version is refused
with one line naming it (`CheckpointError`, not corruption: the step may be intact, written by a
newer reasoning_rl). A file that is missing, truncated or changed is `CheckpointCorruptError`.
Nothing here imports JAX or Orbax: `models` reads a run's step past the Checkpointer.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from reasoning_rl import storage
from reasoning_rl.errors import CheckpointError

CHECKSUMS_FILE = "CHECKSUMS.json"
# CHECKSUMS.json's own version: {"version": 3, "files": {name: {"bytes", "md5"?, "crc32c"?}}}.
# It was numbered before the other formats were; versions 1 and 2 (SHA-256 digests) were never
# released and are refused like any other version.
MANIFEST_VERSION = 3
_KNOWN_KINDS = ("md5", "crc32c")  # checksums a manifest entry holds besides its size


class CheckpointCorruptError(CheckpointError):
  """A checkpoint's files differ from their checksums, or its arrays hold NaN / inf."""


def _in_manifest(name: str) -> bool:
  return name != CHECKSUMS_FILE and not name.startswith("." + CHECKSUMS_FILE)


def _step_files(step_dir) -> list[str]:
  names = (storage.relative_name(f, step_dir) for f in storage.list_files(step_dir))
  return [name for name in names if _in_manifest(name)]


def write_checksums(step_dir: str | os.PathLike[str]) -> None:
  """Writes `step_dir/CHECKSUMS.json`: size and checksums of every file of a committed step.

  On gs:// the figures are Cloud Storage's own (size, MD5, CRC32C per object) from one listing:
  nothing is downloaded. Locally each file is read once and its CRC32C computed.
  """
  step_dir = storage.path(step_dir)
  stored = storage.stored_checksums(step_dir)
  if stored is not None:
    entries = {name: stored[name] for name in sorted(stored) if _in_manifest(name)}
  else:
    entries = storage.file_checksums(step_dir, _step_files(step_dir))
  storage.atomic_write(step_dir / CHECKSUMS_FILE,
                       json.dumps({"version": MANIFEST_VERSION, "files": entries}, indent=1))


def _manifest_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
  """{"bytes": n, kind: checksum, …}, checked: a size and only the kinds a manifest holds."""
  figures = {kind: str(value) for kind, value in entry.items() if kind in _KNOWN_KINDS}
  if len(figures) != len(entry) - 1:
    raise ValueError(f"unknown checksum kinds in {sorted(entry)}")
  return {"bytes": int(entry["bytes"]), **figures}


def verify_checksums(step_dir: str | os.PathLike[str]) -> bool:
  """Checks a step's files against its CHECKSUMS.json.

  Returns True when every listed file has its recorded size and checksums, False when the step
  has no CHECKSUMS.json (its process was killed before writing it). Raises CheckpointCorruptError
  naming the first file that is missing, truncated or changed, and CheckpointError when the
  manifest's version is not MANIFEST_VERSION (not corruption: the step may be intact).

  On gs:// one listing gives every object's size, MD5 and CRC32C: a file whose recorded
  checksums GCS also keeps is checked without reading it (GCS computes them from the bytes it
  stored: an object replaced, truncated or rewritten since lists other ones). Only files whose
  recorded checksums the listing lacks (an MD5 for a composite object, which GCS keeps none of)
  are downloaded and hashed. Locally every file is read.
  """
  step_dir = storage.path(step_dir)
  manifest_path = step_dir / CHECKSUMS_FILE
  # on gs:// a fresh listing says whether the manifest exists (a cached one may predate it)
  stored = storage.stored_checksums(step_dir)
  if not (manifest_path.exists() if stored is None else CHECKSUMS_FILE in stored):
    return False
  try:
    manifest = json.loads(storage.read_bytes_fresh(manifest_path))
    version = manifest["version"]
  except (OSError, ValueError, KeyError, TypeError) as error:
    raise CheckpointCorruptError(f"{manifest_path} is unreadable ({error!r})") from None
  if version != MANIFEST_VERSION:
    raise CheckpointError(
        f"{manifest_path}: manifest version {version!r}, but this reasoning_rl reads version "
        f"{MANIFEST_VERSION} only; restore the step with the reasoning_rl that wrote it, or "
        "delete the file to restore the step unverified")
  try:
    entries = {name: _manifest_entry(entry) for name, entry in manifest["files"].items()}
  except (ValueError, KeyError, TypeError, AttributeError) as error:
    raise CheckpointCorruptError(f"{manifest_path} is unreadable ({error!r})") from None
  to_read = {}
  for name in sorted(entries):
    kinds = tuple(kind for kind in entries[name] if kind != "bytes")
    if stored is None:
      to_read[name] = kinds
      continue
    if name not in stored:
      raise CheckpointCorruptError(f"{step_dir / name} is missing")
    _compare(step_dir, name, entries[name], stored[name], storage.CHECKSUM_KINDS)
    if not any(kind in stored[name] for kind in kinds):
      to_read[name] = kinds
  try:
    found = storage.file_checksums(step_dir, list(to_read), kinds=to_read)
  except FileNotFoundError as error:
    raise CheckpointCorruptError(f"{error} is missing") from None
  for name, figures in found.items():
    _compare(step_dir, name, entries[name], figures, tuple(to_read[name]))
  return True


def _compare(step_dir, name: str, recorded: Mapping[str, Any], found: Mapping[str, Any],
             kinds: tuple[str, ...]) -> None:
  """Raises CheckpointCorruptError when `found` (a file's size and checksums now) differs from
  `recorded` (its manifest entry) in size or in any checksum both hold."""
  if found["bytes"] != recorded["bytes"]:
    raise CheckpointCorruptError(f"{step_dir / name} has {found['bytes']} bytes, "
                                 f"{recorded['bytes']} were written (truncated or overwritten)")
  for kind in kinds:
    if kind in recorded and kind in found and recorded[kind] != found[kind]:
      raise CheckpointCorruptError(f"{step_dir / name} does not match its digest in "
                                   f"{CHECKSUMS_FILE} (its bytes changed after the save)")
