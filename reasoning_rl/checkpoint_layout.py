"""The layout of a checkpoint directory, read without JAX or Orbax.

`DIRECTORY/<s>/` is the committed step `s`: Orbax writes a step into
`<s>.orbax-checkpoint-tmp…` and renames it to the bare step number only once every item is on
disk, so a directory named by a number alone is complete. A step holds three items:

- `state`: a pytree of arrays; typed PRNG keys stored as their key data (checkpoint_leaves.py).
- `meta`: a JSON-able dict of the caller's (the trainer's loop state carries its own version,
  `loop.state.LOOP_STATE_FORMAT_VERSION`).
- `keys`: the step's `format_version` (`CHECKPOINT_FORMAT_VERSION`, the version of this layout:
  the three items, typed keys stored as key data) and which `state` leaves were typed keys, with
  their PRNG implementation.

plus `CHECKSUMS.json` (checkpoint_manifest.py). A step that failed its checks is moved to
`corrupt-<s>` (`CORRUPT_PREFIX`), never deleted.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from reasoning_rl import storage
from reasoning_rl.errors import CheckpointError

CORRUPT_PREFIX = "corrupt-"
# The layout of a step directory (module docstring), written into its `keys` item.
CHECKPOINT_FORMAT_VERSION = 1


def check_format(step_dir: str | os.PathLike[str], keys: Mapping[str, Any] | None = None) -> None:
  """Raises CheckpointError unless step `step_dir` has CHECKPOINT_FORMAT_VERSION.

  `keys` is the step's `keys` item if already read; otherwise it is read from its file (for
  readers of a step that go past `Checkpointer`, e.g. run_checkpoint).
  """
  step_dir = storage.path(step_dir)
  where = step_dir / "keys"
  if keys is None:
    try:  # Orbax's JsonCheckpointHandler writes the item as `<item>/metadata`
      keys = json.loads((where / "metadata").read_text())
    except (OSError, ValueError) as error:
      raise CheckpointError(f"{where} is unreadable ({error}); it was not written by "
                            "reasoning_rl.checkpointing or is damaged") from None
  if not isinstance(keys, Mapping):
    raise CheckpointError(f"{where}: holds a {type(keys).__name__}, not a dict; it was not "
                          "written by reasoning_rl.checkpointing or is damaged")
  # A step saved before versions were written holds {"impls": …} alone: its layout is exactly
  # version 1's (these three items, typed keys as key data), so it reads as version 1.
  version = keys.get("format_version", 1)
  if version != CHECKPOINT_FORMAT_VERSION:
    raise CheckpointError(
        f"{where}: checkpoint format_version {version!r}, but this reasoning_rl reads version "
        f"{CHECKPOINT_FORMAT_VERSION} only; restore the step with the reasoning_rl that wrote it, "
        "or start a new workdir")


def last_complete_checkpoint(directory: str | os.PathLike[str]) -> str:
  """'step N (PATH)' for the newest committed step directory under `directory`, or 'none yet'.
  Read from the directory names alone (Orbax commits a step by renaming its temporary
  directory to the bare step number), so it works when nothing else can be read or written."""
  try:
    directory = storage.path(directory)
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()]
  except Exception:  # pylint: disable=broad-except  # a vanished mount, a bucket gone: say so
    return f"unknown ({directory} cannot be listed)"
  return f"step {max(steps)} ({directory / str(max(steps))})" if steps else "none yet"


def resume_hint(directory: str | os.PathLike[str]) -> str:
  """The end of every storage-failure line: where a rerun resumes from, and what to do first."""
  return (f"last complete checkpoint: {last_complete_checkpoint(directory)}; free space or fix "
          "the path, then rerun on the same workdir to resume from it")
