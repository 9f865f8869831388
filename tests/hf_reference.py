"""Tiny random transformers models of every supported family, written with save_pretrained.

Used as the independent reference for parity tests; weights are perturbed away from
transformers' init (norms included) so that a wrong layout cannot hide behind ones and zeros.
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
}


def write_tiny_model(family: str, directory: pathlib.Path, seed: int = 0):
  """Saves a perturbed random model of `family` to `directory`; returns the torch model."""
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
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
