"""One configuration for every supported decoder-only family.

Llama (incl. SmolLM2 and Llama-3 RoPE scaling), Qwen2/2.5, Qwen3, Gemma and Gemma 2 differ only in a
handful of switches, so they share one `ModelConfig`. `from_hf_config` reads a Hugging Face
`config.json` dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`);
`to_hf_config` writes one that transformers loads back into the same architecture.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from reasoning_rl.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma", "gemma2")

_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder-only transformer.

  Attributes:
    model_type: one of SUPPORTED_MODEL_TYPES; decides the defaults of the switches below.
    vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: sizes.
      `num_heads % num_kv_heads == 0` (grouped-query attention when they differ).
    rms_norm_eps: epsilon inside RMSNorm.
    rope_theta: RoPE base frequency.
    rope_scaling: None, or a dict with `rope_type` in {"llama3", "linear"} and its parameters.
    tie_word_embeddings: the output projection is the transposed input embedding.
    attention_bias: q/k/v projections carry a bias (Qwen2).
    qk_norm: RMSNorm over each head of q and k before RoPE (Qwen3).
    activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
    norm_plus_one: RMSNorm scales by (1 + w) instead of w (Gemma).
    scale_embeddings: multiply embeddings by sqrt(hidden_size) (Gemma).
    sandwich_norms: extra RMSNorm after attention and after the MLP (Gemma 2).
    query_pre_attn_scalar: attention scale is this**-0.5 instead of head_dim**-0.5 (Gemma 2).
    attn_logit_softcap / final_logit_softcap: tanh soft-capping of scores / logits (Gemma 2).
    sliding_window: window of "sliding_attention" layers (Gemma 2 alternates local and global).
    layer_types: per layer "full_attention" or "sliding_attention".
    max_position_embeddings: informative; positions are not bounded by it.
    bos_token_id / eos_token_id / pad_token_id: as in config.json, written back on save.
  """

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: dict | None = None
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  qk_norm: bool = False
  activation: str = "silu"
  norm_plus_one: bool = False
  scale_embeddings: bool = False
  sandwich_norms: bool = False
  query_pre_attn_scalar: float | None = None
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  max_position_embeddings: int = 8192
  bos_token_id: int | list[int] | None = None
  eos_token_id: int | list[int] | None = None
  pad_token_id: int | None = None

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise CheckpointError(
          f"model_type {self.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
      )
    if self.num_heads % self.num_kv_heads:
      raise CheckpointError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if self.activation not in ("silu", "gelu_tanh"):
      raise CheckpointError(f"activation {self.activation!r} must be 'silu' or 'gelu_tanh'")
    if self.layer_types is None:
      object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
    else:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if len(self.layer_types) != self.num_layers:
      raise CheckpointError(
          f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
      )
    if "sliding_attention" in self.layer_types and not self.sliding_window:
      raise CheckpointError("layer_types uses 'sliding_attention' but sliding_window is not set")
    if self.rope_scaling is not None:
      kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
      if kind not in ("llama3", "linear", "default"):
        raise CheckpointError(
            f"rope_scaling type {kind!r} is not supported (supported: llama3, linear)"
        )

  @property
  def attention_scale(self) -> float:
    base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
    return 1.0 / math.sqrt(base)

  def num_params(self) -> int:
    """Parameter count (embedding counted once when tied)."""
    d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.attention_bias:
      attn += h * (self.num_heads + 2 * self.num_kv_heads)
    norms = d * (4 if self.sandwich_norms else 2) + (2 * h if self.qk_norm else 0)
    per_layer = attn + 3 * d * f + norms
    embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return self.num_layers * per_layer + embed + d

  # ----------------------------------------------------------------------------- HF interop

  @classmethod
  def from_hf_config(cls, hf: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
    """Builds a ModelConfig from a transformers config dict; `source` names the file in errors."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise CheckpointError(
          f"{source}: model_type {model_type!r} is not supported; supported model types are "
          f"{', '.join(SUPPORTED_MODEL_TYPES)}. Convert the model to one of these or add the "
          "architecture to reasoning_rl/models/config.py."
      )
    try:
      num_heads = int(hf["num_attention_heads"])
      hidden = int(hf["hidden_size"])
      kwargs = dict(
          model_type=model_type,
          vocab_size=int(hf["vocab_size"]),
          hidden_size=hidden,
          intermediate_size=int(hf["intermediate_size"]),
          num_layers=int(hf["num_hidden_layers"]),
          num_heads=num_heads,
          num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
          head_dim=int(hf.get("head_dim") or hidden // num_heads),
      )
    except KeyError as e:
      raise CheckpointError(f"{source}: required field {e.args[0]!r} is missing") from None

    rope = hf.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                         else None)
    if scaling is not None:
      scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
      if scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    gemma = model_type in ("gemma", "gemma2")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
      # Gemma checkpoints say "gelu" but were trained with the tanh approximation (transformers
      # maps it the same way).
      act = "gelu_tanh"
    layer_types = hf.get("layer_types")
    if model_type == "gemma2" and layer_types is None:
      layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(kwargs["num_layers"])]
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
      layer_types = None  # Qwen's sliding window is off unless use_sliding_window says so.
    return cls(
        **kwargs,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
        activation=act,
        norm_plus_one=gemma,
        scale_embeddings=gemma,
        sandwich_norms=model_type == "gemma2",
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if model_type == "gemma2" else None,
        attn_logit_softcap=hf.get("attn_logit_softcapping") if model_type == "gemma2" else None,
        final_logit_softcap=hf.get("final_logit_softcapping") if model_type == "gemma2" else None,
        sliding_window=hf.get("sliding_window") if layer_types else None,
        layer_types=tuple(layer_types) if layer_types else None,
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )

  def to_hf_config(self, *, torch_dtype: str = "float32") -> dict[str, Any]:
    """A config.json dict that transformers loads into the same architecture."""
    rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling:
      rope_parameters.update(self.rope_scaling)
      rope_parameters.setdefault("rope_type", rope_parameters.pop("type", "default"))
    hf = {
        "architectures": [_HF_ARCHITECTURES[self.model_type]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "hidden_act": "gelu_pytorch_tanh" if self.activation == "gelu_tanh" else "silu",
        "bos_token_id": self.bos_token_id,
        "eos_token_id": self.eos_token_id,
        "pad_token_id": self.pad_token_id,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }
    hf["attention_bias"] = self.attention_bias  # read back by from_hf_config for every type
    if self.model_type == "gemma2":
      hf.update(
          hidden_activation=hf["hidden_act"],
          query_pre_attn_scalar=self.query_pre_attn_scalar,
          attn_logit_softcapping=self.attn_logit_softcap,
          final_logit_softcapping=self.final_logit_softcap,
          sliding_window=self.sliding_window,
          layer_types=list(self.layer_types),
      )
    elif self.sliding_window:
      hf.update(use_sliding_window=True, sliding_window=self.sliding_window,
                layer_types=list(self.layer_types))
    return hf
