"""A Hugging Face model directory on gs:// (the form a Cloud TPU user uploads with `gcloud storage
cp -r`) loads through `model.path=gs://…` on every process: each host stages the files once into
its local cache, checked against the objects' CRC32C, and a second load reads nothing again."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from reasoning_rl import storage
from reasoning_rl.data.debug_vocab import load_named_tokenizer
from reasoning_rl.models import load, save_hf
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model
from tests.support.cloud import BUCKET, emulator, remote  # noqa: F401 (fixtures)


@pytest.fixture
def uploaded_model(remote, tmp_path):  # noqa: F811
  """A tiny random Llama with the debug tokenizer, saved locally and copied to gs://."""
  tokenizer = load_named_tokenizer("debug_arithmetic")
  config = ModelConfig(model_type="llama", vocab_size=tokenizer.vocab_size, hidden_size=32,
                       intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                       pad_token_id=tokenizer.pad_id)
  local = save_hf(create_model(config, seed=3), tokenizer, tmp_path / "tiny")
  storage.copy_tree(local, f"{remote}/models/tiny")
  return local, f"{remote}/models/tiny"


def test_an_hf_directory_on_gcs_loads_like_the_local_one_and_is_staged_once(
    uploaded_model, tmp_path, monkeypatch):
  local, remote_dir = uploaded_model
  monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "host_cache"))
  fetched = []
  client = storage._fs_and_key(remote_dir)[0]  # noqa: SLF001 (gcsfs caches one client)
  real_get = client.get_file

  def counting_get(source, target, *args, **kwargs):
    fetched.append(source)
    return real_get(source, target, *args, **kwargs)

  monkeypatch.setattr(client, "get_file", counting_get)  # fsspec's sync methods are per instance
  model, tokenizer = load(remote_dir, dtype="bfloat16", weight_dtype="float32")
  reference, _ = load(local, dtype="bfloat16", weight_dtype="float32")
  names = sorted(os.path.basename(f) for f in fetched)
  assert "config.json" in names and "model.safetensors" in names
  for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                    nnx.to_flat_state(nnx.state(reference, nnx.Param))):
    assert got.value.dtype == want.value.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), str(path))
  ids = jax.numpy.asarray([tokenizer.encode("1+2=", add_special_tokens=False)])
  np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(reference(ids)))
  fetched.clear()
  load(remote_dir)  # the host's cache holds every file with its CRC32C: nothing is read again
  assert fetched == []


def test_a_missing_model_on_gcs_is_one_clear_error(emulator):  # noqa: F811
  from reasoning_rl.errors import CheckpointError

  with pytest.raises((FileNotFoundError, CheckpointError), match="no-such-model"):
    load(f"gs://{BUCKET}/models/no-such-model")
