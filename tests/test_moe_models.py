"""Mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3): save_hf round trips,
greedy decoding through launch/generate.py against transformers, the sparse layer against a
per-token numpy reference, routing replay, router statistics and the grouped-matmul kernels.

Logit and gradient parity with transformers and the KV-cache path are in test_model_parity.py
(every family of tests/hf_reference.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from reasoning_rl.kernels.grouped_matmul import grouped_matmul
from reasoning_rl.models import moe as moe_lib
from reasoning_rl.models import save_hf
from reasoning_rl.models.checkpoints import load_hf_weights
from reasoning_rl.models.config import ModelConfig, MoEConfig
from reasoning_rl.models.transformer import create_model, stack_layers
from tests.hf_reference import MOE_FAMILIES, reference_logits, write_tiny_model
from tests.support.generation import assert_greedy_matches_transformers, write_word_tokenizer


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_checkpoint(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  torch_model = write_tiny_model(request.param, directory, seed=3)
  write_word_tokenizer(directory)
  return request.param, directory, torch_model


def _batch(vocab, seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(0, vocab, size=(3, 9))
  mask = np.ones_like(ids)
  mask[0, :3] = 0
  ids[mask == 0] = 0
  return jnp.asarray(ids), jnp.asarray(mask)


def test_save_hf_round_trip(moe_checkpoint, tmp_path):
  """save_hf writes each expert as transformers does; transformers reloads the same model."""
  family, directory, _ = moe_checkpoint
  model, _ = load_hf_weights(directory)
  save_hf(model, None, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(reloaded).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM",
                                     "mixtral": "MixtralForCausalLM",
                                     "olmoe": "OlmoeForCausalLM",
                                     "gpt_oss": "GptOssForCausalLM",
                                     "deepseek_v3": "DeepseekV3ForCausalLM"}[family]
  ids, mask = _batch(model.config.vocab_size, seed=4)
  ours = np.asarray(model(ids, mask))
  for row, ref in enumerate(reference_logits(reloaded, np.asarray(ids), np.asarray(mask))):
    np.testing.assert_allclose(ours[row][np.asarray(mask[row]) > 0], ref, atol=1e-4, rtol=0)
  again, _ = load_hf_weights(tmp_path / "out")
  assert again.config == model.config


def test_greedy_generate_matches_transformers(moe_checkpoint, tmp_path):
  _, directory, torch_model = moe_checkpoint
  assert_greedy_matches_transformers(tmp_path, directory, torch_model)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_config_round_trip(family):
  config = ModelConfig.from_hf_config(transformers.AutoConfig.for_model(
      family, **_tiny_kwargs(family)).to_dict())
  assert config.moe is not None and config.moe.num_experts == 4
  assert ModelConfig.from_hf_config(config.to_hf_config()) == config


def _tiny_kwargs(family):
  kwargs = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
  if family in ("mixtral", "gpt_oss"):
    return {**kwargs, "num_local_experts": 4}
  if family == "qwen3_moe":
    return {**kwargs, "num_experts": 4, "moe_intermediate_size": 32, "decoder_sparse_step": 2,
            "mlp_only_layers": [3]}
  if family == "deepseek_v3":
    return {**kwargs, "n_routed_experts": 4, "moe_intermediate_size": 32, "n_group": 2,
            "topk_group": 1, "first_k_dense_replace": 2, "q_lora_rank": None, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
  return {**kwargs, "num_experts": 4}


def test_qwen3_moe_sparse_layers_follow_step_and_dense_list():
  config = ModelConfig.from_hf_config(transformers.AutoConfig.for_model(
      "qwen3_moe", **_tiny_kwargs("qwen3_moe")).to_dict())
  # (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
  assert config.moe.sparse_layers == (False, True, False, False)
  assert config.num_params() > config.num_params(active=True)


def _tiny_moe_config(**moe_fields) -> ModelConfig:
  moe = MoEConfig(**{"num_experts": 4, "experts_per_token": 2, "intermediate_size": 24,
                     "sparse_layers": (True, True), "normalize_top_k": True, **moe_fields})
  return ModelConfig(model_type="mixtral", vocab_size=61, hidden_size=32, intermediate_size=48,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, moe=moe)


def _numpy_sparse_layer(layer: moe_lib.MoE, x: np.ndarray) -> np.ndarray:
  """The sparse layer token by token in float64 numpy: softmax over the router logits, the top k,
  weights (renormalised when the config says), and the sum of the chosen SwiGLU experts."""
  moe = layer.moe
  router = np.asarray(layer.router[...], np.float64)
  gate, up, down = (np.asarray(p[...], np.float64)
                    for p in (layer.gate_proj, layer.up_proj, layer.down_proj))
  out = np.zeros_like(x, dtype=np.float64)
  for index in np.ndindex(x.shape[:-1]):
    token = x[index].astype(np.float64)
    logits = token @ router
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    chosen = np.argsort(-probs, kind="stable")[:moe.experts_per_token]
    weights = probs[chosen] / (probs[chosen].sum() if moe.normalize_top_k else 1.0)
    for expert, w in zip(chosen, weights):
      g = token @ gate[expert]
      hidden = g / (1 + np.exp(-g)) * (token @ up[expert])
      out[index] += w * (hidden @ down[expert])
  return out


@pytest.mark.parametrize("normalize", [True, False])
def test_sparse_layer_matches_per_token_reference(normalize):
  config = _tiny_moe_config(normalize_top_k=normalize)
  model = create_model(config, seed=1)
  layer = model.layers[0].mlp
  x = np.random.RandomState(2).randn(2, 5, config.hidden_size).astype(np.float32)
  out, stats = layer(jnp.asarray(x), jnp.ones((2, 5), bool))
  np.testing.assert_allclose(np.asarray(out), _numpy_sparse_layer(layer, x), atol=2e-6, rtol=0)
  # every token counted once per chosen expert; disagreement 0 without a recorded choice
  assert float(stats.tokens) == 10 and float(stats.load.sum()) == 20
  assert float(stats.disagree_sum) == 0
  np.testing.assert_array_equal(stats.experts, stats.own_experts)


def test_replay_of_own_choice_is_identity_and_other_choice_is_counted():
  config = _tiny_moe_config()
  layer = create_model(config, seed=3).layers[1].mlp
  x = jnp.asarray(np.random.RandomState(4).randn(2, 6, config.hidden_size), jnp.float32)
  real = jnp.asarray([[0, 1, 1, 1, 1, 1], [1] * 6], bool)  # one padding token
  out, stats = layer(x, real)
  replayed, replay_stats = layer(x, real, stats.own_experts, replay=True)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(out))
  assert float(replay_stats.disagree_sum) == 0
  # Another expert set for two real tokens and the padding token: those real tokens change
  # (and only those), and exactly they count as disagreeing; the padding token does not count.
  forced = np.asarray(stats.own_experts).copy()
  for b, t in ((0, 0), (0, 2), (1, 5)):
    forced[b, t] = [e for e in range(4) if e not in forced[b, t]][:2]
  moved, moved_stats = layer(x, real, jnp.asarray(forced), replay=True)
  changed = np.any(np.asarray(moved) != np.asarray(out), axis=-1)
  assert changed.tolist() == [[True, False, True, False, False, False], [False] * 5 + [True]]
  assert float(moved_stats.disagree_sum) == 2 and float(moved_stats.tokens) == 11
  np.testing.assert_array_equal(moved_stats.experts, forced)
  np.testing.assert_array_equal(moved_stats.own_experts, stats.own_experts)
  # the router still gets a gradient under replay (weights come from its own scores)
  grad = jax.grad(lambda r: jnp.sum(nnx.merge(*_with_router(layer, r))(
      x, real, jnp.asarray(forced), replay=True)[0]))(layer.router[...])
  assert float(jnp.abs(grad).max()) > 0


def _with_router(layer, router):
  graphdef, state = nnx.split(layer)
  state["router"] = nnx.Param(router, logical_axes=("embed", None))
  return graphdef, state


def test_router_statistics_and_auxiliary_losses_by_hand():
  """load / prob_sum / entropy / z of two tokens with known logits, and the two losses from them:
  Switch's E·Σ f_i P_i and ST-MoE's mean logsumexp(z)²."""
  config = _tiny_moe_config(experts_per_token=1)
  layer = create_model(config, seed=0).layers[0].mlp
  router = np.zeros((config.hidden_size, 4), np.float32)
  router[0] = [2.0, 0.0, 0.0, 0.0]  # token A (x0 = 1): logits [2, 0, 0, 0]
  router[1] = [0.0, 0.0, 1.0, 0.0]  # token B (x1 = 1): logits [0, 0, 1, 0]
  graphdef, state = _with_router(layer, jnp.asarray(router))
  layer = nnx.merge(graphdef, state)
  x = np.zeros((1, 3, config.hidden_size), np.float32)
  x[0, 0, 0] = 1.0
  x[0, 1, 1] = 1.0
  x[0, 2, 0] = 5.0  # padding: not counted
  _, stats = layer(jnp.asarray(x), jnp.asarray([[True, True, False]]))
  pa = np.exp([2.0, 0, 0, 0]) / np.exp([2.0, 0, 0, 0]).sum()
  pb = np.exp([0, 0, 1.0, 0]) / np.exp([0, 0, 1.0, 0]).sum()
  np.testing.assert_array_equal(stats.load, [1, 0, 1, 0])
  # float32 softmax / logsumexp of 4 logits against float64: a few ulp (XLA's exp and log
  # polynomials round differently with and without FMA), ~1 ulp on this CPU; counting the padding
  # token, or a missing square or halving, moves each of these by 10% or more.
  rtol = 1e-5
  np.testing.assert_allclose(stats.prob_sum, pa + pb, rtol=rtol)
  entropy = -(pa * np.log(pa)).sum() - (pb * np.log(pb)).sum()
  np.testing.assert_allclose(stats.entropy_sum, entropy, rtol=rtol)
  z = np.log(np.exp([2.0, 0, 0, 0]).sum()) ** 2 + np.log(np.exp([0, 0, 1.0, 0]).sum()) ** 2
  np.testing.assert_allclose(stats.z_sum, z, rtol=rtol)
  stacked = jax.tree.map(lambda a: a[None], stats)
  balance = 4 * np.sum(np.array([1, 0, 1, 0]) / 2 * (pa + pb) / 2)
  np.testing.assert_allclose(moe_lib.load_balancing_loss(stacked), balance, rtol=rtol)
  np.testing.assert_allclose(moe_lib.router_z_loss(stacked), z / 2, rtol=rtol)


def test_model_forward_reports_stats_per_sparse_layer_and_replays():
  config = _tiny_moe_config()
  model = create_model(config, seed=5)
  ids, mask = _batch(config.vocab_size, seed=6)
  hidden, stats = model.hidden_states(ids, mask, with_router_stats=True)
  assert stats.experts.shape == (2, 3, 9, 2) and stats.tokens.tolist() == [24.0, 24.0]
  recorded = jnp.moveaxis(stats.experts, 0, 2).astype(jnp.uint8)  # [B, T, L, k], as a batch
  again = model.hidden_states(ids, mask, recorded_experts=recorded, replay_experts=True)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(hidden))


def test_scanned_moe_stack_equals_loop():
  config = _tiny_moe_config()
  loop = create_model(config, seed=7)
  ids, mask = _batch(config.vocab_size, seed=8)
  hidden, stats = loop.hidden_states(ids, mask, with_router_stats=True)
  scanned = stack_layers(loop)
  hidden_s, stats_s = scanned.hidden_states(ids, mask, with_router_stats=True)
  np.testing.assert_allclose(np.asarray(hidden_s), np.asarray(hidden), atol=1e-6, rtol=0)
  np.testing.assert_array_equal(stats_s.experts, stats.experts)
  mixed = dataclasses.replace(config, moe=dataclasses.replace(config.moe,
                                                              sparse_layers=(False, True)))
  with pytest.raises(ValueError, match="mixes dense and sparse layers"):
    create_model(mixed, scan_layers=True)


@pytest.mark.parametrize("implementation", ["megablox", "tiled"])
def test_grouped_matmuls_equal_ragged_dot(implementation):
  """JAX's Pallas TPU grouped matmul (run in interpret mode here) and the tiled one, forward and
  gradient, against XLA's ragged_dot, with an empty group and a row count that is not a multiple
  of the tile."""
  rng = np.random.RandomState(0)
  lhs = jnp.asarray(rng.randn(37, 16), jnp.float32)
  rhs = jnp.asarray(rng.randn(4, 16, 8), jnp.float32)
  sizes = jnp.asarray([10, 0, 20, 7], jnp.int32)

  def loss(lhs, rhs, implementation):
    out = grouped_matmul(lhs, rhs, sizes, implementation=implementation, tiling=(8, 16, 8))
    return jnp.sum(out * jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape)), out

  (_, ref), ref_grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      lhs, rhs, "ragged_dot")
  (_, got), got_grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      lhs, rhs, implementation)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-5)
  for g, r in zip(got_grads, ref_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-4)
  expected = np.concatenate([np.asarray(lhs[:10]) @ np.asarray(rhs[0]),
                             np.asarray(lhs[10:30]) @ np.asarray(rhs[2]),
                             np.asarray(lhs[30:]) @ np.asarray(rhs[3])])
  np.testing.assert_allclose(np.asarray(ref), expected, rtol=1e-5, atol=1e-5)


def test_upcycled_model_computes_the_dense_one_and_saves_as_mixtral(tmp_path):
  """Sparse upcycling: 4 copies of each MLP behind a random router, top-2 renormalised, give the
  dense model's logits (to float rounding) whatever the router chooses; save_hf writes a
  Mixtral checkpoint that transformers loads with our logits."""
  from reasoning_rl.models.upcycle import upcycle

  write_tiny_model("llama", tmp_path / "dense")
  dense, _ = load_hf_weights(tmp_path / "dense")
  moe = upcycle(dense, num_experts=4, experts_per_token=2, seed=1)
  assert moe.config.model_type == "mixtral" and moe.config.moe.num_experts == 4
  ids, mask = _batch(dense.config.vocab_size, seed=9)
  expected = np.asarray(dense(ids, mask))
  got = np.asarray(moe(ids, mask))
  valid = np.asarray(mask) > 0
  np.testing.assert_allclose(got[valid], expected[valid], atol=2e-5, rtol=0)
  # the router is not a constant: tokens go to different expert pairs
  _, stats = moe.hidden_states(ids, mask, with_router_stats=True)
  assert len({tuple(sorted(p)) for p in np.asarray(stats.experts).reshape(-1, 2).tolist()}) > 1
  save_hf(moe, None, tmp_path / "mixtral")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mixtral").eval()
  assert type(reloaded).__name__ == "MixtralForCausalLM"
  for row, ref in enumerate(reference_logits(reloaded, np.asarray(ids), np.asarray(mask))):
    np.testing.assert_allclose(got[row][valid[row]], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("implementation", ["ragged_dot", "tiled", "megablox"])
def test_rows_past_the_groups_leave_the_grouped_rows_exact(implementation):
  """An expert-parallel shard computes only its own experts' rows (sum(group_sizes) < M): the
  grouped rows are those of the full call, whatever the rows after them hold."""
  rng = np.random.RandomState(1)
  lhs = jnp.asarray(rng.randn(37, 16), jnp.float32)
  rhs = jnp.asarray(rng.randn(3, 16, 8), jnp.float32)
  sizes = jnp.asarray([10, 0, 20], jnp.int32)
  out = grouped_matmul(lhs, rhs, sizes, implementation=implementation, tiling=(8, 16, 8))
  expected = np.concatenate([np.asarray(lhs[:10]) @ np.asarray(rhs[0]),
                             np.asarray(lhs[10:30]) @ np.asarray(rhs[2])])
  np.testing.assert_allclose(np.asarray(out[:30]), expected, rtol=1e-5, atol=1e-5)


def test_lora_on_a_mixture_of_experts_adapts_attention_and_exports_merged(tmp_path):
  """LoRA on a MoE model adapts the attention projections only (routers and experts stay
  frozen: an adapter on a router would re-route tokens); with non-zero adapters the merged
  export is a Qwen3-MoE checkpoint transformers loads with our logits."""
  from reasoning_rl import lora

  write_tiny_model("qwen3_moe", tmp_path / "base")
  model, _ = load_hf_weights(tmp_path / "base")
  settings = lora.LoraSettings(rank=4, alpha=8.0, target_modules=r"layers/\d+/(attn|mlp)",
                               base_quantization="", quantization_tile=64,
                               sampler_weights="adapters")
  adapted = lora.apply_lora(model, settings, seed=1)
  adapters = nnx.state(adapted, nnx.LoRAParam)
  adapted_modules = {(path[1], path[2]) for path, _ in nnx.to_flat_state(adapters)}
  # this Qwen3-MoE's layer 0 is dense (mlp_only_layers): its MLP is adapted, layer 1's experts not
  assert adapted_modules == {(0, "attn"), (0, "mlp"), (1, "attn")}
  for path, variable in nnx.to_flat_state(adapters):  # B starts at zero: make the delta real
    if path[-1].endswith("_lora_b"):
      variable.set_value(jnp.full(variable.shape, 0.05, variable.dtype))
  nnx.update(adapted, adapters)
  ids, mask = _batch(model.config.vocab_size, seed=10)
  ours = np.asarray(adapted(ids, mask))
  assert np.abs(ours - np.asarray(model(ids, mask))).max() > 1e-3
  save_hf(adapted, None, tmp_path / "merged", merged=True)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  for row, ref in enumerate(reference_logits(reloaded, np.asarray(ids), np.asarray(mask))):
    np.testing.assert_allclose(ours[row][np.asarray(mask[row]) > 0], ref, atol=1e-4, rtol=0)


def test_upcycling_with_calibration_centres_each_router_on_its_inputs(tmp_path):
  """With calibration rows, each layer's router is orthogonal to the mean of its inputs over
  them (what every token shares cannot decide its route), and the model still computes the dense
  one's logits."""
  from reasoning_rl.models.upcycle import upcycle

  write_tiny_model("llama", tmp_path / "dense")
  dense, _ = load_hf_weights(tmp_path / "dense")
  rows = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
  moe = upcycle(dense, num_experts=4, experts_per_token=2, seed=1, calibration=rows)
  plain = upcycle(dense, num_experts=4, experts_per_token=2, seed=1)
  width = 5
  tokens = np.zeros((3, width), np.int32)
  mask = np.zeros((3, width), np.int32)
  for i, row in enumerate(rows):
    tokens[i, width - len(row):], mask[i, width - len(row):] = row, 1
  _, stats = moe.hidden_states(jnp.asarray(tokens), jnp.asarray(mask), with_router_stats=True)
  means = np.asarray(stats.input_sum) / np.asarray(stats.tokens)[:, None]
  for layer, (block, before) in enumerate(zip(moe.layers, plain.layers)):
    router = np.asarray(block.mlp.router[...])
    assert np.abs(means[layer] @ router).max() < 1e-5 * np.abs(means[layer]).sum()
    assert np.abs(means[layer] @ np.asarray(before.mlp.router[...])).max() > 1e-3
  ids, mask = _batch(dense.config.vocab_size, seed=11)
  valid = np.asarray(mask) > 0
  np.testing.assert_allclose(np.asarray(moe(ids, mask))[valid],
                             np.asarray(dense(ids, mask))[valid], atol=2e-5, rtol=0)
