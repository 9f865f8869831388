"""Training checkpoints: `Checkpointer`, a thin layer over Orbax's `CheckpointManager`.

A checkpoint of step `s` holds the items `state` (a pytree of jax arrays: params, optimizer state,
counters, RNG keys), `meta` (a JSON-able dict: data-source position, policy version, a config
snapshot …) and `keys` (bookkeeping: the step's format version and its typed PRNG keys) in
`DIRECTORY/<s>/`, laid out as checkpoint_layout.py describes. Typed PRNG keys are stored as their
key data and re-wrapped on restore (checkpoint_leaves.py); the caller never sees the difference.

Atomicity comes from Orbax: a step is written into `<s>.orbax-checkpoint-tmp…` and renamed to `<s>`
only once every item is on disk, so a crash mid-save leaves a temporary directory that is never
mistaken for a checkpoint (and is removed when the next `Checkpointer` opens the directory).

Integrity: once Orbax has committed a step, a background thread of process 0 writes
`<s>/CHECKSUMS.json` (checkpoint_manifest.py). `restore` checks the step against it and refuses a
step whose files are missing, truncated or changed, and non-finite values in floating-point
arrays, naming the file or the leaf (`CheckpointCorruptError`); a step of another format version
(its `keys` item or its manifest) is refused with one line naming the file (`CheckpointError`,
never moved aside as corrupt: it may be intact, written by a newer reasoning_rl).
`restore_latest` moves a newest step that fails either check to `corrupt-<s>` (never deleted),
logs a warning naming it and goes on with the previous step; if every step fails it raises
`CheckpointError` rather than silently starting from scratch (a rerun then starts from step 0, the
failed steps still kept aside for inspection). A step without CHECKSUMS.json (its process was
killed between Orbax's commit and the checksum file) is restored with a warning, still subject to
the finite-values check. A read error on such a step is not treated as corruption: without
checksums it cannot be told from, e.g., running out of memory.

Stopping on SIGTERM / SIGINT is stop_signals.py's: the loop saves with `save(step, …,
force=True)`, calls `close()` and exits.

Deadlines: every wait on Orbax (opening, saving, committing, restoring, closing) and on the
checksum thread runs under `deadlines.call` with `storage.timeout_s` plus a second per 10 MiB
this process moves; past it `StorageTimeout` (exit 4) names the step and the checkpoint a rerun
resumes from (`Checkpointer.resume_point`, known without asking storage).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import threading
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from reasoning_rl import deadlines
from reasoning_rl import storage
from reasoning_rl.checkpoint_layout import (CHECKPOINT_FORMAT_VERSION, CORRUPT_PREFIX, check_format,
                                            resume_hint)
from reasoning_rl.checkpoint_leaves import (decode_typed_keys, encode_typed_keys, is_typed_key,
                                            leaf_path_name, nonfinite_leaves, restore_target)
from reasoning_rl.checkpoint_manifest import (CHECKSUMS_FILE, CheckpointCorruptError,
                                              verify_checksums, write_checksums)
from reasoning_rl.errors import CheckpointError, StorageTimeout

log = logging.getLogger("reasoning_rl")

def _first_line(error: BaseException) -> str:
  """The gist of a library error for a one-line message (TensorStore appends a long spec dump)."""
  text = str(error).strip().split(" See full TensorStore details")[0]
  return text.splitlines()[0] if text else type(error).__name__


def _check_meta(meta: Mapping[str, Any]) -> None:
  if not isinstance(meta, Mapping):
    raise CheckpointError(f"meta must be a dict, got {type(meta).__name__}")
  try:
    json.dumps(meta, allow_nan=False)
  except (TypeError, ValueError) as error:
    raise CheckpointError(
        f"meta is not plain JSON ({error}); convert arrays with .tolist() / int() / float() and "
        "replace NaN/inf before saving") from error


def _local_bytes(tree: Any) -> int:
  """Bytes of `tree`'s arrays held by this process (what it writes in a save)."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    shards = getattr(leaf, "addressable_shards", None)
    if shards is not None:
      total += sum(shard.data.nbytes for shard in shards if shard.replica_id == 0)
    else:
      total += getattr(leaf, "nbytes", 0)
  return int(total)


def _abstract_bytes(tree: Any) -> int:
  """Bytes of the arrays `tree` (jax.ShapeDtypeStruct leaves) describes, this process's share."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    size = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and hasattr(sharding, "addressable_devices"):
      size = size * len(sharding.addressable_devices) // max(1, len(sharding.device_set))
    total += size
  return total


def _storage_timeout_in(error: BaseException | None) -> StorageTimeout | None:
  """The StorageTimeout `error` is or was caused by (Orbax wraps its threads' errors)."""
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, StorageTimeout):
      return error
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return None


class Checkpointer:
  """Saves and restores (`state`, `meta`) per training step under one directory.

  Args:
    directory: where step directories go; created if missing.
    keep: how many of the newest complete checkpoints to keep on disk.
    async_save: write arrays in a background thread; `save` returns once device buffers are
      copied, so the next step can run. Call `wait()` before reading the checkpoint back.
    save_interval_steps: `save` writes only steps that are multiples of this, unless `force=True`.
    active_processes: the processes that save and restore (default: all of them).
  """

  def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3,
               async_save: bool = True, save_interval_steps: int = 1,
               active_processes: set[int] | None = None):
    if not isinstance(keep, int) or keep < 1:
      raise CheckpointError(f"keep must be an int >= 1, got {keep!r}")
    if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
      raise CheckpointError(f"save_interval_steps must be an int >= 1, got {save_interval_steps!r}")
    self.directory = (storage.path(directory) if storage.is_remote(directory)
                      else pathlib.Path(directory).absolute())
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      probe = self.directory / f".write_probe_{os.getpid()}_{jax.process_index()}"
      probe.write_bytes(b"")
      probe.unlink()
    except OSError as error:
      raise CheckpointError(
          f"checkpoint directory {self.directory} is not writable ({error.strerror or error}); "
          "point the workdir at a writable location or fix its permissions") from error
    self._save_interval_steps = save_interval_steps
    options = ocp.CheckpointManagerOptions(
        preservation_policy=checkpoint_managers.LatestN(keep),
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,  # leftovers of a crash mid-save
        create=not active_processes,  # Orbax cannot create it then; mkdir above did
        # multi-process runs whose sampler processes hold no train state: only the trainer
        # processes take part in saves and restores (and in Orbax's barriers)
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=min(active_processes), active_processes=set(active_processes))
        if active_processes else ocp.options.MultiprocessingOptions(),
    )
    # Handlers are named up front so a fresh process can read metadata before any save.
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                "keys": ocp.JsonCheckpointHandler()}
    self._manager = deadlines.call(
        ocp.CheckpointManager, self.directory, options=options, item_handlers=handlers,
        what="Orbax's opening of the checkpoint directory", where=str(self.directory))
    self._checksum_thread: threading.Thread | None = None
    self._checksum_error: tuple[int, BaseException] | None = None
    self._saving: int | None = None  # the newest step a save was started for
    self._saving_bytes = 0  # this process's bytes in that save
    steps = self._manager.all_steps()  # listed by Orbax just now
    self._committed: int | None = max(steps) if steps else None  # newest step known complete

  def save(self, step: int, state: Any, meta: Mapping[str, Any], *, force: bool = False) -> bool:
    """Starts saving `state` and `meta` as checkpoint `step`.

    Returns True if a save was started; False if `step` is not on the save interval (and `force`
    is off) or is already saved (so a final forced save after a scheduled one is harmless).
    """
    if not isinstance(step, int) or step < 0:
      raise CheckpointError(f"step must be an int >= 0, got {step!r}")
    _check_meta(meta)
    if step in self._manager.all_steps():
      return False
    if not force and step % self._save_interval_steps:
      return False
    # Orbax waits for the previous save here anyway; its checksums are written by then, so a
    # later save's clean-up never deletes a step while it is being hashed.
    self.wait()
    encoded, key_impls = encode_typed_keys(state)
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(encoded),
        meta=ocp.args.JsonSave(dict(meta)),
        keys=ocp.args.JsonSave({"format_version": CHECKPOINT_FORMAT_VERSION, "impls": key_impls}),
    )
    nbytes = _local_bytes(encoded)
    try:
      # synchronous: the copy to host memory (and, without async_save, the whole write)
      started = bool(deadlines.call(
          self._manager.save, step, args=args, force=True, nbytes=nbytes,
          what=f"Orbax's save of checkpoint step {step}", where=str(self.directory / str(step))))
    except (OSError, ValueError) as error:
      raise self._save_failed(step, error) from error
    if started:
      self._saving, self._saving_bytes = step, nbytes
      self._start_checksums(step)
    return started

  def saving(self) -> bool:
    """True while a started save is not complete (its commit or its checksums)."""
    thread = self._checksum_thread
    return thread is not None and thread.is_alive()

  def resume_point(self) -> str:
    """The checkpoint a rerun resumes from, as far as this process knows without any I/O (for
    messages written while storage may not answer)."""
    committed = self._committed
    text = (f"step {committed} ({self.directory / str(committed)})" if committed is not None
            else "step 0 (no complete checkpoint yet)")
    if self._saving is not None and self._saving != committed:
      text += f", or step {self._saving} if its save completed"
    return text

  def _save_failed(self, step: int, error: BaseException) -> CheckpointError:
    timeout = _storage_timeout_in(error)
    if timeout is not None:  # its message says what waited, where, and where a rerun resumes
      return timeout
    return CheckpointError(f"checkpoint {self.directory / str(step)} could not be written "
                           f"({error}); {resume_hint(self.directory)}")

  def _start_checksums(self, step: int) -> None:
    """Hashes step `step` in the background once Orbax has committed it (training goes on)."""

    def write():
      try:
        self._manager.wait_until_finished()
        step_dir = self.directory / str(step)
        if step_dir.is_dir() and jax.process_index() == 0:
          write_checksums(step_dir)
      except BaseException as error:  # pylint: disable=broad-except  # re-raised by the owner
        self._checksum_error = (step, error)

    self._checksum_thread = threading.Thread(target=write, name=f"checksums-{step}", daemon=True)
    self._checksum_thread.start()

  def _finish_checksums(self) -> None:
    """Waits for the checksum thread (within a storage call's deadline); raises what it failed
    with."""
    thread = self._checksum_thread
    if thread is not None:
      limit = deadlines.deadline_for(self._saving_bytes)  # a local step is read back whole
      thread.join(limit)
      if thread.is_alive():
        raise deadlines.timed_out(f"the checksums of checkpoint step {self._saving}",
                                  str(self.directory / str(self._saving)), limit)
      self._checksum_thread = None
    if self._checksum_error is not None:
      step, error = self._checksum_error
      self._checksum_error = None
      raise self._save_failed(step, error) from error

  def latest_step(self) -> int | None:
    """The highest step among complete checkpoints, or None if there is none.

    (Orbax's own `latest_step` is the most recently written one, which differs after an
    out-of-order forced save.)
    """
    steps = self._manager.all_steps()
    return max(steps) if steps else None

  def all_steps(self) -> list[int]:
    """Steps of every complete checkpoint on disk, ascending."""
    return sorted(self._manager.all_steps())

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """Restores checkpoint `step` onto the shapes, dtypes and shardings of `abstract_state`.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (or arrays) with the structure of the
    saved state; typed PRNG keys are given with their key dtype. Returns (state, meta).

    Raises:
      CheckpointCorruptError: the step's files differ from their checksums, or a floating-point
        array holds NaN / inf (the message names the file or the leaf).
      CheckpointError: the step is missing, unreadable, of another format version (its `keys`
        item or its CHECKSUMS.json), or its structure differs from `abstract_state`.
    """
    self.wait()
    if step not in self._manager.all_steps():
      raise CheckpointError(
          f"no complete checkpoint for step {step} under {self.directory}; "
          f"available: {self.all_steps()}")
    step_dir = self.directory / str(step)
    if not verify_checksums(step_dir):
      log.warning("checkpoint %s has no %s (the run stopped right after saving it); restoring it "
                  "unverified", step_dir, CHECKSUMS_FILE)
    try:
      keys = deadlines.call(self._manager.restore, step,
                            args=ocp.args.Composite(keys=ocp.args.JsonRestore()),
                            what=f"the read of checkpoint step {step}'s key layout",
                            where=str(step_dir))["keys"]
    except (OSError, ValueError, KeyError) as error:
      raise CheckpointError(
          f"{step_dir} has no readable key layout ({_first_line(error)}); it was not written by "
          "reasoning_rl.checkpointing or is damaged") from error
    check_format(step_dir, keys)
    try:
      key_impls = keys["impls"]
    except (KeyError, TypeError) as error:
      raise CheckpointError(f"{step_dir / 'keys'} has no key layout ({error!r}); it was not "
                            "written by reasoning_rl.checkpointing or is damaged") from None
    target = restore_target(abstract_state)
    self._check_matches(step, abstract_state, target, key_impls)
    try:
      restored = deadlines.call(
          self._manager.restore, step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
          nbytes=_abstract_bytes(target), what=f"Orbax's restore of checkpoint step {step}",
          where=str(step_dir))
    except StorageTimeout:
      raise
    except Exception as error:  # Orbax and TensorStore raise many types for unreadable data
      timeout = _storage_timeout_in(error)
      if timeout is not None:
        raise timeout from error
      raise CheckpointError(f"restoring {step_dir} failed: {_first_line(error)}") from error
    bad = nonfinite_leaves(restored["state"])
    if bad:
      raise CheckpointCorruptError(
          f"{step_dir}: leaf {bad[0]} holds NaN or inf"
          + (f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else ""))
    state = decode_typed_keys(abstract_state, restored["state"], key_impls)
    return state, dict(restored["meta"])

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
    """(step, state, meta) of the newest intact checkpoint, or None if there is none.

    A step that fails its checksums or holds non-finite values is moved to `corrupt-<step>` (with
    a warning naming it) and the previous step is tried. Raises CheckpointError when steps exist
    but none is intact (they are all moved aside by then, so a rerun starts from scratch).
    """
    self.wait()
    moved = []
    for step in reversed(self.all_steps()):
      try:
        state, meta = self.restore(step, abstract_state)
      except CheckpointCorruptError as error:
        moved.append(self._move_aside(step))
        log.warning("checkpoint step %d is corrupt (%s); moved it to %s and trying the previous "
                    "step", step, error, moved[-1])
        continue
      return step, state, meta
    if moved:
      raise CheckpointError(
          f"no intact checkpoint under {self.directory}: moved {[p.name for p in moved]} aside "
          "(see the warnings); inspect them, then rerun to start from step 0")
    return None

  def _move_aside(self, step: int):
    """Renames step `step` to corrupt-<step> (corrupt-<step>.2 … if taken); never deletes it."""
    target = self.directory / f"{CORRUPT_PREFIX}{step}"
    suffix = 1
    while target.exists():
      suffix += 1
      target = self.directory / f"{CORRUPT_PREFIX}{step}.{suffix}"
    try:
      storage.move(self.directory / str(step), target)
    except OSError as error:
      raise CheckpointError(f"checkpoint {self.directory / str(step)} is corrupt and could not be "
                            f"moved aside ({error.strerror}); move or delete it by hand") from error
    deadlines.call(self._manager.reload, what="Orbax's listing of the checkpoints",
                   where=str(self.directory))
    steps = self._manager.all_steps()
    self._committed = max(steps) if steps else None
    return target

  def _check_matches(self, step: int, abstract_state: Any, target: Any,
                     key_impls: Mapping[str, str]) -> None:
    """Raises CheckpointError naming the first leaf whose structure, shape or dtype differs."""
    step_dir = self.directory / str(step)
    try:
      saved = deadlines.call(self._manager.item_metadata, step,
                             what=f"the read of checkpoint step {step}'s array metadata",
                             where=str(step_dir))["state"]
    except StorageTimeout:
      raise
    except Exception as error:  # Orbax raises many types for unreadable metadata
      raise CheckpointError(f"{step_dir}: unreadable array metadata ({_first_line(error)}); the "
                            "checkpoint is damaged, restore an earlier step") from error
    saved = getattr(saved, "tree", saved)  # Orbax wraps the array metadata in a TreeMetadata
    saved_leaves = dict(
        (leaf_path_name(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(saved))
    wanted = dict(
        (leaf_path_name(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(target))
    missing = sorted(set(wanted) - set(saved_leaves))
    extra = sorted(set(saved_leaves) - set(wanted))
    if missing or extra:
      raise CheckpointError(
          f"{step_dir} does not have the structure of the state to restore: leaves not in the "
          f"checkpoint {missing[:5]}, leaves only in the checkpoint {extra[:5]}; build the model "
          "and optimizer with the config the checkpoint was written with")
    for path, abstract_leaf in jax.tree_util.tree_leaves_with_path(abstract_state):
      name = leaf_path_name(path)
      if is_typed_key(abstract_leaf) != (name in key_impls):
        raise CheckpointError(
            f"{step_dir}: leaf {name} is a typed PRNG key on one side only; keep key leaves as "
            "jax.random.key arrays (or as raw uint32 data) consistently")
    for name, leaf in wanted.items():
      on_disk = saved_leaves[name]
      if tuple(on_disk.shape) != tuple(leaf.shape) or on_disk.dtype != leaf.dtype:
        raise CheckpointError(
            f"{step_dir}: leaf {name} is {on_disk.dtype}{list(on_disk.shape)} in the checkpoint "
            f"but {leaf.dtype}{list(leaf.shape)} is asked for; restore with the config the "
            "checkpoint was written with")

  def wait(self) -> None:
    """Blocks until every started save is complete on disk, its checksums included; a save
    that failed in the background (a full disk, say) raises CheckpointError here, one that
    storage did not finish within its deadline StorageTimeout."""
    step = self._saving
    try:
      deadlines.call(self._manager.wait_until_finished, nbytes=self._saving_bytes,
                     what="Orbax's commit of " + (f"checkpoint step {step}" if step is not None
                                                   else "the checkpoints"),
                     where=str(self.directory if step is None else self.directory / str(step)))
    except StorageTimeout:
      raise
    except Exception as error:  # pylint: disable=broad-except  # Orbax re-raises its thread's
      if self._checksum_thread is not None:  # it saw the same failure: one report is enough
        self._checksum_thread.join(deadlines.deadline_for())
        self._checksum_thread = None
      self._checksum_error = None
      raise self._save_failed(step, error) from error
    self._finish_checksums()
    if step is not None:
      self._committed = step if self._committed is None else max(self._committed, step)

  def close(self) -> None:
    """Finishes pending saves and releases Orbax's threads. After a failed save the save's
    CheckpointError is what is raised (closing Orbax then may fail on the same cause); after a
    StorageTimeout Orbax is left as it is (its threads wait on the store, and closing it would
    join them)."""
    try:
      self.wait()
    except StorageTimeout:
      raise
    except BaseException:
      with contextlib.suppress(Exception):
        deadlines.call(self._manager.close, what="closing Orbax's checkpoint manager",
                       where=str(self.directory))
      raise
    deadlines.call(self._manager.close, what="closing Orbax's checkpoint manager",
                   where=str(self.directory))

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
