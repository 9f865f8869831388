"""The arrays of a checkpoint's `state` as Orbax stores them: names, typed PRNG keys, NaN / inf.

Typed PRNG keys (`jax.random.key`) cannot be serialised as such, so a save stores each as its raw
`key_data` and records the leaf's PRNG implementation (`encode_typed_keys`); a restore reads the
key data onto the abstract form of the keys (`restore_target`) and wraps it back
(`decode_typed_keys`): the caller never sees the difference. Leaves are named by their path as
'a/b/0/c' (`leaf_path_name`) in the `keys` item, in errors and in `nonfinite_leaves`.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from reasoning_rl.errors import CheckpointError


def _key_name(key: Any) -> str:
  for attribute in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey / FlattenedIndexKey
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def leaf_path_name(path: tuple[Any, ...]) -> str:
  """A leaf's path as 'a/b/0/c', the same whether a level is a dict, a dataclass attribute or a
  list: Orbax stores every level as a dict, so the metadata read back names them differently."""
  return "/".join(_key_name(k) for k in path) or "<root>"


def is_typed_key(leaf: Any) -> bool:
  dtype = getattr(leaf, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def encode_typed_keys(state: Any) -> tuple[Any, dict[str, str]]:
  """Replaces typed PRNG keys by their uint32 data; returns the new tree and {leaf: impl}."""
  key_impls: dict[str, str] = {}

  def encode(path, leaf):
    if is_typed_key(leaf):
      key_impls[leaf_path_name(path)] = str(jax.random.key_impl(leaf))
      return jax.random.key_data(leaf)
    return leaf

  return jax.tree_util.tree_map_with_path(encode, state), key_impls


def _restore_target_leaf(path: tuple[Any, ...], leaf: Any) -> jax.ShapeDtypeStruct:
  """The restore target of one leaf; typed keys become the abstract form of their key data."""
  if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
    raise CheckpointError(
        f"abstract_state leaf {leaf_path_name(path)} is a {type(leaf).__name__}; pass a pytree of "
        "jax.ShapeDtypeStruct (or arrays), e.g. jax.eval_shape(init_fn) with shardings set")
  sharding = getattr(leaf, "sharding", None)
  if not is_typed_key(leaf):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
  data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
  if isinstance(sharding, jax.NamedSharding):
    # The trailing key-data axes are never split.
    extra = (None,) * (len(data.shape) - len(leaf.shape))
    sharding = jax.NamedSharding(sharding.mesh, jax.P(*sharding.spec, *extra))
  return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def restore_target(abstract_state: Any) -> Any:
  """What Orbax restores `abstract_state` (ShapeDtypeStruct or array leaves) onto: the same tree
  of jax.ShapeDtypeStruct, typed keys as the abstract form of their key data."""
  return jax.tree_util.tree_map_with_path(_restore_target_leaf, abstract_state)


def decode_typed_keys(abstract_state: Any, restored: Any, key_impls: Mapping[str, str]) -> Any:
  """`restored` (read onto `restore_target(abstract_state)`) with the key data of every typed
  key leaf of `abstract_state` wrapped back into keys of its recorded implementation."""

  def decode(path, abstract_leaf, leaf):
    if is_typed_key(abstract_leaf):
      return jax.random.wrap_key_data(leaf, impl=key_impls[leaf_path_name(path)])
    return leaf

  return jax.tree_util.tree_map_with_path(decode, abstract_state, restored)


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> list[jax.Array]:
  return [jnp.isfinite(leaf).all() for leaf in leaves]


def nonfinite_leaves(tree: Any) -> list[str]:
  """Paths ('a/b/0') of the floating-point leaves of `tree` that hold a NaN or an infinity."""
  named = [(leaf_path_name(path), leaf)
           for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
           if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)]
  if not named:
    return []
  flags = jax.device_get(_all_finite([leaf for _, leaf in named]))
  return [name for (name, _), finite in zip(named, flags) if not finite]
