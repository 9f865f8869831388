"""GPT-OSS's own pieces: MXFP4 expert checkpoints (against an independent encoder and against
transformers' dequantization), YaRN RoPE against transformers' tables, the sparse layer against a
per-token numpy reference written from transformers' definition, the scanned stack, and the
config's checks.

Logit / gradient / KV-cache parity with transformers is in test_model_parity.py, the save_hf round
trip and greedy decoding in test_moe_models.py (GPT-OSS is in FAMILIES and MOE_FAMILIES there).
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from reasoning_rl.errors import CheckpointError
from reasoning_rl.models import mxfp4
from reasoning_rl.models.checkpoints import load_hf_weights
from reasoning_rl.models.config import ModelConfig, MoEConfig
from reasoning_rl.models.transformer import (create_model, rope_attention_factor,
                                             rope_inverse_frequencies, stack_layers)
from tests.hf_reference import FAMILIES, reference_logits, write_tiny_model

# ------------------------------------------------------------------------------ MXFP4

# The FP4 E2M1 magnitudes in code order (OCP MX specification v1.0, §5.3.3: 1 sign, 2 exponent
# bits with bias 1, 1 mantissa bit; exponent 0 is subnormal).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def encode_e2m1(x: np.ndarray) -> np.ndarray:
  """The E2M1 code nearest each value (ties to the even code, whose mantissa bit is 0),
  saturating at ±6; the sign in bit 3 (none for a zero)."""
  magnitude = np.minimum(np.abs(x), 6.0)
  distance = np.abs(magnitude[..., None] - E2M1) + 1e-9 * (np.arange(8) % 2)
  code = np.argmin(distance, axis=-1)
  return (code | ((x < 0) & (code > 0)) * 8).astype(np.uint8)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """w [E, C, R] → GPT-OSS's (blocks uint8 [E, R, C/32, 16], scales uint8 [E, R, C/32]), by the
  MX specification's conversion (§6.3): per block of 32 along C, shared exponent
  floor(log2(max |v|)) − 2 (E2M1's largest exponent), each element v / 2^shared rounded to E2M1;
  two codes per byte, the even element in the low nibble, the exponent stored with bias 127."""
  experts, fan_in, fan_out = w.shape
  blocks = np.swapaxes(w, 1, 2).reshape(experts, fan_out, fan_in // 32, 32)
  amax = np.abs(blocks).max(-1)
  shared = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2
  shared = np.clip(np.where(amax > 0, shared, -127), -127, 127)
  codes = encode_e2m1(blocks / np.exp2(shared)[..., None])
  return (codes[..., 0::2] | codes[..., 1::2] << 4).astype(np.uint8), (shared + 127).astype(np.uint8)


def test_mxfp4_decodes_as_the_encoder_meant_and_as_transformers_does():
  rng = np.random.default_rng(0)
  # exactly representable: E2M1 values times a power of two per block of 32 along the fan-in
  experts, fan_in, fan_out = 2, 64, 3
  codes = rng.integers(0, 16, (experts, fan_in, fan_out))
  values = np.where(codes >= 8, -1.0, 1.0) * E2M1[codes % 8]
  values[0, :32, 0] = 6.0 * np.sign(values[0, :32, 0] + 0.5)  # a block at full scale
  exponents = rng.integers(-9, 4, (experts, fan_in // 32, fan_out))
  exact = (values * np.exp2(np.repeat(exponents, 32, axis=1))).astype(np.float32)
  blocks, scales = quantize_mxfp4(exact)
  assert blocks.shape == (2, 3, 2, 16) and scales.shape == (2, 3, 2)
  ours = mxfp4.dequantize(blocks, scales)
  assert ours.shape == exact.shape
  np.testing.assert_array_equal(ours.astype(np.float32), exact)
  # any weights: within the format's error, and what transformers' own decoder gives
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors

  weights = rng.normal(size=(3, 96, 5)).astype(np.float32) * np.exp2(rng.integers(-6, 2, (3, 1, 5)))
  blocks, scales = quantize_mxfp4(weights)
  ours = mxfp4.dequantize(blocks, scales).astype(np.float32)
  theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch.float32).numpy()
  np.testing.assert_array_equal(ours, theirs)
  # rounding moves a value by at most one step of E2M1 (2 at the top) times the block's scale
  step = np.repeat(np.exp2(scales.astype(np.float64) - 127).swapaxes(1, 2), 32, axis=1)
  assert np.all(np.abs(ours - weights) <= 2 * step)
  assert 0 < np.abs(ours - weights).max()


def _mxfp4_checkpoint(directory, seed=5):
  """A tiny GPT-OSS checkpoint whose experts are stored as MXFP4, the way the published models
  are (blocks and scales in place of each expert tensor, quantization_config in config.json)."""
  write_tiny_model("gpt_oss", directory, seed=seed)
  tensors = load_file(directory / "model.safetensors")
  for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
    tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensors.pop(name))
  save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
  config = json.loads((directory / "config.json").read_text())
  config["quantization_config"] = {
      "quant_method": "mxfp4", "modules_to_not_convert": [
          "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
          "lm_head"]}
  (directory / "config.json").write_text(json.dumps(config))


def test_an_mxfp4_checkpoint_loads_dequantized_as_transformers_loads_it(tmp_path):
  _mxfp4_checkpoint(tmp_path)
  ours, _ = load_hf_weights(tmp_path)
  # transformers on a CPU without triton dequantizes MXFP4 checkpoints as it loads them
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
  for layer, block in enumerate(ours.layers):
    experts = theirs.model.layers[layer].mlp.experts
    np.testing.assert_array_equal(np.asarray(block.mlp.gate_up_proj[...]),
                                  experts.gate_up_proj.detach().numpy())
    np.testing.assert_array_equal(np.asarray(block.mlp.down_proj[...]),
                                  experts.down_proj.detach().numpy())
  ids = np.random.RandomState(1).randint(0, 97, size=(2, 9))
  mask = np.ones_like(ids)
  mask[0, :3] = 0
  logits = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)))
  for row, ref in enumerate(reference_logits(theirs, ids, mask)):
    np.testing.assert_allclose(logits[row][mask[row] > 0], ref, atol=1e-4, rtol=0)


def test_mismatched_mxfp4_tensors_are_refused_naming_the_tensor(tmp_path):
  _mxfp4_checkpoint(tmp_path)
  tensors = load_file(tmp_path / "model.safetensors")
  name = "model.layers.1.mlp.experts.gate_up_proj_scales"  # [E, 2F, D/32 = 2]
  tensors[name] = tensors[name][:, :, :1]
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(CheckpointError, match="experts.gate_up_proj.*MXFP4 blocks"):
    load_hf_weights(tmp_path)


# ------------------------------------------------------------------------------ YaRN


@pytest.mark.parametrize("parameters", [
    # GPT-OSS's published RoPE: an untruncated ramp
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096, rope_theta=150000.0),
    # the ramp's ends rounded outwards (truncate's default), other betas
    dict(factor=4.0, beta_fast=16.0, beta_slow=2.0, original_max_position_embeddings=512,
         rope_theta=10000.0),
    # DeepSeek-V3's form: attention factor from mscale / mscale_all_dim
    dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707, original_max_position_embeddings=4096,
         rope_theta=10000.0),
    # an attention factor given outright
    dict(factor=8.0, attention_factor=1.25, original_max_position_embeddings=2048,
         rope_theta=500000.0),
])
def test_yarn_frequencies_and_attention_factor_are_transformers(parameters):
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  hf = FAMILIES["gpt_oss"]().to_dict()
  hf["rope_parameters"] = {"rope_type": "yarn", **parameters}
  hf["head_dim"] = 64
  reference = transformers.GptOssConfig(**{k: v for k, v in hf.items()
                                            if k not in ("transformers_version", "model_type")})
  inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](reference)
  config = ModelConfig.from_hf_config(hf)
  np.testing.assert_allclose(np.asarray(rope_inverse_frequencies(config)), inv_freq.numpy(),
                             rtol=1e-6)
  assert rope_attention_factor(config) == pytest.approx(factor, rel=1e-12)
  # extrapolated (fast) pairs are the plain RoPE's, interpolated (slow) ones divided by factor
  plain = 1.0 / parameters["rope_theta"] ** (np.arange(0, 64, 2) / 64)
  ours = np.asarray(rope_inverse_frequencies(config))
  np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
  np.testing.assert_allclose(ours[-1], plain[-1] / parameters["factor"], rtol=1e-6)


def test_yarn_without_its_pretraining_context_is_one_clear_error():
  base = ModelConfig.from_hf_config(FAMILIES["gpt_oss"]().to_dict())
  scaling = {k: v for k, v in base.rope_scaling.items()
             if k != "original_max_position_embeddings"}
  with pytest.raises(CheckpointError, match="yarn.*original_max_position_embeddings"):
    dataclasses.replace(base, rope_scaling=scaling)
  # config.json may leave it out: transformers (and we) then take max_position_embeddings
  hf = FAMILIES["gpt_oss"]().to_dict()
  hf["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
  hf["max_position_embeddings"] = 2048
  assert ModelConfig.from_hf_config(hf).rope_scaling["original_max_position_embeddings"] == 2048


# ------------------------------------------------------------------------------ the sparse layer


def _gpt_oss_config(**moe_fields) -> ModelConfig:
  moe = MoEConfig(**{"num_experts": 4, "experts_per_token": 2, "intermediate_size": 8,
                     "sparse_layers": (True, True), "normalize_top_k": True,
                     "router_bias": True, "expert_bias": True, "swiglu_limit": 0.1,
                     "swiglu_alpha": 1.702, **moe_fields})
  return ModelConfig(model_type="gpt_oss", vocab_size=61, hidden_size=32, intermediate_size=8,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True,
                     attention_output_bias=True, attention_sinks=True, sliding_window=3,
                     layer_types=("sliding_attention", "full_attention"), moe=moe)


def test_gpt_oss_sparse_layer_matches_transformers_definition_token_by_token():
  """In float64 numpy, per token as transformers' GptOssMLP computes it: biased router logits,
  the top k of them, a softmax over those k; each chosen expert's fused projection plus bias, gate
  and up from its even and odd columns, both clamped, (up + 1) · gate · σ(α · gate), the down
  projection plus bias."""
  config = _gpt_oss_config()
  layer = create_model(config, seed=1).layers[0].mlp
  x = np.random.RandomState(2).randn(2, 5, config.hidden_size).astype(np.float32) * 3
  out, _ = layer(jnp.asarray(x), jnp.ones((2, 5), bool))
  router, router_bias, gate_up, gate_up_bias, down, down_bias = (
      np.asarray(p[...], np.float64) for p in (layer.router, layer.router_bias,
                                               layer.gate_up_proj, layer.gate_up_bias,
                                               layer.down_proj, layer.down_bias))
  limit, alpha = config.moe.swiglu_limit, config.moe.swiglu_alpha
  expected = np.zeros(x.shape)
  clamped = {"gate": 0, "up": 0}
  for index in np.ndindex(x.shape[:-1]):
    token = x[index].astype(np.float64)
    logits = token @ router + router_bias
    chosen = np.argsort(-logits, kind="stable")[:2]
    weights = np.exp(logits[chosen] - logits[chosen].max())
    weights /= weights.sum()
    for expert, w in zip(chosen, weights):
      projected = token @ gate_up[expert] + gate_up_bias[expert]
      gate, up = projected[0::2], projected[1::2]
      clamped["gate"] += int(np.sum(gate > limit))
      clamped["up"] += int(np.sum(np.abs(up) > limit))
      gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
      hidden = (up + 1) * gate / (1 + np.exp(-alpha * gate))
      expected[index] += w * (hidden @ down[expert] + down_bias[expert])
  assert clamped["gate"] > 0 and clamped["up"] > 0  # the clamps decided something
  np.testing.assert_allclose(np.asarray(out), expected, atol=1e-6, rtol=1e-5)


def test_gpt_oss_scanned_stack_equals_loop():
  """Local and global layers alternate (a scan step of two blocks), with sinks and YaRN."""
  config = dataclasses.replace(
      _gpt_oss_config(), num_layers=4, layer_types=("sliding_attention", "full_attention") * 2,
      moe=dataclasses.replace(_gpt_oss_config().moe, sparse_layers=(True,) * 4),
      rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16})
  loop = create_model(config, seed=4)
  ids = jnp.asarray(np.random.RandomState(5).randint(0, 61, (2, 9)))
  mask = jnp.asarray([[0, 0] + [1] * 7, [1] * 9])
  hidden = loop.hidden_states(ids, mask)
  np.testing.assert_allclose(np.asarray(stack_layers(loop).hidden_states(ids, mask)),
                             np.asarray(hidden), atol=2e-6, rtol=0)


def test_gpt_oss_config_checks_and_round_trip():
  with pytest.raises(CheckpointError, match="swiglu_limit.*both"):
    MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=8, sparse_layers=(True,),
              swiglu_limit=7.0)
  with pytest.raises(CheckpointError, match="expert_bias.*gpt_oss"):
    dataclasses.replace(_gpt_oss_config(), model_type="mixtral")
  config = ModelConfig.from_hf_config(FAMILIES["gpt_oss"]().to_dict())
  assert (config.attention_sinks, config.attention_output_bias, config.moe.router_bias,
          config.moe.expert_bias, config.moe.swiglu_limit) == (True, True, True, True, 1.0)
  assert ModelConfig.from_hf_config(config.to_hf_config()) == config
  # every parameter counted (sinks, o_proj / router / expert biases included), as torch counts
  torch_model = transformers.AutoModelForCausalLM.from_config(FAMILIES["gpt_oss"]())
  assert config.num_params() == sum(p.numel() for p in torch_model.parameters())
  # the published config.json names neither swiglu_alpha nor layer_types: transformers' defaults
  published = {"model_type": "gpt_oss", "vocab_size": 97, "hidden_size": 64,
               "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
               "experts_per_token": 2, "swiglu_limit": 7.0, "sliding_window": 128,
               "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 4096},
               "rope_theta": 150000}
  config = ModelConfig.from_hf_config(published)
  assert config.moe.swiglu_alpha == 1.702 and config.moe.experts_per_token == 2
  assert config.layer_types == ("sliding_attention", "full_attention") * 2
  assert config.num_params() > config.num_params(active=True)
