"""Logit parity with transformers for every family, and the KV-cache path against the full one.

Our side runs compiled (`jax.jit`): op-by-op dispatch of a whole model takes several times
longer on this project's shared CPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from reasoning_rl.models import KVCache
from reasoning_rl.models.checkpoints import hf_tensors, load_hf_weights
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import positions_from_mask
from tests.hf_reference import (FAMILIES, SMALL, reference_logits, saved_name_grads,
                                write_tiny_model)
from tests.support.parity import decoded_logits, full_logits, left_padded_batch


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_checkpoint(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  torch_model = write_tiny_model(request.param, directory)
  return request.param, directory, torch_model


def test_left_padded_logits_match_transformers(family_checkpoint):
  family, directory, torch_model = family_checkpoint
  model, _ = load_hf_weights(directory)
  ids, mask = left_padded_batch(model.config.vocab_size)
  ours = full_logits(model, ids, mask)
  for row, ref in enumerate(reference_logits(torch_model, ids, mask)):
    np.testing.assert_allclose(ours[row][mask[row] > 0], ref, atol=1e-4, rtol=0,
                               err_msg=f"{family} row {row}")


def test_weight_gradients_match_torch_autograd(family_checkpoint):
  """The backward pass against an independent one: d/dW of a fixed linear function of the logits
  of a left-padded batch, ours (jax.grad) against torch autograd on each row's real tokens alone,
  for every weight (projections, norms, the embedding through both of its uses when tied; a
  sparse layer's router, each of its experts and its shared experts). Buffers (DeepSeek-V3's
  selection bias) are not weights, here as in torch."""
  family, directory, torch_model = family_checkpoint
  model, _ = load_hf_weights(directory)
  ids, mask = left_padded_batch(model.config.vocab_size, seed=2)
  probe = np.random.RandomState(3).randn(*ids.shape, model.config.vocab_size).astype(np.float32)
  probe *= mask[..., None]
  graphdef, params, buffers = nnx.split(model, nnx.Param, ...)

  def loss(params):
    logits = nnx.merge(graphdef, params, buffers)(jnp.asarray(ids), jnp.asarray(mask))
    return jnp.sum(logits * probe)

  ours = nnx.to_flat_state(jax.jit(jax.grad(loss))(params))
  torch_model.zero_grad()
  total = sum((torch_model(torch.tensor(row[keep > 0][None])).logits[0]
               * torch.tensor(weights[keep > 0])).sum()
              for row, keep, weights in zip(ids, mask, probe))
  total.backward()
  reference = saved_name_grads(torch_model, family)
  torch_model.zero_grad()
  compared = 0
  for path, grad in ours:
    mapping = hf_tensors(tuple(path), model.config)
    for name, value in zip(mapping.names, mapping.to_hf(np.asarray(grad[...]))):
      expected = reference[name]
      np.testing.assert_allclose(value, expected, rtol=1e-3,
                                 atol=1e-4 * np.abs(expected).max(), err_msg=f"{family} {name}")
      compared += 1
  assert compared == len(reference)


def test_kv_cache_prefill_then_decode_equals_full_forward(family_checkpoint):
  family, directory, _ = family_checkpoint
  model, _ = load_hf_weights(directory)
  ids, mask = left_padded_batch(model.config.vocab_size, seed=1)
  full = full_logits(model, ids, mask)
  cached = decoded_logits(model, ids, mask, KVCache.init(model.config, batch=3, max_len=16),
                          prompt_len=6)
  valid = mask > 0
  np.testing.assert_allclose(cached[valid], full[valid], atol=2e-5, rtol=0, err_msg=family)


@pytest.mark.parametrize("family, config", [
    ("llama", lambda: transformers.LlamaConfig(**SMALL, attention_bias=True)),
    ("qwen3", lambda: transformers.Qwen3Config(**SMALL, attention_bias=True)),
])
def test_attention_bias_reaches_the_output_projection_where_transformers_puts_one(
    tmp_path, family, config):
  """Llama's and Qwen3's `attention_bias` biases o_proj too (Qwen2's never does): read from
  config.json as `attention_output_bias`, loaded, and written back."""
  torch_model = write_tiny_model(family, tmp_path, config=config())
  model, _ = load_hf_weights(tmp_path)
  assert model.config.attention_output_bias
  ids, mask = left_padded_batch(model.config.vocab_size)
  ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  for row, ref in enumerate(reference_logits(torch_model, ids, mask)):
    np.testing.assert_allclose(ours[row][mask[row] > 0], ref, atol=1e-4, rtol=0)
  assert ModelConfig.from_hf_config(model.config.to_hf_config()) == model.config


def test_bfloat16_model_tracks_float32(tmp_path):
  directory = tmp_path / "qwen2"
  write_tiny_model("qwen2", directory)
  f32, _ = load_hf_weights(directory, dtype="float32")
  bf16, _ = load_hf_weights(directory, dtype="bfloat16")
  assert bf16.embed[...].dtype == jnp.bfloat16
  ids, mask = left_padded_batch(f32.config.vocab_size)
  a = np.asarray(f32(jnp.asarray(ids), jnp.asarray(mask)))
  b = np.asarray(bf16(jnp.asarray(ids), jnp.asarray(mask)))
  valid = mask > 0
  assert b.dtype == np.float32
  # bfloat16 keeps 8 mantissa bits: logits agree to a few percent of their scale, not exactly.
  assert np.abs(a[valid] - b[valid]).max() < 0.05 * np.abs(a[valid]).max()
  assert np.abs(a[valid] - b[valid]).max() > 0  # it really computed in bfloat16


def test_positions_from_mask_ignore_padding():
  from reasoning_rl.models.transformer import positions_from_mask

  mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(positions_from_mask(mask),
                                [[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4]])
