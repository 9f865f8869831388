"""Policy models: the transformer family, checkpoint I/O and tokenizers.

`load(path)` accepts a Hugging Face directory (config.json + *.safetensors + tokenizer files) or a
`.gguf` file and returns `(model, tokenizer)`; `save_hf` writes a directory transformers can load.
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
  """Loads `(model, tokenizer)` from a Hugging Face directory, a GGUF file or a training run.

  Args:
    path: a directory with config.json, *.safetensors (single or sharded) and tokenizer.json or
      tokenizer.model; or a `.gguf` file (weights dequantised, vocabulary and chat template read
      from its metadata); or a training run's workdir (its newest complete checkpoint) or one of
      its `checkpoints/<step>` directories.
    dtype: compute dtype, "float32" or "bfloat16"; also the parameters' unless `weight_dtype`.
    weight_dtype: the parameters' dtype when it differs from the compute dtype (a trainer's
      float32 master weights under bfloat16 compute: reasoning_rl/precision.py).
    mesh: a `jax.sharding.Mesh` with axes (data, fsdp, tensor); each parameter is placed straight
      onto its sharding from `reasoning_rl.sharding`. None places everything on the default device.

  Raises:
    CheckpointError: naming the file or tensor at fault and what to do.
  """
  from reasoning_rl.models import tokenizers

  dtypes = {"dtype": dtype, "weight_dtype": weight_dtype or dtype}
  if storage.is_remote(path):
    from reasoning_rl.models.run_checkpoint import load_from_run

    loaded = load_from_run(path, **dtypes, mesh=mesh)  # Orbax reads gs:// itself
    if loaded is not None:
      return loaded
    path = storage.local_copy(path)  # GGUF / safetensors readers memory-map local files
  path = pathlib.Path(path)
  if path.suffix == ".gguf":

    model, reader = load_gguf_weights(path, **dtypes, mesh=mesh)
    return model, tokenizers.Tokenizer.from_gguf(reader)
  if path.is_dir():
    from reasoning_rl.models.run_checkpoint import load_from_run

    loaded = load_from_run(path, **dtypes, mesh=mesh)
    if loaded is not None:
      return loaded
    # Tokenizer first: it is cheap and its errors should not wait for the weights.
    tokenizer = tokenizers.Tokenizer.from_hf_dir(path) if (path / "config.json").exists() else None
    model, _ = load_hf_weights(path, **dtypes, mesh=mesh)
    return model, tokenizer
  if not path.exists():
    raise CheckpointError(f"{path}: no such file or directory")
  raise CheckpointError(
      f"{path}: not a model this loader knows; pass a Hugging Face directory (config.json + "
      "*.safetensors + tokenizer files), a .gguf file or a training run's workdir")


__all__ = ["CheckpointError", "KVCache", "ModelConfig", "Transformer", "create_model", "load",
           "save_hf"]
