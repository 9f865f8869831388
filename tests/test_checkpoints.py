"""Checkpoint I/O: GGUF parity, save_hf round trips, and one clear error per kind of bad input."""

import json

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from reasoning_rl.errors import CheckpointError
from reasoning_rl.models import load, save_hf
from reasoning_rl.models.checkpoints import load_hf_weights
from tests.hf_reference import reference_logits, write_tiny_model


def _logits(model, ids, mask):
  return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))


def test_smollm2_gguf_logits_match_transformers(smollm2, smollm2_torch):
  model, _ = smollm2
  rng = np.random.RandomState(0)
  ids = rng.randint(0, model.config.vocab_size, size=(2, 24))
  mask = np.ones_like(ids)
  mask[0, :7] = 0
  ours = _logits(model, ids, mask)
  for row, ref in enumerate(reference_logits(smollm2_torch, ids, mask)):
    assert np.abs(ours[row][mask[row] > 0] - ref).max() <= 2e-3


def test_smollm2_config_read_from_gguf_metadata(smollm2):
  c = smollm2[0].config
  assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
          c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (
              "llama", 30, 576, 9, 3, 64, 49152, 100000.0, True)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_save_hf_round_trip_tiny(family, tmp_path):
  write_tiny_model(family, tmp_path / "src")
  model, _ = load_hf_weights(tmp_path / "src")
  save_hf(model, None, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  ids = np.random.RandomState(1).randint(0, 97, size=(2, 9))
  mask = np.ones_like(ids)
  ours = _logits(model, ids, mask)
  for row, ref in enumerate(reference_logits(reloaded, ids, mask)):
    np.testing.assert_allclose(ours[row], ref, atol=1e-4, rtol=0)


def test_save_hf_round_trip_smollm2_with_tokenizer(smollm2, tmp_path):
  model, tokenizer = smollm2
  out = save_hf(model, tokenizer, tmp_path / "smollm2")
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  text = "<|im_start|>user\nWhat is 12 × 7? Think in <think> tags.<|im_end|>\n"
  ids = tokenizer.encode(text)
  assert hf_tokenizer.encode(text) == ids
  with torch.no_grad():
    ref = hf_model(torch.tensor([ids])).logits[0].numpy()
  ours = _logits(model, np.array([ids]), np.ones((1, len(ids)), np.int32))[0]
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
  # and our own loader reads the saved directory back to the same function
  again, again_tokenizer = load(out)
  np.testing.assert_allclose(_logits(again, np.array([ids]), np.ones((1, len(ids)))), ours[None],
                             atol=1e-5, rtol=0)
  assert again_tokenizer.encode(text) == ids


# ------------------------------------------------------------------------------ bad input


@pytest.fixture
def tiny_dir(tmp_path):
  directory = tmp_path / "tiny"
  write_tiny_model("llama", directory)
  return directory


def test_missing_config_json(tiny_dir):
  (tiny_dir / "config.json").unlink()
  with pytest.raises(CheckpointError, match=r"config\.json: missing"):
    load(tiny_dir)


def test_unknown_model_type(tiny_dir):
  config = json.loads((tiny_dir / "config.json").read_text())
  config["model_type"] = "mamba"
  (tiny_dir / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match="model_type 'mamba' is not supported"):
    load_hf_weights(tiny_dir)


def test_tensor_with_wrong_shape(tiny_dir):
  config = json.loads((tiny_dir / "config.json").read_text())
  config["intermediate_size"] = 128  # weights hold 96
  (tiny_dir / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape"):
    load_hf_weights(tiny_dir)


def test_truncated_safetensors(tiny_dir):
  path = tiny_dir / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
    load_hf_weights(tiny_dir)


def test_missing_tensor(tiny_dir, tmp_path):
  from safetensors.numpy import load_file, save_file

  tensors = load_file(tiny_dir / "model.safetensors")
  del tensors["model.layers.1.self_attn.k_proj.weight"]
  save_file(tensors, tiny_dir / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' is "
                     "missing"):
    load_hf_weights(tiny_dir)


def test_gguf_of_unsupported_architecture(tmp_path):
  path = tmp_path / "tiny-gpt2.gguf"
  writer = gguf.GGUFWriter(str(path), "gpt2")
  writer.add_block_count(1)
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(CheckpointError, match="GGUF architecture 'gpt2' is not supported"):
    load(path)


def test_not_a_gguf_file(tmp_path):
  path = tmp_path / "broken.gguf"
  path.write_bytes(b"not a gguf file at all")
  with pytest.raises(CheckpointError, match="broken.gguf: not a readable GGUF file"):
    load(path)


def test_nonexistent_path(tmp_path):
  with pytest.raises(CheckpointError, match="no such file"):
    load(tmp_path / "nothing-here")
