"""Rotary position embeddings: the angles against float64, the rotation against its definition
(Su et al. 2021, RoFormer, eq. 34, in the halves layout), and one sin / cos per forward however
many layers use them."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reasoning_rl.models import ModelConfig
from reasoning_rl.models.primitives import apply_rope, rope_angles
from reasoning_rl.models.transformer import RopeTable, create_model

HEAD_DIM = 16
INV_FREQ = (1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)).astype(np.float32)
POSITIONS = np.array([[-1, 0, 1, 2, 700], [3, 4, 5, 4095, 65000]], np.int32)


@pytest.mark.parametrize("factor", [1.0, 0.7])
def test_angles_are_cos_and_sin_of_position_times_frequency(factor):
  cos, sin = jax.jit(lambda p: rope_angles(p, jnp.asarray(INV_FREQ), factor))(POSITIONS)
  assert cos.shape == sin.shape == (2, 5, 1, HEAD_DIM)
  # float32 angles, as the model forms them, then cos / sin in float64
  angles = (POSITIONS.astype(np.float32)[..., None] * INV_FREQ).astype(np.float64)
  angles = np.concatenate([angles, angles], -1)[:, :, None, :]
  np.testing.assert_allclose(np.asarray(cos), factor * np.cos(angles), atol=2e-7)
  np.testing.assert_allclose(np.asarray(sin), factor * np.sin(angles), atol=2e-7)


def test_rotation_turns_each_half_pair_by_its_angle():
  x = np.random.default_rng(0).standard_normal((2, 5, 3, HEAD_DIM)).astype(np.float32)
  rotated = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(POSITIONS), jnp.asarray(INV_FREQ)))
  half = HEAD_DIM // 2
  theta = (POSITIONS.astype(np.float32)[..., None] * INV_FREQ).astype(np.float64)[:, :, None, :]
  first, second = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
  expected = np.concatenate([first * np.cos(theta) - second * np.sin(theta),
                             second * np.cos(theta) + first * np.sin(theta)], -1)
  np.testing.assert_allclose(rotated, expected, atol=2e-5)
  # a rotation keeps every pair's length
  np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1),
                             rtol=1e-5)


def test_a_table_without_the_forward_angles_says_so():
  with pytest.raises(ValueError, match="at\\(positions\\)"):
    RopeTable(jnp.asarray(INV_FREQ)).apply(jnp.zeros((1, 2, 1, HEAD_DIM)))


def test_a_forward_computes_sin_and_cos_once_not_per_layer():
  """XLA:CPU duplicates sin and cos into each consumer's fusion unless `rope_angles` takes them of
  the half-width angles: taken of the concatenated angles, as before, this 6-layer forward and
  its gradient held 42 of each."""
  model = create_model(ModelConfig(model_type="qwen2", vocab_size=97, hidden_size=32,
                                   intermediate_size=48, num_layers=6, num_heads=4,
                                   num_kv_heads=2, head_dim=HEAD_DIM,
                                   max_position_embeddings=256), seed=0)
  graphdef, params = nnx.split(model)
  ids = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)

  def loss(params):
    return nnx.merge(graphdef, params)(ids).astype(jnp.float32).mean()

  hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
  assert len(re.findall(r" cosine\(", hlo)) == 1
  assert len(re.findall(r" sine\(", hlo)) == 1
