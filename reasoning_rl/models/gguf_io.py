"""Loading GGUF files (llama.cpp's format): architecture metadata and dequantised weights.

The `gguf` package reads the file and dequantises every quantisation type. llama.cpp's converter
permutes the rows of the q and k projections of Llama-architecture models (its RoPE pairs adjacent
elements, Hugging Face's pairs the two halves); that permutation is undone here so the weights match
the Hugging Face layout the rest of the loader uses. Qwen2 GGUFs are written without the permutation.

Gemma 3 (`gemma3`, Gemma Team 2025) GGUFs differ from its Hugging Face checkpoints in three ways,
all from llama.cpp's converter and loader: every RMSNorm weight is stored as w + 1 (the converter
folds Gemma's (1 + w) into the weight; undone here), the sandwich norms have their own names
(`post_attention_norm`, `ffn_norm` is the pre-feed-forward norm, `post_ffw_norm`), and the file
records neither the local layers' RoPE base nor the attention scale, which llama.cpp fixes: base
10,000 on the local layers, five local layers per global one, and the scale 1/sqrt(head_dim) except
for the 62-layer 27B model, whose scale is 1/sqrt(hidden / heads).
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from reasoning_rl.errors import CheckpointError
from reasoning_rl.models.checkpoints import build_model, hf_tensor_name, require_finite
from reasoning_rl.models.config import ModelConfig

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3")

# HF tensor-name suffix (after "model.layers.{i}.") -> GGUF name suffix (after "blk.{i}.")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Where Gemma 3's sandwich-normed block names its norms differently (see the module docstring).
_SANDWICH_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensor_name(hf_name: str, *, sandwich_norms: bool = False) -> str:
  """The GGUF tensor holding the Hugging Face tensor `hf_name` (Gemma 3's names with
  `sandwich_norms`)."""
  if hf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[hf_name]
  _, _, layer, suffix = hf_name.split(".", 3)
  names = _SANDWICH_LAYER_NAMES if sandwich_norms else _LAYER_NAMES
  return f"blk.{layer}.{names[suffix]}"


# llama.cpp's Gemma 3 constants (src/llama-model.cpp, LLM_ARCH_GEMMA3): the local layers' RoPE base
# and the depth of the one size whose attention scale is not 1/sqrt(head_dim).
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverts llama.cpp's q/k row permutation (adjacent-pair RoPE -> half-split RoPE)."""
  out = weight.shape[0]
  rest = weight.shape[1:]
  return (weight.reshape(num_heads, out // num_heads // 2, 2, *rest).swapaxes(1, 2)
          .reshape(out, *rest))


def _field(reader, key, default=None):
  field = reader.fields.get(key)
  if field is None:
    return default
  return field.contents()


def open_gguf(path: str | os.PathLike):
  import gguf  # only runs that read a GGUF file load the gguf package

  path = pathlib.Path(path)
  if not path.exists():
    raise CheckpointError(f"{path}: no such GGUF file")
  try:
    return gguf.GGUFReader(str(path))
  except Exception as e:  # the reader raises ValueError / struct errors of many kinds
    raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                          "re-download it or convert the model again") from None


def gguf_model_config(reader, path) -> ModelConfig:
  arch = _field(reader, "general.architecture")
  if arch not in SUPPORTED_GGUF_ARCHITECTURES:
    raise CheckpointError(
        f"{path}: GGUF architecture {arch!r} is not supported (supported: "
        f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}); load the model from its Hugging Face "
        "directory instead")

  def need(key):
    value = _field(reader, f"{arch}.{key}")
    if value is None:
      raise CheckpointError(f"{path}: metadata key '{arch}.{key}' is missing")
    return value

  names = {t.name for t in reader.tensors}
  hidden = int(need("embedding_length"))
  heads = int(need("attention.head_count"))
  vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
  head_dim = int(_field(reader, f"{arch}.attention.key_length") or hidden // heads)
  hf = {
      "model_type": arch,
      "vocab_size": int(vocab),
      "hidden_size": hidden,
      "intermediate_size": int(need("feed_forward_length")),
      "num_hidden_layers": int(need("block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
      "head_dim": head_dim,
      "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
      "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
      "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 8192)),
      "tie_word_embeddings": "output.weight" not in names,
      "attention_bias": "blk.0.attn_q.bias" in names,
      "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
      "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
      "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
  }
  scaling_type = _field(reader, f"{arch}.rope.scaling.type")
  if arch == "gemma3":
    hf.update(_gemma3_fields(reader, path, hf))
    scaling_type = None  # read by _gemma3_fields
  if scaling_type not in (None, "none"):
    raise CheckpointError(f"{path}: RoPE scaling {scaling_type!r} in GGUF metadata is not "
                          "supported; load the Hugging Face directory instead")
  return ModelConfig.from_hf_config(hf, source=str(path))


def _gemma3_fields(reader, path, hf: dict) -> dict:
  """The config.json fields of a `gemma3` GGUF beyond the common ones (module docstring)."""
  window = _field(reader, "gemma3.attention.sliding_window")
  if not window:
    raise CheckpointError(f"{path}: metadata key 'gemma3.attention.sliding_window' is missing; "
                          "Gemma 3's local layers need their window")
  if hf["num_hidden_layers"] == _GEMMA3_27B_LAYERS:
    attention_scale_base = hf["hidden_size"] // hf["num_attention_heads"]
  else:
    attention_scale_base = hf["head_dim"]
  fields = {
      "model_type": "gemma3_text",
      "hidden_activation": "gelu_pytorch_tanh",  # GeGLU (technical report, section 2)
      "sliding_window": int(window),
      "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_BASE,
      "query_pre_attn_scalar": attention_scale_base,
      "final_logit_softcapping": _field(reader, "gemma3.final_logit_softcapping"),
  }
  scaling_type = _field(reader, "gemma3.rope.scaling.type")
  if scaling_type == "linear":  # the 4B-27B sizes' global layers (technical report, section 3)
    factor = _field(reader, "gemma3.rope.scaling.factor")
    if not factor:
      raise CheckpointError(f"{path}: 'gemma3.rope.scaling.type' is linear but "
                            "'gemma3.rope.scaling.factor' is missing")
    fields["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
  elif scaling_type not in (None, "none"):
    raise CheckpointError(f"{path}: RoPE scaling {scaling_type!r} in GGUF metadata is not "
                          "supported for gemma3 (supported: linear)")
  return fields


def load_gguf_weights(path: str | os.PathLike, *, dtype="float32", weight_dtype=None, mesh=None,
                      reader=None):
  """(model, reader) from a GGUF file; weights dequantised to `weight_dtype` (default: `dtype`,
  the compute dtype)."""
  from gguf.quants import dequantize  # as open_gguf: only GGUF readers load it

  path = pathlib.Path(path)
  reader = reader or open_gguf(path)
  config = gguf_model_config(reader, path)
  tensors = {t.name: t for t in reader.tensors}
  permuted = config.model_type == "llama"
  norms_stored_plus_one = config.model_type == "gemma3"  # llama.cpp's converter adds 1

  def read(param_path, shape):
    hf_name, to_ours, to_hf = hf_tensor_name(param_path, config)
    name = gguf_tensor_name(hf_name, sandwich_norms=config.sandwich_norms)
    if name not in tensors:
      raise CheckpointError(f"{path}: tensor {name!r} is missing; the file does not match its own "
                            "architecture metadata")
    tensor = tensors[name]
    try:
      weight = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
      raise CheckpointError(f"{path}: tensor {name!r} uses quantisation "
                            f"{tensor.tensor_type.name}, which the gguf package cannot "
                            f"dequantise ({e})") from None
    weight = np.asarray(weight, np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))
    require_finite(weight, tensor=name, source=path)
    if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
      heads = config.num_heads if "attn_q" in name else config.num_kv_heads
      weight = unpermute_rope_rows(weight, heads)
    if norms_stored_plus_one and name.endswith("norm.weight"):
      weight = weight - np.float32(1.0)
    expected = to_hf(np.broadcast_to(np.float32(0), shape)).shape
    if weight.shape != tuple(expected):
      raise CheckpointError(f"{path}: tensor {name!r} has shape {weight.shape}, expected "
                            f"{expected} from the file's metadata")
    return to_ours(weight)

  return build_model(config, read, dtype=dtype, weight_dtype=weight_dtype, mesh=mesh), reader
