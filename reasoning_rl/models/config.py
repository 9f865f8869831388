"""One configuration for every supported decoder-only family.

Llama (incl. SmolLM2 and Llama-3 RoPE scaling), Qwen2/2.5, Qwen3, Gemma, Gemma 2 and Gemma 3 differ
only in a handful of switches, so they share one `ModelConfig`. The mixture-of-experts families
(Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V3) are the same decoder with some or all MLPs
replaced by routed experts, described by `MoEConfig` (`ModelConfig.moe`; None for a dense model);
DeepSeek-V3 also replaces attention by multi-head latent attention, described by `MLAConfig`
(`ModelConfig.mla`, `reasoning_rl.models.mla`). `from_hf_config` reads a Hugging Face
`config.json` dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`);
`to_hf_config` writes one that transformers loads back into the same architecture.

Gemma 3 is the text decoder of Gemma Team, "Gemma 3 Technical Report" (2025), section 2: Gemma 2's
sandwich norms and GeGLU, QK-norm in place of Gemma 2's attention soft-cap, five local
(sliding-window) layers per global layer, and RoPE base 10k on local layers against 1M on global
ones (with positional interpolation on the global layers of the long-context sizes). Its family
name here is "gemma3"; transformers calls the text-only model "gemma3_text" (read and written as
such), and "gemma3" there is the vision-language wrapper, which is refused.

GPT-OSS (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025) is a mixture of experts whose every
layer is sparse, with a few switches of its own: a learned attention sink per head
(`attention_sinks`), biases on all four attention projections (`attention_bias`,
`attention_output_bias`), sliding-window layers alternating with full ones, YaRN RoPE (Peng et
al. 2023), and experts with biases and a clamped SwiGLU behind a biased router (`MoEConfig`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from reasoning_rl.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "qwen3_moe",
                         "mixtral", "olmoe", "gpt_oss", "deepseek_v3")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")
MLA_MODEL_TYPES = ("deepseek_v3",)

_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

# Our family name -> the `model_type` transformers writes in config.json (where they differ).
_HF_MODEL_TYPES = {"gemma3": "gemma3_text"}
_FAMILY_OF_HF_MODEL_TYPE = {hf: ours for ours, hf in _HF_MODEL_TYPES.items()}

# GPT-OSS's RoPE when its config.json names none (transformers' GptOssConfig default; the
# published checkpoints spell the same out): YaRN from a 4k pretraining context to 128k.
GPT_OSS_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False, "original_max_position_embeddings": 4096}

# Gemma 3's local : global layer ratio (technical report, section 2.1: "5 local layers for every
# global layer, starting with a local layer as the first layer"); transformers' key for it in
# configs that predate `layer_types` is `sliding_window_pattern`.
GEMMA3_SLIDING_WINDOW_PATTERN = 6


ROUTER_SCORINGS = ("softmax", "sigmoid")

# YaRN (Peng et al. 2023) interpolates relative to the pretraining context, which it must be told.
YARN_REQUIRED_KEYS = ("original_max_position_embeddings",)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Routed experts in place of (some of) a decoder's MLPs (Shazeer et al. 2017, "Outrageously
  Large Neural Networks"; top-k routing as in GShard, Lepikhin et al. 2020, and Mixtral, Jiang et
  al. 2024).

  Each token's router logits z = x·W_r (+ b_r with `router_bias`; computed in float32) give
  scores s = softmax(z), or s = sigmoid(z) (DeepSeek-V3); the token goes to the
  `experts_per_token` experts of highest score, and their outputs are summed with weights s_i —
  renormalised to sum 1 over the chosen experts when `normalize_top_k` (Mixtral always; Qwen3-MoE,
  OLMoE and DeepSeek-V3 by `norm_topk_prob`; GPT-OSS takes the top-k logits and a softmax over
  those, the same weights), then multiplied by `routed_scale`. Every chosen expert processes the
  token (dropless: no capacity, no token dropped), so the layer is a function of the token alone.

  DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §2.1.2) adds three things:
  - a selection bias b (`selection_bias`; the checkpoint's `e_score_correction_bias`, tuned by
    its auxiliary-loss-free balancing, never by gradient descent) added to the scores when
    experts are chosen only: the weights come from the unbiased s_i;
  - group-limited routing: the E experts form `num_groups` groups of consecutive experts, each
    group is ranked by the sum of its two best (biased) scores, and a token chooses its k experts
    among the `groups_per_token` best groups only (DeepSeek-V2's device-limited routing);
  - `num_shared_experts` SwiGLU experts of `intermediate_size` each, fused into one MLP of
    num_shared_experts · intermediate_size, that every token passes through, added to the routed
    output.

  Attributes:
    num_experts: routed experts per sparse layer (E).
    experts_per_token: k, the experts each token is sent to.
    intermediate_size: each expert's MLP width (Qwen3-MoE and DeepSeek-V3
      `moe_intermediate_size`; Mixtral, OLMoE and GPT-OSS use `intermediate_size`).
    sparse_layers: per layer, True where the MLP is the routed experts, False where it is a dense
      MLP of `ModelConfig.intermediate_size` (Qwen3-MoE `decoder_sparse_step` / `mlp_only_layers`,
      DeepSeek-V3 `first_k_dense_replace`).
    normalize_top_k: renormalise the chosen experts' weights to sum 1.
    scoring: how scores come from router logits (ROUTER_SCORINGS).
    router_bias: the router adds a learned bias per expert to its logits (GPT-OSS).
    expert_bias: each expert's gate / up and down projections add a bias (GPT-OSS, whose fused
      expert layout is the only one that holds them).
    swiglu_limit, swiglu_alpha: GPT-OSS's clamped SwiGLU in the experts, both set or neither:
      with g = min(gate, limit) and u = clip(up, −limit, limit), the hidden activation is
      (u + 1) · g · σ(alpha · g) instead of silu(gate) · up.
    num_groups, groups_per_token: group-limited routing (DeepSeek-V3 `n_group`, `topk_group`);
      1 and 1: every expert is eligible.
    selection_bias: the router holds a per-expert bias added to the scores for choosing only.
    num_shared_experts: always-on experts beside the routed ones (DeepSeek-V3 `n_shared_experts`).
    routed_scale: the routed experts' weights are multiplied by it (`routed_scaling_factor`).
  """

  num_experts: int
  experts_per_token: int
  intermediate_size: int
  sparse_layers: tuple[bool, ...]
  normalize_top_k: bool = False
  scoring: str = "softmax"
  router_bias: bool = False
  expert_bias: bool = False
  swiglu_limit: float | None = None
  swiglu_alpha: float | None = None
  num_groups: int = 1
  groups_per_token: int = 1
  selection_bias: bool = False
  num_shared_experts: int = 0
  routed_scale: float = 1.0

  def __post_init__(self):
    object.__setattr__(self, "sparse_layers", tuple(bool(s) for s in self.sparse_layers))
    if not 0 < self.experts_per_token <= self.num_experts:
      raise CheckpointError(
          f"experts_per_token={self.experts_per_token} must be in 1..num_experts="
          f"{self.num_experts}")
    if self.scoring not in ROUTER_SCORINGS:
      raise CheckpointError(f"router scoring {self.scoring!r} is not supported "
                            f"(supported: {ROUTER_SCORINGS})")
    if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
      raise CheckpointError(
          f"swiglu_limit={self.swiglu_limit} and swiglu_alpha={self.swiglu_alpha}: the clamped "
          "SwiGLU needs both (GPT-OSS: 7.0 and 1.702), a plain SwiGLU neither")
    if self.swiglu_limit is not None and not self.swiglu_limit > 0:
      raise CheckpointError(f"swiglu_limit must be positive, got {self.swiglu_limit}")
    if self.num_groups < 1 or self.num_experts % self.num_groups:
      raise CheckpointError(f"n_group={self.num_groups} must divide the {self.num_experts} "
                            "routed experts into groups of equal size")
    if not 1 <= self.groups_per_token <= self.num_groups:
      raise CheckpointError(f"topk_group={self.groups_per_token} must be in 1..n_group="
                            f"{self.num_groups}")
    per_group = self.num_experts // self.num_groups
    if self.num_groups > 1 and per_group < 2:
      raise CheckpointError(f"n_group={self.num_groups}: groups are ranked by their two best "
                            f"experts, so each needs at least 2 (it has {per_group})")
    reachable = self.groups_per_token * per_group
    if self.experts_per_token > reachable:
      raise CheckpointError(
          f"experts_per_token={self.experts_per_token} exceeds the {reachable} experts of the "
          f"topk_group={self.groups_per_token} groups a token may choose from")
    if self.num_shared_experts < 0:
      raise CheckpointError(f"n_shared_experts={self.num_shared_experts} must be >= 0")

  @property
  def num_sparse_layers(self) -> int:
    return sum(self.sparse_layers)

  @property
  def group_limited(self) -> bool:
    """Whether some experts are out of a token's reach (groups_per_token < num_groups)."""
    return self.groups_per_token < self.num_groups


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """Multi-head latent attention (DeepSeek-AI 2024, "DeepSeek-V2", §2.1; `reasoning_rl.models.mla`).

  Keys and values of all heads are rebuilt from one compressed latent c_kv of `kv_lora_rank`
  per token (kv_b_proj: per head a `qk_nope_head_dim` key part and a `v_head_dim` value), plus
  one RoPE key of `qk_rope_head_dim` shared by every head (decoupled RoPE). Queries come through
  a low-rank bottleneck of `q_lora_rank` (None: one plain projection). A query / key head is
  qk_nope_head_dim + qk_rope_head_dim wide. The sampler caches c_kv and the rotated shared key
  only: kv_lora_rank + qk_rope_head_dim numbers per token and layer.

  rope_interleave: the checkpoint's rotary dimensions pair (x0, x1), (x2, x3), … (DeepSeek's
  layout) instead of the first half with the second.
  """

  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  q_lora_rank: int | None = None
  rope_interleave: bool = True

  def __post_init__(self):
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      if getattr(self, name) < 1:
        raise CheckpointError(f"{name}={getattr(self, name)} must be >= 1")
    if self.qk_rope_head_dim % 2:
      raise CheckpointError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE "
                            "rotates pairs of dimensions)")
    if self.q_lora_rank is not None and self.q_lora_rank < 1:
      raise CheckpointError(f"q_lora_rank={self.q_lora_rank} must be >= 1, or null for a plain "
                            "query projection")

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder-only transformer.

  Attributes:
    model_type: one of SUPPORTED_MODEL_TYPES; decides the defaults of the switches below.
    vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: sizes.
      `num_heads % num_kv_heads == 0` (grouped-query attention when they differ). With `mla`,
      head_dim is the RoPE'd width `mla.qk_rope_head_dim` (as transformers' DeepseekV3Config
      sets it: the RoPE tables are built for it) and num_kv_heads is unused.
    rms_norm_eps: epsilon inside RMSNorm.
    rope_theta: RoPE base frequency (of the global layers when `rope_local_theta` is set).
    rope_scaling: None, or a dict with `rope_type` in {"llama3", "linear", "yarn"} and its
      parameters (applied to the global layers only when `rope_local_theta` is set, as Gemma 3
      does; `YARN_REQUIRED_KEYS` for yarn).
    rope_local_theta: RoPE base of the "sliding_attention" layers, unscaled (Gemma 3: 10k local
      against 1M global, technical report section 2.1); None: every layer uses `rope_theta`.
    tie_word_embeddings: the output projection is the transposed input embedding.
    attention_bias: q/k/v projections carry a bias (Qwen2).
    attention_output_bias: the output projection carries a bias too (transformers' Llama, Qwen3,
      Gemma, OLMoE and GPT-OSS put one there whenever their `attention_bias` is set; Qwen2 never).
    attention_sinks: each head has a learned sink logit that joins its softmax and takes its
      share of the probability mass, its value then dropped (GPT-OSS; Xiao et al. 2023,
      "Efficient Streaming Language Models with Attention Sinks", learned here instead of a
      sink token).
    qk_norm: RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3; with Gemma's
      (1 + w) convention when `norm_plus_one`).
    qk_norm_per_head: False: the norm spans the whole q (all heads) and k projection instead of
      each head (OLMoE).
    clip_qkv: clamp q, k and v to [-clip_qkv, clip_qkv] after projection (and QK-norm), as
      OLMoE's config may ask; None: no clamp.
    moe: routed experts (`MoEConfig`), or None for a dense model.
    mla: multi-head latent attention (`MLAConfig`, DeepSeek-V3) in place of grouped-query
      attention, or None.
    activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
    norm_plus_one: RMSNorm scales by (1 + w) instead of w (Gemma).
    scale_embeddings: multiply embeddings by sqrt(hidden_size) (Gemma).
    sandwich_norms: extra RMSNorm after attention and after the MLP (Gemma 2, Gemma 3).
    query_pre_attn_scalar: attention scale is this**-0.5 instead of head_dim**-0.5 (Gemma 2, 3).
    attn_logit_softcap / final_logit_softcap: tanh soft-capping of scores / logits (Gemma 2; Gemma 3
      drops both, technical report section 2.1, unless its config.json sets them).
    sliding_window: window of "sliding_attention" layers (Gemma 2 alternates local and global,
      Gemma 3 has five local layers per global one).
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
  rope_local_theta: float | None = None
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  attention_output_bias: bool = False
  attention_sinks: bool = False
  qk_norm: bool = False
  qk_norm_per_head: bool = True
  clip_qkv: float | None = None
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
  moe: MoEConfig | None = None
  mla: MLAConfig | None = None

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
      if kind not in ("llama3", "linear", "yarn", "default"):
        raise CheckpointError(
            f"rope_scaling type {kind!r} is not supported (supported: llama3, linear, yarn)"
        )
      missing = [key for key in YARN_REQUIRED_KEYS if key not in self.rope_scaling]
      if kind == "yarn" and missing:
        raise CheckpointError(f"rope_scaling of type 'yarn' lacks {', '.join(missing)} (the "
                              "context length the model was pretrained at)")
    if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
      raise CheckpointError(f"moe.sparse_layers has {len(self.moe.sparse_layers)} entries for "
                            f"{self.num_layers} layers")
    if self.moe is not None and self.moe.expert_bias and self.model_type != "gpt_oss":
      raise CheckpointError(f"moe.expert_bias with model_type {self.model_type!r}: expert biases "
                            "exist in GPT-OSS's fused expert layout only (model_type 'gpt_oss')")
    if (self.model_type in MOE_MODEL_TYPES) != (self.moe is not None):
      raise CheckpointError(f"model_type {self.model_type!r} with moe={self.moe!r}: the MoE "
                            f"families {MOE_MODEL_TYPES} need a MoEConfig, the others none")
    if self.rope_local_theta is not None and not self.rope_local_theta > 0:
      raise CheckpointError(f"rope_local_theta must be a positive RoPE base, got "
                            f"{self.rope_local_theta!r}")
    if self.mla is not None or self.model_type in MLA_MODEL_TYPES:
      self._check_mla()

  def _check_mla(self):
    """What latent attention (`reasoning_rl.models.mla`) computes, and what it does not."""
    if (self.model_type in MLA_MODEL_TYPES) != (self.mla is not None):
      raise CheckpointError(f"model_type {self.model_type!r} with mla={self.mla!r}: the "
                            f"latent-attention families {MLA_MODEL_TYPES} need an MLAConfig, "
                            "the others none")
    if self.head_dim != self.mla.qk_rope_head_dim:
      raise CheckpointError(f"head_dim={self.head_dim}: with latent attention it is the RoPE "
                            f"width, qk_rope_head_dim={self.mla.qk_rope_head_dim}")
    unsupported = {"attention_bias": self.attention_bias, "qk_norm": self.qk_norm,
                   "clip_qkv": self.clip_qkv, "attn_logit_softcap": self.attn_logit_softcap,
                   "sliding_window layers": "sliding_attention" in self.layer_types}
    for name, value in unsupported.items():
      if value:
        raise CheckpointError(f"{name}={value!r} is not supported with latent attention "
                              f"(model_type {self.model_type!r})")

  def __hash__(self):
    # The config travels in a model's graphdef, a static (hashed) argument of jitted functions
    # such as the sampler engine's; rope_scaling (a dict) and a list of eos ids, kept as
    # config.json has them, are hashed by their contents.
    return hash(tuple(_hashable(getattr(self, field.name)) for field in dataclasses.fields(self)))

  def layer_rope(self, layer_type: str) -> tuple[float, dict | None]:
    """(RoPE base, RoPE scaling) of the layers of `layer_type` ("full_attention" or
    "sliding_attention"): Gemma 3's local layers keep the short-context base unscaled, its global
    layers take `rope_theta` and `rope_scaling` (technical report, section 2.1 and 3); every other
    family uses one base and one scaling throughout."""
    if layer_type == "sliding_attention" and self.rope_local_theta is not None:
      return self.rope_local_theta, None
    return self.rope_theta, self.rope_scaling

  @property
  def attention_scale(self) -> float:
    base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
    return 1.0 / math.sqrt(base)

  def kv_cache_layout(self) -> tuple[tuple[int, int], tuple[int, int]]:
    """((heads, width) of the cached k, (heads, width) of the cached v), per token and layer.

    Grouped-query attention caches K and V of num_kv_heads × head_dim each. Latent attention
    caches its compressed c_kv in the k buffer (1 × kv_lora_rank) and the rotated shared RoPE
    key in the v buffer (1 × qk_rope_head_dim), not the per-head keys and values rebuilt from
    them (`reasoning_rl.models.mla`)."""
    if self.mla is not None:
      return (1, self.mla.kv_lora_rank), (1, self.mla.qk_rope_head_dim)
    return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

  @property
  def kv_cache_width(self) -> int:
    """Numbers the sampler's cache holds per token and layer (k and v together)."""
    return sum(heads * width for heads, width in self.kv_cache_layout())

  def layer_is_sparse(self, layer: int) -> bool:
    """Whether layer `layer`'s MLP is routed experts."""
    return self.moe is not None and self.moe.sparse_layers[layer]

  def num_params(self, *, active: bool = False) -> int:
    """Parameter count (embedding counted once when tied). `active`: of a MoE model, only the
    parameters one token uses (its k routed experts of each sparse layer, plus the router), the
    figure its FLOPs per token follow."""
    d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.attention_bias:
      attn += h * (self.num_heads + 2 * self.num_kv_heads)
    attn += d * self.attention_output_bias + self.num_heads * self.attention_sinks
    if self.mla is not None:
      attn = self._mla_params()
    if not self.qk_norm:
      qk_norms = 0
    elif self.qk_norm_per_head:
      qk_norms = 2 * h
    else:
      qk_norms = h * (self.num_heads + self.num_kv_heads)
    norms = d * (4 if self.sandwich_norms else 2) + qk_norms
    total = 0
    for layer in range(self.num_layers):
      mlp = 3 * d * f
      if self.layer_is_sparse(layer):
        moe = self.moe
        experts = moe.experts_per_token if active else moe.num_experts
        f_e = moe.intermediate_size
        per_expert = 3 * d * f_e + moe.expert_bias * (2 * f_e + d)
        mlp = ((experts + moe.num_shared_experts) * per_expert
               + (d + moe.router_bias) * moe.num_experts)
      total += attn + mlp + norms
    embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return total + embed + d

  def _mla_params(self) -> int:
    """One latent-attention layer's parameters: the query path (low-rank with its norm, or
    plain), kv_a (latent + shared RoPE key) with the latent's norm, kv_b, o."""
    m, d, heads = self.mla, self.hidden_size, self.num_heads
    if m.q_lora_rank is None:
      query = d * heads * m.qk_head_dim
    else:
      query = d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim
    latent = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    expand = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return query + latent + expand + heads * m.v_head_dim * d

  # ----------------------------------------------------------------------------- HF interop

  @classmethod
  def from_hf_config(cls, hf: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
    """Builds a ModelConfig from a transformers config dict; `source` names the file in errors."""
    model_type = hf.get("model_type")
    if model_type == "gemma3" and "text_config" in hf:
      raise CheckpointError(
          f"{source}: model_type 'gemma3' is Gemma 3's vision-language model (Gemma3ForConditional"
          "Generation); only its text decoder is supported: load a text-only checkpoint "
          "(model_type 'gemma3_text', e.g. google/gemma-3-1b-it or gemma-3-270m)")
    model_type = _FAMILY_OF_HF_MODEL_TYPE.get(model_type, model_type)
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
    mla = _mla_from_hf(hf, model_type, source)
    if mla is not None:
      # DeepSeek's own config.json has no head_dim; transformers sets it to the RoPE width.
      kwargs["head_dim"] = mla.qk_rope_head_dim

    rope = hf.get("rope_parameters") or {}
    rope_local_theta = None
    if model_type == "gemma3":
      rope, rope_local_theta = _gemma3_rope(hf, source)
    gpt_oss = model_type == "gpt_oss"
    if gpt_oss and not rope and not hf.get("rope_scaling"):
      rope = dict(GPT_OSS_DEFAULT_ROPE)  # what transformers assumes when config.json names none
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 150000.0 if gpt_oss else 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                         else None)
    if scaling is not None:
      scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
      if scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn":
      # transformers' reading of a YaRN config that leaves out the pretraining context: the
      # top-level key if there is one, else max_position_embeddings
      if hf.get("original_max_position_embeddings") is not None:
        scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
      scaling.setdefault("original_max_position_embeddings",
                         hf.get("max_position_embeddings", 8192))
    gemma = model_type in ("gemma", "gemma2", "gemma3")
    softcapped = model_type in ("gemma2", "gemma3")  # Gemma 3 configs say None; read if not
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
      # Gemma checkpoints say "gelu" but were trained with the tanh approximation (transformers
      # maps it the same way).
      act = "gelu_tanh"
    layer_types = hf.get("layer_types")
    if model_type == "gemma2" and layer_types is None:
      layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(kwargs["num_layers"])]
    if model_type == "gemma3":
      if hf.get("use_bidirectional_attention"):
        raise CheckpointError(
            f"{source}: use_bidirectional_attention=true (an encoder variant of Gemma 3) is not "
            "supported; this decoder attends causally")
      if layer_types is None:
        pattern = hf.get("sliding_window_pattern")
        pattern = GEMMA3_SLIDING_WINDOW_PATTERN if pattern is None else pattern
        if not isinstance(pattern, int) or pattern < 1:
          raise CheckpointError(f"{source}: sliding_window_pattern must be ≥ 1, got {pattern}")
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                       for i in range(kwargs["num_layers"])]
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
      layer_types = None  # Qwen's sliding window is off unless use_sliding_window says so.
    if model_type == "mixtral" and hf.get("sliding_window"):
      layer_types = ["sliding_attention"] * kwargs["num_layers"]  # Mixtral's window is global
    if gpt_oss and layer_types is None:  # local and global layers alternate, local first
      layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(kwargs["num_layers"])]
    attention_bias = bool(hf.get("attention_bias", model_type == "qwen2" or gpt_oss))
    return cls(
        **kwargs,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        rope_local_theta=rope_local_theta,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        attention_bias=attention_bias,
        attention_output_bias=attention_bias and model_type not in ("qwen2", "mixtral"),
        attention_sinks=gpt_oss,
        qk_norm=model_type in ("qwen3", "gemma3", "qwen3_moe", "olmoe"),
        qk_norm_per_head=model_type != "olmoe",
        clip_qkv=float(hf["clip_qkv"]) if hf.get("clip_qkv") is not None else None,
        moe=_moe_from_hf(hf, model_type, kwargs["num_layers"], source),
        mla=mla,
        activation=act,
        norm_plus_one=gemma,
        scale_embeddings=gemma,
        sandwich_norms=softcapped,
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if softcapped else None,
        attn_logit_softcap=hf.get("attn_logit_softcapping") if softcapped else None,
        final_logit_softcap=hf.get("final_logit_softcapping") if softcapped else None,
        sliding_window=(hf.get("sliding_window", 128 if gpt_oss else None) if layer_types
                        else None),
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
        "model_type": _HF_MODEL_TYPES.get(self.model_type, self.model_type),
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
    if self.moe is not None:
      hf.update(_moe_to_hf(self))
    if self.mla is not None:
      hf.update(_mla_to_hf(self.mla))
    if self.clip_qkv is not None:
      hf["clip_qkv"] = self.clip_qkv
    if self.model_type == "gemma3":
      # Per-layer-type RoPE as transformers 5.x writes it; 4.x reads the flat keys beside it.
      hf.update(
          rope_parameters={
              "full_attention": rope_parameters,
              "sliding_attention": {"rope_type": "default",
                                    "rope_theta": self.layer_rope("sliding_attention")[0]},
          },
          rope_local_base_freq=self.layer_rope("sliding_attention")[0],
      )
    if self.model_type in ("gemma2", "gemma3"):
      hf.update(
          hidden_activation=hf["hidden_act"],
          query_pre_attn_scalar=_whole_as_int(self.query_pre_attn_scalar),
          attn_logit_softcapping=self.attn_logit_softcap,
          final_logit_softcapping=self.final_logit_softcap,
          sliding_window=self.sliding_window,
          layer_types=list(self.layer_types),
      )
    elif self.sliding_window:
      hf.update(use_sliding_window=True, sliding_window=self.sliding_window,
                layer_types=list(self.layer_types))
    return hf


def _moe_from_hf(hf: dict[str, Any], model_type: str, num_layers: int,
                 source: str) -> MoEConfig | None:
  """The routed experts of a MoE family's config.json (None for a dense family).

  Qwen3-MoE: `num_experts`, `moe_intermediate_size`, `norm_topk_prob`; layer i is sparse unless
  listed in `mlp_only_layers`, and only every `decoder_sparse_step`-th layer ((i + 1) % step == 0).
  Mixtral: `num_local_experts` experts of `intermediate_size` on every layer, always renormalised.
  OLMoE: `num_experts` of `intermediate_size` on every layer, `norm_topk_prob`.
  GPT-OSS: `num_local_experts` of `intermediate_size` on every layer, softmax over the top-k
  logits (renormalised), biased router and experts, `swiglu_limit` / `swiglu_alpha` (defaults
  7.0 and 1.702 as transformers', whose published configs omit the alpha).
  DeepSeek-V3: `n_routed_experts` of `moe_intermediate_size` from layer `first_k_dense_replace`
  on, sigmoid scores with the `e_score_correction_bias`, `n_group` / `topk_group`,
  `n_shared_experts`, `routed_scaling_factor`, `norm_topk_prob` (as transformers'
  DeepseekV3TopkRouter computes them whatever `scoring_func` / `topk_method` say).
  """
  if model_type not in MOE_MODEL_TYPES:
    return None
  try:
    if model_type == "deepseek_v3":
      dense = int(hf["first_k_dense_replace"])
      return MoEConfig(
          num_experts=int(hf["n_routed_experts"]),
          experts_per_token=int(hf["num_experts_per_tok"]),
          intermediate_size=int(hf["moe_intermediate_size"]),
          sparse_layers=tuple(i >= dense for i in range(num_layers)),
          normalize_top_k=bool(hf["norm_topk_prob"]), scoring="sigmoid",
          num_groups=int(hf["n_group"]), groups_per_token=int(hf["topk_group"]),
          selection_bias=True, num_shared_experts=int(hf["n_shared_experts"] or 0),
          routed_scale=float(hf["routed_scaling_factor"]))
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts, 4.x and OLMoE as
    # num_experts (one is an alias of the other in its config classes).
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
      raise KeyError("num_experts")
    experts = int(experts)
    if model_type == "gpt_oss":
      k = hf.get("num_experts_per_tok", hf.get("experts_per_token"))
      if k is None:
        raise KeyError("num_experts_per_tok")
      return MoEConfig(num_experts=experts, experts_per_token=int(k),
                       intermediate_size=int(hf["intermediate_size"]),
                       sparse_layers=(True,) * num_layers, normalize_top_k=True,
                       router_bias=True, expert_bias=True,
                       swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                       swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
    if model_type == "mixtral":
      return MoEConfig(num_experts=experts,
                       experts_per_token=int(hf["num_experts_per_tok"]),
                       intermediate_size=int(hf["intermediate_size"]),
                       sparse_layers=(True,) * num_layers, normalize_top_k=True)
    if model_type == "olmoe":
      width, sparse = int(hf["intermediate_size"]), (True,) * num_layers
    else:
      width = int(hf["moe_intermediate_size"])
      step = int(hf.get("decoder_sparse_step") or 1)
      dense = set(hf.get("mlp_only_layers") or ())
      sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                     for i in range(num_layers))
    return MoEConfig(num_experts=experts, experts_per_token=int(hf["num_experts_per_tok"]),
                     intermediate_size=width, sparse_layers=sparse,
                     normalize_top_k=bool(hf.get("norm_topk_prob", False)))
  except KeyError as e:
    raise CheckpointError(f"{source}: required field {e.args[0]!r} is missing for "
                          f"model_type {model_type!r}") from None


def _moe_to_hf(config: "ModelConfig") -> dict[str, Any]:
  """The config.json keys of `config.moe` in its family's spelling (inverse of `_moe_from_hf`)."""
  moe = config.moe
  keys = {"num_experts_per_tok": moe.experts_per_token, "output_router_logits": False}
  if config.model_type == "deepseek_v3":
    return {**keys, **_deepseek_moe_to_hf(moe)}
  if config.model_type == "mixtral":
    return {**keys, "num_local_experts": moe.num_experts}
  if config.model_type == "gpt_oss":
    return {**keys, "num_local_experts": moe.num_experts, "swiglu_limit": moe.swiglu_limit,
            "swiglu_alpha": moe.swiglu_alpha}
  keys.update(num_experts=moe.num_experts, norm_topk_prob=moe.normalize_top_k)
  if config.model_type == "olmoe":
    return keys
  # Qwen3-MoE: every sparse layer listed by its complement (decoder_sparse_step 1).
  return {**keys, "moe_intermediate_size": moe.intermediate_size, "decoder_sparse_step": 1,
          "mlp_only_layers": [i for i, sparse in enumerate(moe.sparse_layers) if not sparse]}


def _deepseek_moe_to_hf(moe: MoEConfig) -> dict[str, Any]:
  """DeepSeek-V3's routing keys; its layout (dense layers first, then sparse ones) and router
  (sigmoid with the selection bias) are the only ones its config.json can state."""
  dense = moe.sparse_layers.index(True) if any(moe.sparse_layers) else len(moe.sparse_layers)
  if (moe.sparse_layers[dense:] != (True,) * (len(moe.sparse_layers) - dense)
      or moe.scoring != "sigmoid" or not moe.selection_bias):
    raise CheckpointError(
        f"this DeepSeek-V3 MoE (sparse layers {moe.sparse_layers}, scoring {moe.scoring!r}, "
        f"selection bias {moe.selection_bias}) cannot be written as config.json: DeepSeek-V3 "
        "has its dense layers first and sigmoid routing with e_score_correction_bias")
  return {"n_routed_experts": moe.num_experts, "moe_intermediate_size": moe.intermediate_size,
          "first_k_dense_replace": dense, "norm_topk_prob": moe.normalize_top_k,
          "n_group": moe.num_groups, "topk_group": moe.groups_per_token,
          "n_shared_experts": moe.num_shared_experts,
          "routed_scaling_factor": moe.routed_scale, "scoring_func": "sigmoid",
          "topk_method": "noaux_tc"}


def _mla_from_hf(hf: dict[str, Any], model_type: str, source: str) -> MLAConfig | None:
  """The latent attention of a DeepSeek-V3 config.json (None for the other families)."""
  if model_type not in MLA_MODEL_TYPES:
    return None
  try:
    q_lora_rank = hf["q_lora_rank"]
    return MLAConfig(kv_lora_rank=int(hf["kv_lora_rank"]),
                     qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                     qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                     v_head_dim=int(hf["v_head_dim"]),
                     q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
                     rope_interleave=bool(hf.get("rope_interleave", True)))
  except KeyError as e:
    raise CheckpointError(f"{source}: required field {e.args[0]!r} is missing for "
                          f"model_type {model_type!r}") from None


def _mla_to_hf(mla: MLAConfig) -> dict[str, Any]:
  """The config.json keys of `mla` (inverse of `_mla_from_hf`). No multi-token-prediction
  module is held or written, so num_nextn_predict_layers is 0."""
  return {"kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank,
          "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
          "v_head_dim": mla.v_head_dim, "rope_interleave": mla.rope_interleave,
          "num_nextn_predict_layers": 0}


def _gemma3_rope(hf: dict[str, Any], source: str) -> tuple[dict[str, Any], float]:
  """(the global layers' RoPE parameters, the local layers' base) of a Gemma 3 config.json.

  transformers 5.x writes `rope_parameters` keyed by layer type ({"full_attention": {...},
  "sliding_attention": {...}}); 4.x wrote `rope_theta` / `rope_scaling` for the global layers and
  `rope_local_base_freq` for the local ones. The local layers are never scaled (technical report,
  section 3: positional interpolation is applied to the global layers only)."""
  rope = hf.get("rope_parameters") or {}
  if "full_attention" in rope or "sliding_attention" in rope:
    local = rope.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
      raise CheckpointError(
          f"{source}: rope_parameters.sliding_attention has rope_type {local['rope_type']!r}; "
          "Gemma 3's local layers are expected unscaled ('default')")
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    return dict(rope.get("full_attention") or {}), float(local_theta)
  return rope, float(hf.get("rope_local_base_freq", 10000.0))


def _whole_as_int(value):
  """A whole-valued float as an int: transformers' Gemma 3 config accepts only an int
  query_pre_attn_scalar (its strict dataclass refuses 256.0)."""
  if isinstance(value, float) and value.is_integer():
    return int(value)
  return value


def _hashable(value):
  if isinstance(value, dict):
    return tuple(sorted((key, _hashable(item)) for key, item in value.items()))
  if isinstance(value, list):
    return tuple(_hashable(item) for item in value)
  return value
