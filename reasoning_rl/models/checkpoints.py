"""Model weights in and out: Hugging Face directories (safetensors) and GGUF files.

Loading builds the model abstractly (no weights allocated), then reads the checkpoint one tensor at a
time, converts it to this project's layout, and places it directly on its target sharding: each
device receives only its own shard (`jax.make_array_from_callback`), never a full host copy per
device. Every tensor is checked against the shape the architecture expects before anything is
placed, and every failure raises one `CheckpointError` naming the file or tensor and what to do; a
half-loaded model is never returned. GPT-OSS's MXFP4 expert tensors are dequantized as they are
read (`reasoning_rl.models.mxfp4`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from reasoning_rl import sharding as sharding_lib
from reasoning_rl.errors import CheckpointError
from reasoning_rl.models import lora_merge, mxfp4
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.safetensors_io import SafetensorsDirectory
from reasoning_rl.models.transformer import Transformer, abstract_model, unstack_layers

Converter = Callable[[np.ndarray], np.ndarray]


# ------------------------------------------------------------------------------ layout mapping


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """How one of our parameters is stored in a Hugging Face checkpoint: as the tensors `names`,
  `to_ours(list of those tensors) -> our array` and `to_hf(our array) -> list of tensors` (in the
  order of `names`). A sparse layer's stacked experts are E tensors each (one per expert, as
  transformers writes them); every other parameter is one tensor."""

  names: tuple[str, ...]
  to_ours: Callable[[list[np.ndarray]], np.ndarray]
  to_hf: Callable[[np.ndarray], list[np.ndarray]]


# Our names of a sparse layer's parameters -> each family's per-expert HF names (after
# "model.layers.{i}."), the router's, and (DeepSeek-V3) its selection bias and shared experts'.
_EXPERT_NAMES = {
    "default": {"router": "mlp.gate.weight", "gate_proj": "mlp.experts.{e}.gate_proj.weight",
                "up_proj": "mlp.experts.{e}.up_proj.weight",
                "down_proj": "mlp.experts.{e}.down_proj.weight",
                "selection_bias": "mlp.gate.e_score_correction_bias",
                "shared_experts": "mlp.shared_experts.{projection}.weight"},
    "mixtral": {"router": "block_sparse_moe.gate.weight",
                "gate_proj": "block_sparse_moe.experts.{e}.w1.weight",
                "up_proj": "block_sparse_moe.experts.{e}.w3.weight",
                "down_proj": "block_sparse_moe.experts.{e}.w2.weight"},
}


# GPT-OSS's sparse layer: one tensor per parameter, experts stacked as ours ([E, fan-in, fan-out],
# gate and up interleaved in gate_up_proj); only the router's weight is transposed.
_GPT_OSS_EXPERT_NAMES = {
    "router": "mlp.router.weight", "router_bias": "mlp.router.bias",
    "gate_up_proj": "mlp.experts.gate_up_proj", "gate_up_bias": "mlp.experts.gate_up_proj_bias",
    "down_proj": "mlp.experts.down_proj", "down_bias": "mlp.experts.down_proj_bias",
}


def hf_tensors(path: tuple, config: ModelConfig) -> TensorMap:
  """For a parameter path of our model: its `TensorMap` (the HF tensors that hold it)."""
  sparse = path[0] == "layers" and config.layer_is_sparse(path[1]) and path[2] == "mlp"
  if sparse and config.model_type == "gpt_oss":
    name = f"model.layers.{path[1]}." + _GPT_OSS_EXPERT_NAMES[path[3]]
    if path[3] == "router":
      return TensorMap((name,), lambda ws: ws[0].T, lambda w: [w.T])
    return TensorMap((name,), lambda ws: ws[0], lambda w: [w])
  if sparse:
    names = _EXPERT_NAMES.get(config.model_type, _EXPERT_NAMES["default"])
    prefix = f"model.layers.{path[1]}."
    if path[3] == "router":
      return TensorMap((prefix + names["router"],), lambda ws: ws[0].T, lambda w: [w.T])
    if path[3] == "selection_bias":
      return TensorMap((prefix + names["selection_bias"],), lambda ws: ws[0], lambda w: [w])
    if path[3] == "shared_experts":  # one MLP: [fan-out, fan-in] linear weights, like any MLP's
      name = prefix + names["shared_experts"].format(projection=path[4])
      return TensorMap((name,), lambda ws: ws[0].T, lambda w: [w.T])
    template = prefix + names[path[3]]
    experts = config.moe.num_experts
    # HF stores each expert's projection as a [fan-out, fan-in] linear weight; ours are stacked
    # [E, fan-in, fan-out].
    return TensorMap(tuple(template.format(e=e) for e in range(experts)),
                     lambda ws: np.stack([w.T for w in ws]), lambda w: [x.T for x in w])
  name, to_ours, to_hf = hf_tensor_name(path, config)
  return TensorMap((name,), lambda ws: to_ours(ws[0]), lambda w: [to_hf(w)])


def hf_tensor_name(path: tuple, config: ModelConfig) -> tuple[str, Converter, Converter]:
  """For a parameter path of our model held in one HF tensor (every one but a sparse layer's
  experts, `hf_tensors`): (HF tensor name, HF->ours converter, ours->HF converter)."""
  identity = lambda w: w  # noqa: E731
  transpose = lambda w: w.T  # noqa: E731
  if path == ("embed",):
    return "model.embed_tokens.weight", identity, identity
  if path == ("lm_head",):
    return "lm_head.weight", transpose, transpose
  if path == ("final_norm", "scale"):
    return "model.norm.weight", identity, identity
  if path[0] != "layers":
    raise KeyError(path)
  prefix = f"model.layers.{path[1]}."
  rest = path[2:]
  norm_names = {
      "attn_norm": "input_layernorm",
      "mlp_norm": "pre_feedforward_layernorm" if config.sandwich_norms
                  else "post_attention_layernorm",
      "attn_post_norm": "post_attention_layernorm",
      "mlp_post_norm": "post_feedforward_layernorm",
  }
  if rest[0] in norm_names:
    return prefix + norm_names[rest[0]] + ".weight", identity, identity
  d = config.hidden_size
  if rest[0] == "mlp":
    return prefix + f"mlp.{rest[1]}.weight", transpose, transpose
  if rest[0] == "attn" and config.mla is not None:
    return _latent_attention_tensor(rest[1], prefix, config)
  if rest[0] == "attn":
    name = rest[1]
    if name in ("q_norm", "k_norm"):
      return prefix + f"self_attn.{name}.weight", identity, identity
    if name == "sinks":
      return prefix + "self_attn.sinks", identity, identity
    if name == "o_bias":
      return prefix + "self_attn.o_proj.bias", identity, identity
    if name in ("q_proj", "k_proj", "v_proj"):
      heads = config.num_heads if name == "q_proj" else config.num_kv_heads
      shape = (d, heads, config.head_dim)
      return (prefix + f"self_attn.{name}.weight", lambda w: w.T.reshape(shape),
              lambda w: w.reshape(d, -1).T)
    if name == "o_proj":
      shape = (config.num_heads, config.head_dim, d)
      return (prefix + "self_attn.o_proj.weight", lambda w: w.T.reshape(shape),
              lambda w: w.reshape(-1, d).T)
    if name in ("q_bias", "k_bias", "v_bias"):
      heads = config.num_heads if name == "q_bias" else config.num_kv_heads
      shape = (heads, config.head_dim)
      return (prefix + f"self_attn.{name[0]}_proj.bias", lambda w: w.reshape(shape),
              lambda w: w.reshape(-1))
  raise KeyError(path)


def _latent_attention_tensor(name: str, prefix: str,
                             config: ModelConfig) -> tuple[str, Converter, Converter]:
  """`hf_tensor_name` of a latent-attention parameter (`reasoning_rl.models.mla`)."""
  m, d, heads = config.mla, config.hidden_size, config.num_heads
  norms = {"q_a_norm": "q_a_layernorm", "kv_a_norm": "kv_a_layernorm"}
  if name in norms:
    return prefix + f"self_attn.{norms[name]}.weight", (lambda w: w), (lambda w: w)
  # Our kernels are [fan-in, fan-out axes…] (o_proj: [heads, v, D]); HF's linear weights are
  # [fan-out, fan-in] with the fan-out (or, for o_proj, the fan-in) axes flattened head-major.
  kernels = {"q_proj": (d, heads, m.qk_head_dim), "q_a_proj": (d, m.q_lora_rank),
             "q_b_proj": (m.q_lora_rank, heads, m.qk_head_dim),
             "kv_a_proj": (d, m.kv_lora_rank + m.qk_rope_head_dim),
             "kv_b_proj": (m.kv_lora_rank, heads, m.qk_nope_head_dim + m.v_head_dim)}
  hf_name = prefix + "self_attn." + {"kv_a_proj": "kv_a_proj_with_mqa"}.get(name, name) + ".weight"
  if name in kernels:
    shape = kernels[name]
    return hf_name, lambda w: w.T.reshape(shape), lambda w: w.reshape(shape[0], -1).T
  if name == "o_proj":
    shape = (heads, m.v_head_dim, d)
    return hf_name, lambda w: w.T.reshape(shape), lambda w: w.reshape(-1, d).T
  raise KeyError((prefix, name))


def _is_floating(dtype) -> bool:
  try:
    ml_dtypes.finfo(dtype)  # numpy's float types and ml_dtypes' (bfloat16 …)
  except ValueError:
    return False
  return True


def require_finite(array: np.ndarray, *, tensor: str, source) -> None:
  """Raises CheckpointError if a floating-point tensor read from `source` holds NaN or inf.

  Checked in blocks of 2**24 elements, so the temporary mask stays small for any tensor.
  """
  if not _is_floating(array.dtype):
    return
  flat = array.reshape(-1)
  block = 1 << 24
  for start in range(0, flat.size, block):
    if not np.isfinite(flat[start:start + block]).all():
      raise CheckpointError(f"{source}: tensor {tensor!r} holds NaN or inf values; the file is "
                            "damaged or the model diverged, re-download or re-export it")


def _flat_params(state) -> list[tuple[tuple, nnx.Variable]]:
  return [(tuple(path), var) for path, var in nnx.to_flat_state(state)]


def _dtype(dtype) -> jnp.dtype:
  try:
    return jnp.dtype(dtype)
  except TypeError:
    raise CheckpointError(f"dtype {dtype!r} is not a dtype; use 'float32' or 'bfloat16'") from None


def build_model(config: ModelConfig, read_tensor: Callable[[tuple, tuple, Converter], np.ndarray],
                *, dtype="float32", weight_dtype=None, mesh=None) -> Transformer:
  """Assembles a model whose every parameter comes from `read_tensor(path, expected_shape, ...)`.

  The model computes in `dtype`; its parameters are stored in `weight_dtype` (default: `dtype`).

  All tensors are read and validated before any is placed; placement uses the mesh's shardings (one
  shard per device) or the default device when `mesh` is None.
  """
  compute_dtype = _dtype(dtype)
  dtype = _dtype(weight_dtype or dtype)  # what each parameter is stored in
  graphdef, abstract_state = abstract_model(config, dtype=compute_dtype, param_dtype=dtype)
  flat = _flat_params(abstract_state)
  host = {path: read_tensor(path, tuple(var.shape)) for path, var in flat}
  shardings = (dict(_flat_params(sharding_lib.param_shardings(abstract_state, mesh)))
               if mesh is not None else {})

  # Copies (np.array(..., copy=True)): the host arrays may be read-only views of a memory-mapped
  # file, and a device buffer aliasing one would break when a train step donates it.
  def place(path, var):
    array = host[path]
    if mesh is None:
      return jnp.asarray(np.array(array, dtype=dtype, copy=True))
    sharding = shardings[path]
    return jax.make_array_from_callback(
        tuple(var.shape), sharding, lambda index: np.array(array[index], dtype=dtype, copy=True))

  values = {path: place(path, var) for path, var in flat}
  for path, var in flat:
    var.set_value(values[path])
  return nnx.merge(graphdef, abstract_state)


# ------------------------------------------------------------------------------ Hugging Face


def read_hf_config(directory: pathlib.Path) -> tuple[ModelConfig, dict[str, Any]]:
  config_path = directory / "config.json"
  if not config_path.exists():
    raise CheckpointError(
        f"{config_path}: missing. A Hugging Face model directory needs config.json beside its "
        "*.safetensors files (save the model with transformers' save_pretrained).")
  try:
    hf = json.loads(config_path.read_text())
  except ValueError as e:
    raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
  return ModelConfig.from_hf_config(hf, source=str(config_path)), hf


def body_config(config: ModelConfig) -> ModelConfig:
  """`config` for the decoder body alone: built with it, a Transformer holds no `lm_head`
  parameter (it is marked tied, so its logits would reuse the embedding: meaningless for a
  checkpoint without an LM head; such a model is used through `hidden_states` only)."""
  return dataclasses.replace(config, tie_word_embeddings=True)


def load_hf_weights(directory: str | os.PathLike, *, dtype="float32", weight_dtype=None,
                    mesh=None, lm_head: bool = True) -> tuple[Transformer, dict[str, Any]]:
  """Loads the weights of a Hugging Face directory; returns (model, raw config.json dict).

  `lm_head=False` loads the decoder body only (`body_config`): no output projection is read, so a
  checkpoint without `lm_head.weight` (a `*ForSequenceClassification` reward model, whose head is
  `score.weight`, read by `reasoning_rl.models.reward_model`) loads too; use the model's
  `hidden_states`, not its logits.
  """
  directory = pathlib.Path(directory)
  config, hf = read_hf_config(directory)
  if not lm_head:
    config = body_config(config)
  files = SafetensorsDirectory(directory)  # memory maps close when the last view is gone

  def read(path, shape):
    mapping = hf_tensors(path, config)
    expected = mapping.to_hf(np.broadcast_to(np.float32(0), shape))
    tensors = []
    for name, expected_tensor in zip(mapping.names, expected):
      quantized = mxfp4.is_stored_as_mxfp4(files, name)  # GPT-OSS's published experts
      if name not in files and not quantized:
        raise CheckpointError(
            f"{directory}: tensor {name!r} is missing from the safetensors files; the checkpoint "
            f"does not match config.json (model_type {config.model_type!r})")
      stored_shape = (mxfp4.dequantized_shape(files.shape(name + "_blocks")) if quantized
                      else files.shape(name))
      if tuple(stored_shape) != tuple(expected_tensor.shape):
        raise CheckpointError(
            f"{directory}: tensor {name!r} has shape {stored_shape} but config.json implies "
            f"{expected_tensor.shape}; the weights and config.json disagree")
      if quantized:
        tensor = mxfp4.dequantize(files.tensor(name + "_blocks"), files.tensor(name + "_scales"),
                                  name=f"{directory}: {name}")
      else:
        tensor = files.tensor(name)
      source = files.path(name + "_blocks" if quantized else name)
      require_finite(tensor, tensor=name, source=source)
      tensors.append(tensor)
    return mapping.to_ours(tensors)

  model = build_model(config, read, dtype=dtype, weight_dtype=weight_dtype, mesh=mesh)
  return model, hf


def save_hf(model: Transformer, tokenizer, directory: str | os.PathLike, *,
            merged: bool = False) -> pathlib.Path:
  """Writes model.safetensors, config.json, generation_config.json and the tokenizer files.

  transformers' `AutoModelForCausalLM.from_pretrained(directory)` loads the result with the same
  logits, so a trained policy can be served by HF / vLLM. Written to a temporary sibling directory
  and renamed, so a crash never leaves a half-written model. A model with LoRA adapters is written
  with `merged=True`: the weights W + α/r · A B (`reasoning_rl.lora.save_peft` writes the adapters
  alone instead). A scanned model is written in the loop layout (`model.layers.<i>.…`), as any.
  """
  model = unstack_layers(model)
  if lora_merge.is_adapted(model):
    if not merged:
      raise CheckpointError(
          f"{directory}: this model carries LoRA adapters; save_hf(..., merged=True) writes the "
          "weights with the adapters folded in, reasoning_rl.lora.save_peft the adapters alone")
    model = lora_merge.merged_model(model)
  directory = pathlib.Path(directory)
  config = model.config
  if config.model_type == "qwen2" and not config.attention_bias:
    raise CheckpointError(
        f"{directory}: transformers' Qwen2 always has q/k/v biases, so a bias-free qwen2 model "
        "would load with random biases; build bias-free models as model_type 'llama'")
  directory.parent.mkdir(parents=True, exist_ok=True)
  _, state = nnx.split(model)
  tensors = {}
  dtype_name = "float32"
  for path, var in _flat_params(state):
    mapping = hf_tensors(path, config)
    value = np.asarray(jax.device_get(var[...]))
    if value.dtype == jnp.bfloat16:
      # safetensors' numpy writer has no bfloat16; write float32 (exact) and say so in config.
      value = value.astype(np.float32)
    for name, tensor in zip(mapping.names, mapping.to_hf(value)):
      tensors[name] = np.ascontiguousarray(tensor)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
  try:
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    hf_config = config.to_hf_config(torch_dtype=dtype_name)
    if tokenizer is not None:
      for key, value in (("bos_token_id", tokenizer.bos_id), ("pad_token_id", tokenizer.pad_id)):
        if value is not None:
          hf_config[key] = value
      eos = list(tokenizer.eos_ids) or [tokenizer.eos_id]
      hf_config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
    generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if hf_config.get(k) is not None}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
      tokenizer.save(staging)
    if directory.exists():
      shutil.rmtree(directory)
    os.replace(staging, directory)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return directory
