"""The (value, count) stats convention: mean / min / max merging, finalize, all_reduce."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.rl import stats


def test_stats_merge_and_finalize():
  values = np.array([3.0, -1.0, 7.0, 2.0, 5.0])
  parts = [np.array([1, 1, 0, 0, 0], bool), np.array([0, 0, 1, 1, 0], bool),
           np.array([0, 0, 0, 0, 1], bool), np.zeros(5, bool)]
  per_part = [{"x": stats.mean_stat(values, p), "x/min": stats.min_stat(values, p),
               "x/max": stats.max_stat(values, p)} for p in parts]
  merged = stats.finalize(stats.merge_all(per_part))
  assert merged == {"x": pytest.approx(16 / 5), "x/min": -1.0, "x/max": 7.0}
  assert math.isnan(stats.finalize(per_part[3])["x/min"])
  # A name present in one dict only survives the merge unchanged; jax values merge too.
  mixed = stats.merge({"a": (jnp.float32(2.0), jnp.int32(1))}, {"b/max": (3.0, 1)})
  assert stats.finalize(mixed) == {"a": 2.0, "b/max": 3.0}
  assert stats.reduction_kind("ratio/min") == "min" and stats.reduction_kind("kl") == "sum"


def test_stats_all_reduce_across_devices():
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  values = np.arange(len(devices) * 3, dtype=np.float32).reshape(len(devices), 3) - 7.0
  valid = (np.arange(values.size).reshape(values.shape) % 3) != 1

  def per_shard(v, m):
    local = {"v": stats.mean_stat(v, m), "v/min": stats.min_stat(v, m),
             "v/max": stats.max_stat(v, m)}
    return stats.all_reduce(local, "data")

  spec = jax.sharding.PartitionSpec("data")
  reduced = jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, spec),
                          out_specs=jax.sharding.PartitionSpec())(values, valid)
  got = stats.finalize(reduced)
  expected = values[valid]
  assert got == {"v": pytest.approx(expected.mean()), "v/min": expected.min(),
                 "v/max": expected.max()}
