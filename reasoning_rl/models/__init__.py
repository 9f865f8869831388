"""Policy models: the transformer family, checkpoint I/O and tokenizers.

`load(path)` accepts a Hugging Face directory (config.json + *.safetensors + tokenizer files) or a
`.gguf` file and returns `(model, tokenizer)`; `save_hf` writes a directory transformers can load.
A training run's workdir is loaded one level up, by `reasoning_rl.run_checkpoint.load_model`
(which falls back to `load` for every other path): a LoRA run's policy needs `lora`, which builds
on this package.
"""

from __future__ import annotations

import os
import pathlib

from reasoning_rl import storage
from reasoning_rl.errors import CheckpointError
from reasoning_rl.models.checkpoints import load_hf_weights, save_hf
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.gguf_io import load_gguf_weights
from reasoning_rl.models.transformer import KVCache, Transformer, create_model


def load(path: str | os.PathLike, *, dtype: str = "float32", weight_dtype: str | None = None,
         mesh=None):
  """Loads `(model, tokenizer)` from a Hugging Face directory or a GGUF file.

  Args:
    path: a directory with config.json, *.safetensors (single or sharded) and tokenizer.json or
      tokenizer.model; or a `.gguf` file (weights dequantised, vocabulary and chat template read
      from its metadata). A training run's workdir is refused, naming
      `reasoning_rl.run_checkpoint.load_model`, which reads it.
    dtype: compute dtype, "float32" or "bfloat16"; also the parameters' unless `weight_dtype`.
    weight_dtype: the parameters' dtype when it differs from the compute dtype (a trainer's
      float32 master weights under bfloat16 compute: reasoning_rl/precision.py).
    mesh: a `jax.sharding.Mesh` with axes (data, fsdp, tensor); each parameter is placed straight
      onto its sharding from `reasoning_rl.sharding`. None places everything on the default device.

  Raises:
    CheckpointError: naming the file or tensor at fault and what to do.
  """
  # the tokenizer stack (tokenizers, sentencepiece) only when a tokenizer is read
  from reasoning_rl.models import tokenizers

  dtypes = {"dtype": dtype, "weight_dtype": weight_dtype or dtype}
  if _is_training_run(storage.path(path)):
    raise CheckpointError(f"{path}: a training run's workdir or checkpoint step; load it with "
                          "reasoning_rl.run_checkpoint.load_model")
  if storage.is_remote(path):
    path = storage.local_copy(path)  # GGUF / safetensors readers memory-map local files
  path = pathlib.Path(path)
  if path.suffix == ".gguf":

    model, reader = load_gguf_weights(path, **dtypes, mesh=mesh)
    return model, tokenizers.Tokenizer.from_gguf(reader)
  if path.is_dir():
    # Tokenizer first: it is cheap and its errors should not wait for the weights.
    tokenizer = tokenizers.Tokenizer.from_hf_dir(path) if (path / "config.json").exists() else None
    model, _ = load_hf_weights(path, **dtypes, mesh=mesh)
    return model, tokenizer
  if not path.exists():
    raise CheckpointError(f"{path}: no such file or directory")
  raise CheckpointError(
      f"{path}: not a model this loader knows; pass a Hugging Face directory (config.json + "
      "*.safetensors + tokenizer files) or a .gguf file")


def _is_training_run(path) -> bool:
  """Whether `path` looks like a training run's workdir (model/config.json beside checkpoints/)
  or one of its checkpoint steps: what `run_checkpoint.find_run_checkpoint` reads, told apart
  with a stat or two so that a gs:// run is not downloaded as a model directory first."""
  return ((path / "model" / "config.json").exists() or
          (path.name.isdigit() and path.parent.name == "checkpoints" and (path / "state").is_dir()))


__all__ = ["CheckpointError", "KVCache", "ModelConfig", "Transformer", "create_model", "load",
           "save_hf"]
