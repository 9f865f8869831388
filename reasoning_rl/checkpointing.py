"""Training checkpoints: a thin layer over Orbax's `CheckpointManager`.

A checkpoint of step `s` holds three items in `DIRECTORY/<s>/`:

- `state`: a pytree of jax arrays (params, optimizer state, counters, RNG keys). Typed PRNG keys
  (`jax.random.key`) cannot be serialised as such, so they are stored as their raw `key_data` and
  re-wrapped on restore; the caller never sees the difference.
- `meta`: a JSON-able dict (data-source position, policy version, dynamic-sampling carry-over,
  a config snapshot …).
- `keys`: bookkeeping written by this module: which `state` leaves were typed keys and their PRNG
  implementation.

Atomicity comes from Orbax: a step is written into `<s>.orbax-checkpoint-tmp…` and renamed to `<s>`
only once every item is on disk, so a crash mid-save leaves a temporary directory that is never
mistaken for a checkpoint (and is removed when the next `Checkpointer` opens the directory).

Preemption: `install_preemption_handler()` turns SIGTERM into a flag the training loop polls with
`preemption_requested()`. The loop then saves (`save(step, …, force=True)`), calls `close()` and
exits with `PREEMPTED_EXIT_CODE`.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
from typing import Any, Callable, Mapping

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from reasoning_rl.errors import CheckpointError

# 128 + SIGTERM: what a shell reports for a SIGTERM-terminated process. Schedulers that requeue
# preempted jobs treat it as "killed, restart me", unlike 0 ("finished"); the checkpoint written
# before exiting is complete either way.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM

_preemption_event = threading.Event()


def _key_name(key: Any) -> str:
  for attribute in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey / FlattenedIndexKey
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def _path_name(path: tuple[Any, ...]) -> str:
  """A leaf's path as 'a/b/0/c', the same whether a level is a dict, a dataclass attribute or a
  list: Orbax stores every level as a dict, so the metadata read back names them differently."""
  return "/".join(_key_name(k) for k in path) or "<root>"


def _is_typed_key(leaf: Any) -> bool:
  dtype = getattr(leaf, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _encode_state(state: Any) -> tuple[Any, dict[str, str]]:
  """Replaces typed PRNG keys by their uint32 data; returns the new tree and {leaf: impl}."""
  key_impls: dict[str, str] = {}

  def encode(path, leaf):
    if _is_typed_key(leaf):
      key_impls[_path_name(path)] = str(jax.random.key_impl(leaf))
      return jax.random.key_data(leaf)
    return leaf

  return jax.tree_util.tree_map_with_path(encode, state), key_impls


def _abstract_leaf(path: tuple[Any, ...], leaf: Any) -> jax.ShapeDtypeStruct:
  """The restore target of one leaf; typed keys become the abstract form of their key data."""
  if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
    raise CheckpointError(
        f"abstract_state leaf {_path_name(path)} is a {type(leaf).__name__}; pass a pytree of "
        "jax.ShapeDtypeStruct (or arrays), e.g. jax.eval_shape(init_fn) with shardings set")
  sharding = getattr(leaf, "sharding", None)
  if not _is_typed_key(leaf):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
  data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
  if isinstance(sharding, jax.NamedSharding):
    # The trailing key-data axes are never split.
    extra = (None,) * (len(data.shape) - len(leaf.shape))
    sharding = jax.NamedSharding(sharding.mesh, jax.P(*sharding.spec, *extra))
  return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def _check_meta(meta: Mapping[str, Any]) -> None:
  if not isinstance(meta, Mapping):
    raise CheckpointError(f"meta must be a dict, got {type(meta).__name__}")
  try:
    json.dumps(meta, allow_nan=False)
  except (TypeError, ValueError) as error:
    raise CheckpointError(
        f"meta is not plain JSON ({error}); convert arrays with .tolist() / int() / float() and "
        "replace NaN/inf before saving") from error


class Checkpointer:
  """Saves and restores (`state`, `meta`) per training step under one directory.

  Args:
    directory: where step directories go; created if missing.
    keep: how many of the newest complete checkpoints to keep on disk.
    async_save: write arrays in a background thread; `save` returns once device buffers are
      copied, so the next step can run. Call `wait()` before reading the checkpoint back.
    save_interval_steps: `save` writes only steps that are multiples of this, unless `force=True`.
  """

  def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3,
               async_save: bool = True, save_interval_steps: int = 1):
    if not isinstance(keep, int) or keep < 1:
      raise CheckpointError(f"keep must be an int >= 1, got {keep!r}")
    if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
      raise CheckpointError(f"save_interval_steps must be an int >= 1, got {save_interval_steps!r}")
    self.directory = pathlib.Path(directory).absolute()
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      probe = self.directory / f".write_probe_{os.getpid()}"
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
        create=True,
    )
    # Handlers are named up front so a fresh process can read metadata before any save.
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                "keys": ocp.JsonCheckpointHandler()}
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

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
    encoded, key_impls = _encode_state(state)
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(encoded),
        meta=ocp.args.JsonSave(dict(meta)),
        keys=ocp.args.JsonSave({"impls": key_impls}),
    )
    try:
      return bool(self._manager.save(step, args=args, force=True))
    except (OSError, ValueError) as error:
      raise CheckpointError(f"saving step {step} under {self.directory} failed: {error}") from error

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
    """
    self.wait()
    if step not in self._manager.all_steps():
      raise CheckpointError(
          f"no complete checkpoint for step {step} under {self.directory}; "
          f"available: {self.all_steps()}")
    step_dir = self.directory / str(step)
    try:
      key_impls = self._manager.restore(
          step, args=ocp.args.Composite(keys=ocp.args.JsonRestore()))["keys"]["impls"]
    except (OSError, ValueError, KeyError) as error:
      raise CheckpointError(f"{step_dir} has no readable key layout ({error}); it was not written "
                            "by reasoning_rl.checkpointing or is damaged") from error
    target = jax.tree_util.tree_map_with_path(_abstract_leaf, abstract_state)
    self._check_matches(step, abstract_state, target, key_impls)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    except (OSError, ValueError, KeyError, TypeError) as error:
      raise CheckpointError(f"restoring {step_dir} failed: {error}") from error

    def decode(path, abstract_leaf, leaf):
      if _is_typed_key(abstract_leaf):
        return jax.random.wrap_key_data(leaf, impl=key_impls[_path_name(path)])
      return leaf

    state = jax.tree_util.tree_map_with_path(decode, abstract_state, restored["state"])
    return state, dict(restored["meta"])

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
    """(step, state, meta) of the newest complete checkpoint, or None if there is none."""
    self.wait()
    step = self.latest_step()
    if step is None:
      return None
    state, meta = self.restore(step, abstract_state)
    return step, state, meta

  def _check_matches(self, step: int, abstract_state: Any, target: Any,
                     key_impls: Mapping[str, str]) -> None:
    """Raises CheckpointError naming the first leaf whose structure, shape or dtype differs."""
    step_dir = self.directory / str(step)
    saved = self._manager.item_metadata(step)["state"]
    saved = getattr(saved, "tree", saved)  # Orbax wraps the array metadata in a TreeMetadata
    saved_leaves = dict(
        (_path_name(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(saved))
    wanted = dict(
        (_path_name(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(target))
    missing = sorted(set(wanted) - set(saved_leaves))
    extra = sorted(set(saved_leaves) - set(wanted))
    if missing or extra:
      raise CheckpointError(
          f"{step_dir} does not have the structure of the state to restore: leaves not in the "
          f"checkpoint {missing[:5]}, leaves only in the checkpoint {extra[:5]}; build the model "
          "and optimizer with the config the checkpoint was written with")
    for path, abstract_leaf in jax.tree_util.tree_leaves_with_path(abstract_state):
      name = _path_name(path)
      if _is_typed_key(abstract_leaf) != (name in key_impls):
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
    """Blocks until every started save is complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Finishes pending saves and releases Orbax's threads."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def install_preemption_handler(callback: Callable[[int], None] | None = None) -> None:
  """Makes SIGTERM set the flag `preemption_requested()` reports, then call `callback(signum)`.

  The handler does no I/O itself (a signal can arrive mid-save); the loop polls the flag once per
  step, saves with `force=True`, closes the Checkpointer and exits with `PREEMPTED_EXIT_CODE`.
  Must be called from the main thread (a Python rule for signal handlers). The flag is per
  process: on a multi-host slice the loop must agree on the step to save at across hosts (e.g.
  `jax.experimental.multihost_utils.reached_preemption_sync_point`) before saving; this function
  does not do that.
  """

  def handle(signum, frame):
    del frame
    _preemption_event.set()
    if callback is not None:
      callback(signum)

  signal.signal(signal.SIGTERM, handle)


def preemption_requested() -> bool:
  """True once SIGTERM has arrived after `install_preemption_handler()`."""
  return _preemption_event.is_set()


def clear_preemption_request() -> None:
  """Resets the flag (for tests, or a loop that chose to keep going)."""
  _preemption_event.clear()
