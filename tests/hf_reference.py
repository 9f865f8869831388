"""Tiny random transformers models of every supported family, written with save_pretrained.

Used as the independent reference for parity tests; weights are perturbed away from
transformers' init (norms included) so that a wrong layout cannot hide behind ones and zeros, and
so is DeepSeek-V3's router selection bias (a buffer, zero at init).
"""

import pathlib

import numpy as np
import torch
import transformers

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(
        **SMALL, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8}),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL),
    "gemma": lambda: transformers.GemmaConfig(**SMALL),
    "gemma2": lambda: transformers.Gemma2Config(
        **SMALL, sliding_window=3, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0),
    # Gemma 3 (technical report 2025, section 2.1): local layers with a window of 3 (< the 11-token
    # test rows, so local and global masks differ) around one global layer, distinct RoPE bases on
    # the two kinds, linear RoPE scaling on the global layer only, QK-norm, no soft-caps.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**SMALL, "num_hidden_layers": 3}, sliding_window=3, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        }),
    # Mixtures of experts: 4 experts of which each token takes 2, so routing decides something;
    # Qwen3-MoE with one dense layer (mlp_only_layers) beside a sparse one and renormalised
    # top-k, OLMoE with its whole-projection QK-norm and plain top-k weights.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[0]),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4,
                                                  num_experts_per_tok=2),
    "olmoe": lambda: transformers.OlmoeConfig(
        **{k: v for k, v in SMALL.items() if k != "head_dim"}, num_experts=4,
        num_experts_per_tok=2, eos_token_id=2, pad_token_id=1),
    # GPT-OSS: a local layer (window 3, < the test rows) then a global one, attention sinks,
    # biases on q/k/v/o, the router and the experts, clamped SwiGLU (its limit low enough that
    # the perturbed weights reach it), and the published models' YaRN RoPE (factor 32 over a 4k
    # context, untruncated ramp), whose attention factor scales cos and sin.
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**SMALL, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=3, layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096}),
    # DeepSeek-V3: latent attention with a query bottleneck (q_lora_rank), value heads narrower
    # than query heads, interleaved RoPE; one dense layer, then a sparse one of 8 experts in 2
    # groups of which a token may use 1 (so group ranking decides something), sigmoid scores,
    # the selection bias, one shared expert, renormalised and scaled weights.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**DEEPSEEK_V3),
}

DEEPSEEK_V3 = dict(
    {k: v for k, v in SMALL.items() if k not in ("head_dim", "num_key_value_heads")},
    num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)

MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")


def saved_name_grads(torch_model, family: str) -> dict[str, np.ndarray]:
  """The gradients of `torch_model`'s parameters under the names its checkpoint files use.

  transformers 5 keeps a sparse layer's experts fused in memory (`mlp.experts.gate_up_proj`
  [E, 2F, D], gate rows first; `mlp.experts.down_proj` [E, D, F]) and writes them one tensor per
  expert (`mlp.experts.{e}.gate_proj.weight` …; Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`
  and `block_sparse_moe.gate`): split here the way save_pretrained splits the weights. GPT-OSS
  writes its fused tensors as they are."""
  if family == "gpt_oss":
    return {name: p.grad.numpy().copy() for name, p in torch_model.named_parameters()}
  moe_prefix = "block_sparse_moe" if family == "mixtral" else "mlp"
  names = ({"gate": "w1", "up": "w3", "down": "w2"} if family == "mixtral"
           else {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
  grads = {}
  for name, p in torch_model.named_parameters():
    grad = p.grad.numpy().copy()
    layer, _, rest = name.partition(".mlp.")
    if rest == "experts.gate_up_proj":
      width = grad.shape[1] // 2
      for e in range(grad.shape[0]):
        grads[f"{layer}.{moe_prefix}.experts.{e}.{names['gate']}.weight"] = grad[e, :width]
        grads[f"{layer}.{moe_prefix}.experts.{e}.{names['up']}.weight"] = grad[e, width:]
    elif rest == "experts.down_proj":
      for e in range(grad.shape[0]):
        grads[f"{layer}.{moe_prefix}.experts.{e}.{names['down']}.weight"] = grad[e]
    elif rest == "gate.weight":
      grads[f"{layer}.{moe_prefix}.gate.weight"] = grad
    else:
      grads[name] = grad
  return grads


def write_tiny_model(family: str, directory: pathlib.Path, seed: int = 0, config=None):
  """Saves a perturbed random model of `family` (or of the transformers `config` given) to
  `directory`; returns the torch model."""
  torch.manual_seed(seed)
  config = FAMILIES[family]() if config is None else config
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.add_(torch.randn_like(b) * 0.1)
  model.save_pretrained(directory)
  return model


def reference_logits(torch_model, ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
  """Logits of each row's real tokens, computed on the unpadded sequence alone."""
  out = []
  with torch.no_grad():
    for row, row_mask in zip(ids, mask):
      real = torch.tensor(row[row_mask > 0][None])
      out.append(torch_model(real).logits[0].float().numpy())
  return out
