"""Metrics kept as exact, mergeable reductions until they are logged (docs/architecture.md §4).

Convention
----------
A *stats dict* maps a metric name to a pair ``(value, count)`` of scalars. The name's suffix
says how pairs combine:

- ``".../min"``: ``value`` is the minimum over ``count`` items (``+inf`` when ``count == 0``);
- ``".../max"``: ``value`` is the maximum (``-inf`` when ``count == 0``);
- any other name: ``value`` is a *sum* over ``count`` items; the logged number is
  ``value / count``.

Merging two dicts adds the sums and counts and takes the min / max of the extrema, so the
result is exact for any split of the data: micro-batches inside a step, data-parallel devices
(:func:`all_reduce` inside ``shard_map``), or hosts (:func:`merge` on the host). Only
:func:`finalize` divides. Pairs are plain tuples of arrays, i.e. pytrees, so stats dicts pass
through ``jax.jit``, ``lax.scan`` carries and ``jax.tree.map`` unchanged.

This module also holds :func:`array_namespace`, which lets the loss and advantage functions
run on numpy arrays (float64, no compilation: handy on the host and in tests) and on jax
arrays (jittable) with one body of code.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

Stats = dict[str, tuple[Any, Any]]

MIN_SUFFIX = "/min"
MAX_SUFFIX = "/max"


def array_namespace(*arrays: Any) -> Any:
  """Returns ``jax.numpy`` if any argument is a jax array (or tracer), else ``numpy``."""
  if any(isinstance(a, jax.Array) for a in arrays):
    return jnp
  return np


def float_dtype(xp: Any, *dtypes: Any) -> Any:
  """At least float32, promoted with ``dtypes``; for jax limited to what is enabled (x64)."""
  dtype = xp.float32
  for d in dtypes:
    dtype = xp.promote_types(dtype, d)
  return jax.dtypes.canonicalize_dtype(dtype) if xp is jnp else dtype


def reduction_kind(name: str) -> str:
  """``"min"``, ``"max"`` or ``"sum"``: how the stat called ``name`` merges."""
  if name.endswith(MIN_SUFFIX):
    return "min"
  if name.endswith(MAX_SUFFIX):
    return "max"
  return "sum"


def _count(valid: Any, xp: Any) -> Any:
  return xp.sum(valid, dtype=xp.int32)


def mean_stat(values: Any, valid: Any) -> tuple[Any, Any]:
  """``(Σ values over valid, number of valid)``; invalid entries may hold anything (even NaN)."""
  xp = array_namespace(values, valid)
  return xp.sum(xp.where(valid, values, 0)), _count(valid, xp)


def min_stat(values: Any, valid: Any) -> tuple[Any, Any]:
  """``(min of values over valid, number of valid)``; ``+inf`` when nothing is valid."""
  xp = array_namespace(values, valid)
  return xp.min(xp.where(valid, values, xp.inf)), _count(valid, xp)


def max_stat(values: Any, valid: Any) -> tuple[Any, Any]:
  """``(max of values over valid, number of valid)``; ``-inf`` when nothing is valid."""
  xp = array_namespace(values, valid)
  return xp.max(xp.where(valid, values, -xp.inf)), _count(valid, xp)


def _merge_pair(name: str, a: tuple[Any, Any], b: tuple[Any, Any]) -> tuple[Any, Any]:
  xp = array_namespace(*a, *b)
  kind = reduction_kind(name)
  if kind == "min":
    value = xp.minimum(a[0], b[0])
  elif kind == "max":
    value = xp.maximum(a[0], b[0])
  else:
    value = a[0] + b[0]
  return value, a[1] + b[1]


def merge(a: Mapping[str, tuple[Any, Any]], b: Mapping[str, tuple[Any, Any]]) -> Stats:
  """Combines two stats dicts; a name present in only one of them is kept as is.

  Works on numpy and jax values, inside ``jit`` / ``scan`` too, so ``{}`` is a valid starting
  accumulator on the host (inside ``scan`` the carry needs a fixed structure: start from the
  first micro-batch's stats instead).
  """
  out: Stats = dict(a)
  for name, pair in b.items():
    out[name] = _merge_pair(name, out[name], pair) if name in out else pair
  return out


def merge_all(stats_dicts: Iterable[Mapping[str, tuple[Any, Any]]]) -> Stats:
  """Folds :func:`merge` over any number of stats dicts (e.g. one per host or micro-batch)."""
  out: Stats = {}
  for stats in stats_dicts:
    out = merge(out, stats)
  return out


def all_reduce(stats: Mapping[str, tuple[Any, Any]], axis_name: Any) -> Stats:
  """Merges a stats dict across a named mesh axis (inside ``shard_map`` / ``pmap``).

  Sums and counts go through ``psum``; extrema through ``pmin`` / ``pmax``.
  """
  out: Stats = {}
  for name, (value, count) in stats.items():
    kind = reduction_kind(name)
    if kind == "min":
      value = jax.lax.pmin(value, axis_name)
    elif kind == "max":
      value = jax.lax.pmax(value, axis_name)
    else:
      value = jax.lax.psum(value, axis_name)
    out[name] = (value, jax.lax.psum(count, axis_name))
  return out


def finalize(stats: Mapping[str, tuple[Any, Any]]) -> dict[str, float]:
  """Turns a stats dict into loggable floats (fetches device values to the host).

  Sums become ``sum / count``; extrema are reported as they are. A stat with ``count == 0``
  (e.g. the ratio minimum of a batch with no valid token) is reported as ``nan``.
  """
  out: dict[str, float] = {}
  for name, (value, count) in stats.items():
    value, count = float(np.asarray(value)), float(np.asarray(count))
    if count == 0:
      out[name] = math.nan
    elif reduction_kind(name) == "sum":
      out[name] = value / count
    else:
      out[name] = value
  return out
