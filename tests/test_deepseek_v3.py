"""DeepSeek-V3 beyond the shared parity tests (test_model_parity.py, test_moe_models.py):
latent attention without the query bottleneck and with the non-interleaved RoPE layout against
transformers, the compressed cache (its size, the paged engine, the scanned stack), the router
(sigmoid scores, selection bias, group-limited top-k, shared experts, scaled weights) against a
per-token numpy reference, the training step leaving the selection bias alone, and YaRN's
softmax-scale correction."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from reasoning_rl.errors import ConfigError
from reasoning_rl.models import KVCache
from reasoning_rl.models.checkpoints import load_hf_weights
from reasoning_rl.models.config import MLAConfig, ModelConfig, MoEConfig
from reasoning_rl.models.mla import softmax_scale
from reasoning_rl.models.transformer import abstract_model, stack_layers
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig
from reasoning_rl.sampler import Engine, generate_groups
from reasoning_rl.sampler.paged import PagedEngine
from tests.hf_reference import DEEPSEEK_V3, reference_logits, write_tiny_model
from tests.support.parity import decoded_logits, full_logits, left_padded_batch
from tests.support.sampler import GREEDY, PROMPTS
from tests.support.steps import make_batch


def tiny_config(**moe_fields) -> ModelConfig:
  """Two layers (dense, then 8 routed experts in 2 groups of 4, one group per token, 3 experts
  per token, one shared expert), latent attention with a query bottleneck."""
  moe = MoEConfig(**{"num_experts": 8, "experts_per_token": 3, "intermediate_size": 16,
                     "sparse_layers": (False, True), "normalize_top_k": True,
                     "scoring": "sigmoid", "num_groups": 2, "groups_per_token": 1,
                     "selection_bias": True, "num_shared_experts": 1, "routed_scale": 2.5,
                     **moe_fields})
  mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                  q_lora_rank=12)
  return ModelConfig(model_type="deepseek_v3", vocab_size=97, hidden_size=32,
                     intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=4,
                     head_dim=4, moe=moe, mla=mla)


def perturbed_model(config: ModelConfig, seed: int = 0):
  """A random model: norm scales 1 + N(0, 0.1²), every other variable (selection biases too)
  N(0, 0.1²). Filled from numpy (creating it with JAX's eager ops compiles a program per shape,
  seconds on a shared machine)."""
  graphdef, state = abstract_model(config)
  rng = np.random.RandomState(seed)

  def fill(path, leaf):
    base = 1.0 if getattr(path[-1], "key", None) == "scale" else 0.0
    return jnp.asarray(base + 0.1 * rng.randn(*leaf.shape), leaf.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def test_plain_query_projection_and_halves_rope_match_transformers(tmp_path):
  """q_lora_rank null (one q_proj) and rope_interleave false, the variant the shared parity
  family does not take: logits ≤ 1e-4 on a left-padded batch, cached decoding = the full
  forward, and the parameter count is transformers'."""
  config = transformers.DeepseekV3Config(**{**DEEPSEEK_V3, "q_lora_rank": None,
                                            "rope_interleave": False})
  torch_model = write_tiny_model("deepseek_v3", tmp_path, seed=1, config=config)
  model, _ = load_hf_weights(tmp_path)
  assert model.config.mla.q_lora_rank is None and not model.config.mla.rope_interleave
  assert model.config.num_params() == sum(p.numel() for p in torch_model.parameters())
  ids, mask = left_padded_batch(model.config.vocab_size, seed=2)
  full = full_logits(model, ids, mask)
  for row, ref in enumerate(reference_logits(torch_model, ids, mask)):
    np.testing.assert_allclose(full[row][mask[row] > 0], ref, atol=1e-4, rtol=0)
  cached = decoded_logits(model, ids, mask, KVCache.init(model.config, batch=3, max_len=12),
                          prompt_len=4)
  np.testing.assert_allclose(cached[mask > 0], full[mask > 0], atol=2e-5, rtol=0)


def test_the_cache_holds_the_latent_and_the_shared_rope_key_per_token():
  """kv_lora_rank + qk_rope_head_dim numbers per token and layer: in KVCache, in the engine's
  decode state (its bytes, every layer) and in the planner's count."""
  from ml_collections import ConfigDict

  from reasoning_rl import memory_plan
  from reasoning_rl.sharding import make_mesh

  config = tiny_config()
  assert config.kv_cache_layout() == ((1, 16), (1, 4)) and config.kv_cache_width == 16 + 4
  cache = KVCache.init(config, batch=2, max_len=8)
  assert cache.k[0].shape == (2, 1, 16, 8) and cache.v[0].shape == (2, 1, 8, 4)  # keys length-last
  engine = Engine(perturbed_model(config), max_concurrent_decodes=2, max_prefill_length=8,
                  max_decode_length=8)
  state = engine.init_decode_state()
  held = sum(a.nbytes for a in jax.tree.leaves((state.cache.k, state.cache.v)))
  assert held == config.num_layers * 2 * engine.cache_length * (16 + 4) * 4
  rollout = ConfigDict(dict(max_prefill_length=8, max_new_tokens=8))
  c = ConfigDict(dict(rollout=rollout, eval=ConfigDict(dict(max_new_tokens=8)),
                      model=ConfigDict(dict(dtype="float32", weight_dtype="float32"))))
  mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1]).abstract_mesh
  positions = 2 * engine.cache_length * 4
  assert memory_plan.kv_cache_bytes(c, config, mesh, 2) == held + positions


def test_paged_engine_decodes_latent_attention_as_the_contiguous_one():
  """The compressed cache in pages of 4 (3 prompts through 2 slots: pages freed and taken again,
  prompts ending in partial pages): the same greedy tokens and log-probs; the TPU paged kernel
  is refused by name."""
  model = perturbed_model(tiny_config(), seed=1)
  # the live-length and live-slot variants of a call are the engines' own (test_paged_kv): off,
  # for fewer programs to compile
  sizes = dict(max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=8,
               steps_per_call=4, live_length_attention=False, compact_live_slots=False)
  kwargs = dict(num_samples=1, sampling=GREEDY, max_new_tokens=7, seed=5)
  prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[5]]  # 5, 9, 13 tokens: partial last pages
  reference = generate_groups(Engine(model, **sizes), prompts, **kwargs)
  paged = PagedEngine(model, page_size=4, **sizes)
  assert paged.kernel == "gather"
  ours = generate_groups(paged, prompts, **kwargs)
  assert [c.completion_ids for c in ours] == [c.completion_ids for c in reference]
  # two compiled decode programs, not bit-identical on every CPU (test_paged_kv's
  # assert_same_completions says why 2e-5: ~97 · 6e-8 of log-softmax rounding alone)
  for a, b in zip(ours, reference):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
  with pytest.raises(ConfigError, match="kv_page_kernel='pallas_tpu'"):
    PagedEngine(model, page_size=4, kernel="pallas_tpu", **sizes)


def test_scanned_latent_attention_stack_equals_loop_and_decodes():
  """Every layer sparse (first_k_dense_replace 0), so the stack scans: the same forward, and
  decoding through the stacked [L, B, 1, S, ·] cache equals the full forward. (A model that
  mixes dense and sparse layers keeps the loop layout: test_moe_models.)"""
  config = tiny_config(sparse_layers=(True, True))
  loop = perturbed_model(config, seed=2)
  scanned = stack_layers(loop)
  ids, mask = left_padded_batch(config.vocab_size, seed=3)
  full = full_logits(loop, ids, mask)
  np.testing.assert_allclose(full_logits(scanned, ids, mask), full, atol=1e-5, rtol=0)
  cache = KVCache.init(config, batch=3, max_len=12, stacked=True)
  assert cache.k.shape == (2, 3, 1, 16, 12)
  cached = decoded_logits(scanned, ids, mask, cache, prompt_len=4)
  np.testing.assert_allclose(cached[mask > 0], full[mask > 0], atol=2e-5, rtol=0)


def _numpy_router_layer(layer, x: np.ndarray):
  """DeepSeek-V3's sparse layer token by token in float64: sigmoid scores; the experts chosen by
  the biased scores among the best groups (ranked by their two best biased scores); weights the
  unbiased scores, renormalised, times the scale; plus the shared SwiGLU. Also counts the tokens
  whose choice the bias changed and those whose best experts lay outside their groups."""
  moe = layer.moe
  as64 = lambda v: np.asarray(v[...], np.float64)  # noqa: E731
  router, bias = as64(layer.router), as64(layer.selection_bias)
  experts = [as64(p) for p in (layer.gate_proj, layer.up_proj, layer.down_proj)]
  shared = [as64(p) for p in (layer.shared_experts.gate_proj, layer.shared_experts.up_proj,
                              layer.shared_experts.down_proj)]

  def swiglu(t, gate, up, down):
    g = t @ gate
    return (g / (1 + np.exp(-g)) * (t @ up)) @ down

  def top(values, k):
    return set(np.argsort(-values, kind="stable")[:k])

  out, bias_moved, groups_cut = np.zeros_like(x, dtype=np.float64), 0, 0
  per_group = moe.num_experts // moe.num_groups
  for index in np.ndindex(x.shape[:-1]):
    token = x[index].astype(np.float64)
    scores = 1 / (1 + np.exp(-(token @ router)))
    biased = scores + bias
    rank = np.sort(biased.reshape(moe.num_groups, per_group), axis=1)[:, -2:].sum(1)
    allowed = np.full_like(biased, -np.inf)
    for group in np.argsort(-rank, kind="stable")[:moe.groups_per_token]:
      allowed[group * per_group:(group + 1) * per_group] = biased[group * per_group:
                                                                  (group + 1) * per_group]
    chosen = sorted(top(allowed, moe.experts_per_token))
    bias_moved += top(scores, moe.experts_per_token) != top(biased, moe.experts_per_token)
    groups_cut += top(biased, moe.experts_per_token) != set(chosen)
    weights = scores[chosen] / scores[chosen].sum() * moe.routed_scale
    for expert, w in zip(chosen, weights):
      out[index] += w * swiglu(token, *(e[expert] for e in experts))
    out[index] += swiglu(token, *shared)
  return out, bias_moved, groups_cut


def test_router_matches_a_per_token_reference():
  """The sparse layer against `_numpy_router_layer` on 24 tokens, of which the bias moves some
  choices and the group limit others (so neither can be dropped unseen); replaying the layer's
  own choice is the identity."""
  model = perturbed_model(tiny_config(), seed=3)
  layer = model.layers[1].mlp
  x = np.random.RandomState(4).randn(2, 12, 32).astype(np.float32)
  out, stats = layer(jnp.asarray(x), jnp.ones((2, 12), bool))
  expected, bias_moved, groups_cut = _numpy_router_layer(layer, x)
  np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=0)
  assert bias_moved > 0 and groups_cut > 0
  per_group = 4
  assert np.all(np.asarray(stats.experts) // per_group == np.asarray(stats.experts)[..., :1]
                // per_group)  # one group per token
  replayed, _ = layer(jnp.asarray(x), jnp.ones((2, 12), bool), stats.own_experts, replay=True)
  # exact: replaying a layer's own choice is the identity (what replay promises, see above)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(out))
  # the router's distribution over experts (statistics, auxiliary losses): sigmoid scores
  # normalised to sum 1
  np.testing.assert_allclose(float(jnp.sum(stats.prob_sum)), 24.0, rtol=1e-5)


def test_a_training_step_leaves_the_selection_bias_alone():
  """AdamW with weight decay moves every parameter (the router included) and not the bias:
  it is a Buffer, which the optimizer's mask keeps at a zero update (without it, decay alone
  would shrink the bias by lr · weight_decay per step)."""
  model = perturbed_model(tiny_config(), seed=4)
  graphdef, params = nnx.split(model)
  before = jax.tree.map(np.asarray, params)
  step = TrainStep(graphdef, StepConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10,
                                        weight_decay=0.5), None)
  state = step.init_state(params)
  state, _ = step(state, make_batch(0))
  after = state.params["layers"][1]["mlp"]
  np.testing.assert_array_equal(np.asarray(after["selection_bias"][...]),
                                before["layers"][1]["mlp"]["selection_bias"][...])
  assert np.abs(before["layers"][1]["mlp"]["selection_bias"][...]).max() > 0
  for name in ("router", "gate_proj"):
    assert not np.array_equal(np.asarray(after[name][...]),
                              before["layers"][1]["mlp"][name][...])


def test_yarn_softmax_scale_is_transformers():
  """(qk head)^-1/2 × mscale(factor, mscale_all_dim)² as DeepseekV3Attention computes it: only
  when rope scaling sets mscale_all_dim, and 1 for factor ≤ 1."""
  from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

  for scaling in ({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "original_max_position_embeddings": 4096},
                  {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 0.707},
                  {"rope_type": "yarn", "factor": 0.5, "mscale_all_dim": 1.0},
                  {"rope_type": "yarn", "factor": 8.0}):
    assert softmax_scale(192, scaling) == pytest.approx(yarn_apply_mscale(scaling, 192 ** -0.5),
                                                        rel=1e-12)
  assert softmax_scale(192, None) == 192 ** -0.5
  assert softmax_scale(192, {"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0}) > (
      1.8 * 192 ** -0.5)  # (0.1 ln 40 + 1)² ≈ 1.87: the correction is not a no-op


@pytest.mark.parametrize("fields, message", [
    (dict(num_groups=3), "n_group=3"),
    (dict(groups_per_token=3), "topk_group=3"),
    (dict(experts_per_token=5), "experts_per_token=5"),
])
def test_bad_routing_config_is_one_clear_error(fields, message):
  from reasoning_rl.errors import CheckpointError

  with pytest.raises(CheckpointError, match=message):
    tiny_config(**fields)


def test_mla_config_json_fields_are_required():
  from reasoning_rl.errors import CheckpointError

  hf = transformers.DeepseekV3Config(**DEEPSEEK_V3).to_dict()
  del hf["kv_lora_rank"]
  with pytest.raises(CheckpointError, match="'kv_lora_rank' is missing"):
    ModelConfig.from_hf_config(hf)
  config = ModelConfig.from_hf_config(transformers.DeepseekV3Config(**DEEPSEEK_V3).to_dict())
  with pytest.raises(CheckpointError, match="head_dim=16"):
    dataclasses.replace(config, head_dim=16)


def test_parameter_count_is_the_models():
  """num_params (the planner's and the FLOPs' count) with the query bottleneck, shared experts
  and a dense layer: the model's own parameters (the selection bias is a buffer, not counted)."""
  config = tiny_config()
  model = perturbed_model(config)
  assert config.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  per_token = config.num_params(active=True)
  assert config.num_params() - per_token == 5 * 3 * 32 * 16  # 8 - 3 routed experts idle


def test_lora_adapts_the_mlps_and_refuses_the_latent_attention():
  """The default targets (attention and MLPs) are refused by name; the dense layer's MLP adapts.
  (A sparse layer's experts are grouped matmuls, which qwix's LoRA does not reach, in every MoE
  family.)"""
  from reasoning_rl import lora

  model = perturbed_model(tiny_config(), seed=6)
  with pytest.raises(ConfigError, match="latent attention"):
    lora.apply_lora(model, lora.LoraSettings(rank=2, alpha=4.0))
  adapted = lora.apply_lora(model, lora.LoraSettings(rank=2, alpha=4.0,
                                                     target_modules="layers/0/mlp"))
  adapters = [tuple(str(k) for k in path)
              for path, _ in nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam))]
  assert sorted({path[3] for path in adapters}) == [
      "down_proj_lora_a", "down_proj_lora_b", "gate_proj_lora_a", "gate_proj_lora_b",
      "up_proj_lora_a", "up_proj_lora_b"]
  assert all(path[:3] == ("layers", "0", "mlp") for path in adapters)
