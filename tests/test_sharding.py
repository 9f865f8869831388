"""Meshes, partition rules, sharded loading and trainer -> sampler resharding on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from reasoning_rl import sharding
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.checkpoints import load_hf_weights
from tests.hf_reference import write_tiny_model


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("qwen2")
  write_tiny_model("qwen2", directory)
  return directory


def test_eight_devices_are_simulated():
  assert jax.device_count() == 8


def test_make_mesh_shapes_and_errors():
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert dict(sharding.make_mesh((1, -1, 2)).shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  with pytest.raises(ConfigError, match="mesh.*needs 12 devices"):
    sharding.make_mesh((3, 2, 2))
  with pytest.raises(ConfigError, match="unknown mesh axes"):
    sharding.make_mesh({"model": 8})
  with pytest.raises(ConfigError, match="num_trainer_devices"):
    sharding.split_devices(8)


def test_logical_rules_shard_only_divisible_dimensions():
  mesh = sharding.make_mesh((2, 2, 2))
  assert sharding.logical_to_spec(("embed", "heads", "head_dim"), (64, 4, 16), mesh) == P(
      "fsdp", "tensor", None)
  # 3 KV heads (SmolLM2) do not split over a tensor axis of 2: replicated there.
  assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (576, 3, 64), mesh) == P(
      "fsdp", None, None)
  assert sharding.logical_to_spec(("batch", "length"), (8, 5), mesh) == P(("data", "fsdp"), None)
  # A mesh axis is never used twice in one array.
  assert sharding.logical_to_spec(("mlp", "vocab"), (4, 4), mesh) == P("tensor", None)


def test_sharded_load_places_every_parameter_and_keeps_logits(qwen2_dir):
  mesh = sharding.make_mesh((2, 2, 2))
  sharded, _ = load_hf_weights(qwen2_dir, mesh=mesh)
  single, _ = load_hf_weights(qwen2_dir)
  _, state = nnx.split(sharded)
  expected = sharding.param_shardings(state, mesh)
  flat_actual = nnx.to_flat_state(state)
  flat_expected = dict(nnx.to_flat_state(expected))
  split_params = 0
  for path, var in flat_actual:
    value = var[...]
    assert value.sharding.is_equivalent_to(flat_expected[path], value.ndim), path
    split_params += any(axis is not None for axis in flat_expected[path].spec)
    # each device holds only its shard
    shard_shape = value.addressable_shards[0].data.shape
    assert shard_shape == flat_expected[path].shard_shape(value.shape), path
  assert split_params >= 10  # projections, MLP and embedding really are split

  ids = jnp.asarray(np.random.RandomState(0).randint(0, 97, size=(4, 7)))
  ids_sharded = jax.device_put(ids, sharding.batch_sharding(mesh, 2))
  logits = jax.jit(lambda m, x: m(x))(sharded, ids_sharded)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(single(ids)), atol=1e-5, rtol=0)


def test_reshard_trainer_to_sampler_is_bit_identical(qwen2_dir):
  trainer_devices, sampler_devices = sharding.split_devices(4)
  trainer_mesh = sharding.make_mesh((1, 2, 2), trainer_devices, field="trainer_mesh")
  sampler_mesh = sharding.make_mesh((1, 1, 4), sampler_devices, field="sampler_mesh")
  model, _ = load_hf_weights(qwen2_dir, mesh=trainer_mesh)
  _, state = nnx.split(model)
  params = nnx.to_pure_dict(state)
  targets = nnx.to_pure_dict(sharding.param_shardings(state, sampler_mesh))
  moved = sharding.reshard(params, targets)
  for (path, before), (_, after) in zip(jax.tree_util.tree_leaves_with_path(params),
                                        jax.tree_util.tree_leaves_with_path(moved)):
    assert set(after.sharding.device_set) <= set(sampler_devices), path
    # exact: resharding copies bytes between devices, no arithmetic
    np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
