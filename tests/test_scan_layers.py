"""The scanned block stack (`scan_layers`) computes what the loop computes, and converts at the
edges: logits, decoding, a train step's loss and gradients, every remat policy, the HF files and
LoRA adapters (their PEFT export included) are the loop's. Tiny random float32 models."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from reasoning_rl import lora, sharding
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.checkpoints import load_hf_weights, save_hf
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import (
    REMAT_POLICIES, KVCache, create_model, layer_period, logical_axes, positions_from_mask,
    remat_policy, stack_layers, unstack_layers)
from reasoning_rl.rl.stats import finalize
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig
from tests.support.steps import PROBE_LR, assert_same_gradient, gradient_probe, make_batch


CONFIGS = {
    "llama": ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8),
    "qwen2": ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                         attention_bias=True, tie_word_embeddings=True),
    # alternating local (window 3) / global layers, soft-caps, sandwich norms: scanned in pairs
    "gemma2": ModelConfig(model_type="gemma2", vocab_size=64, hidden_size=32,
                          intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
                          head_dim=8, attn_logit_softcap=20.0, final_logit_softcap=30.0,
                          sliding_window=3, activation="gelu_tanh", norm_plus_one=True,
                          scale_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=8.0,
                          tie_word_embeddings=True,
                          layer_types=("sliding_attention", "full_attention") * 2),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 64, (3, 11)), jnp.int32)
MASK = jnp.asarray(np.r_[[[0, 0] + [1] * 9], np.ones((2, 11))], jnp.int32)  # a left-padded row


def both(name, seed=1):
  return create_model(CONFIGS[name], seed=seed), create_model(CONFIGS[name], seed=seed,
                                                              scan_layers=True)


def logits(model, tokens=TOKENS, mask=MASK):
  """model(tokens, mask), jitted (eager dispatch of a scan costs seconds per call)."""
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, m))(state, tokens, mask)


def jitted_decode(model):
  graphdef, state = nnx.split(model)
  run = jax.jit(lambda s, *args: nnx.merge(graphdef, s).decode(*args))
  return lambda *args: run(state, *args)


def max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def test_layer_period_is_the_shortest_repeat_of_the_layer_types():
  assert layer_period(CONFIGS["llama"]) == 1
  assert layer_period(CONFIGS["gemma2"]) == 2
  odd = dataclasses.replace(CONFIGS["gemma2"], num_layers=3,
                            layer_types=("sliding_attention", "full_attention", "full_attention"))
  assert layer_period(odd) == 3  # no shorter repeat: one scan step of all three


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_scanned_layout_stacks_the_loops_weights_and_computes_its_logits(name):
  loop, scan = both(name)
  # create_model(seed) gives the same weights in both layouts, and stack_layers reproduces it
  stacked = nnx.state(stack_layers(loop))
  for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(nnx.state(scan)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  q = nnx.state(scan)["layers"]["attn"]["q_proj"]
  assert q.shape[0] == CONFIGS[name].num_layers
  assert q.get_metadata()["logical_axes"] == ("layers", "embed", "heads", "head_dim")
  expected = logits(loop)
  assert max_diff(logits(scan), expected) < 1e-5
  assert max_diff(logits(unstack_layers(scan)), expected) == 0  # the loop's own weights


def test_unstacking_restores_the_loop_layout_paths_and_axes():
  loop, scan = both("gemma2")
  back = unstack_layers(scan)
  assert nnx.graphdef(back) == nnx.graphdef(loop)  # per-layer windows included
  flat = lambda m: [(p, np.asarray(v[...])) for p, v in nnx.to_flat_state(nnx.state(m))]  # noqa
  for (pa, a), (pb, b) in zip(flat(back), flat(loop), strict=True):
    assert pa == pb
    np.testing.assert_array_equal(a, b)
  assert logical_axes(nnx.state(back)) == logical_axes(nnx.state(loop))
  # stacking did not touch the loop model's own metadata
  assert nnx.state(loop)["layers"][0]["mlp"]["up_proj"].get_metadata()["logical_axes"] == (
      "embed", "mlp")


def test_stacked_parameters_replicate_the_layer_axis_on_the_mesh():
  """On the suite's 2x2x2 mesh (every axis > 1, so a rule that shards shows): each stacked
  parameter keeps its layer axis whole and shards its other axes as the loop's own layer does.
  gemma2's 4 stacked layers divide by every mesh axis, so nothing but the rule keeps them whole."""
  mesh = sharding.make_mesh((2, 2, 2))
  P = jax.sharding.PartitionSpec  # noqa: N806
  assert sharding.logical_to_spec(("layers", "embed", "mlp"), (4, 32, 48), mesh) == P(
      None, "fsdp", "tensor")
  loop, scan = both("gemma2")
  stacked = dict(nnx.to_flat_state(sharding.param_shardings(nnx.state(scan), mesh)))
  per_layer = dict(nnx.to_flat_state(sharding.param_shardings(nnx.state(loop), mesh)))
  layer_params = [path for path in stacked if path[0] == "layers"]
  assert len(layer_params) == 11  # q, k, v, o; gate, up, down; four sandwich norms
  for path in layer_params:
    assert nnx.state(scan)["layers"][path[1]][path[2]].shape[0] == 4
    for layer in range(4):
      loop_spec = per_layer[("layers", layer) + path[1:]].spec
      assert stacked[path].spec == P(None, *loop_spec), path
  assert stacked[("layers", "mlp", "up_proj")].spec == P(None, "fsdp", "tensor")  # sharded


@pytest.mark.parametrize("name", ["qwen2", "gemma2"])
def test_greedy_decoding_picks_the_same_tokens(name):
  """Prefill then 12 greedy steps through each layout's KV cache (per-layer tuple vs stacked):
  past gemma2's window of 3, so the local layers' masking is exercised."""
  config = CONFIGS[name]
  outputs = []
  for scan_layers in (False, True):
    decode = jitted_decode(create_model(config, seed=2, scan_layers=scan_layers))
    cache = KVCache.init(config, 3, 32, stacked=scan_layers)
    positions = positions_from_mask(MASK)
    step_logits, cache = decode(TOKENS, positions, cache, jnp.zeros(3, jnp.int32))
    position = positions[:, -1] + 1
    slot = jnp.full(3, TOKENS.shape[1], jnp.int32)
    token = jnp.argmax(step_logits[:, -1], -1)
    tokens, all_logits = [token], [step_logits]
    for _ in range(12):
      step_logits, cache = decode(token[:, None], position[:, None], cache, slot)
      token = jnp.argmax(step_logits[:, -1], -1)
      tokens.append(token)
      all_logits.append(step_logits)
      position, slot = position + 1, slot + 1
    outputs.append((np.stack(tokens, 1), all_logits, cache))
  (loop_tokens, loop_logits, loop_cache), (scan_tokens, scan_logits, scan_cache) = outputs
  np.testing.assert_array_equal(scan_tokens, loop_tokens)
  for a, b in zip(scan_logits, loop_logits):
    assert max_diff(a, b) < 1e-5
  assert scan_cache.stacked and not loop_cache.stacked
  assert max_diff(scan_cache.k, jnp.stack(loop_cache.k)) < 1e-5
  with pytest.raises(ValueError, match="stacked"):
    jitted_decode(create_model(config, scan_layers=True))(
        TOKENS, positions_from_mask(MASK), KVCache.init(config, 3, 32), jnp.zeros(3, jnp.int32))


def step_gradient(scan_layers: bool, remat="none"):
  """(the gradient of one GRPO step as the loop layout's flat leaves, its loss): read off an
  SGD update at PROBE_LR, as tests/test_train_step.py does."""
  config = CONFIGS["qwen2"]
  model = create_model(config, seed=0, scan_layers=scan_layers)
  graphdef, params = nnx.split(model)
  before = jax.tree.map(np.asarray, params)
  step = TrainStep(graphdef, StepConfig(beta=0.04, learning_rate=1.0, remat=remat))
  step.optimizer = gradient_probe()
  reference = jax.tree.map(jnp.copy, params)
  state, stats = step(step.init_state(params, ref_params=reference), make_batch())
  gradient = jax.tree.map(lambda b, a: (np.asarray(b, np.float64) - a) / PROBE_LR, before,
                          jax.tree.map(np.asarray, state.params))
  as_loop = nnx.state(unstack_layers(nnx.merge(graphdef, gradient)))
  return [np.asarray(g) for g in jax.tree.leaves(as_loop)], finalize(jax.device_get(stats))["loss"]


@pytest.fixture(scope="module")
def loop_gradient():
  return step_gradient(False)


def test_a_train_step_has_the_loops_loss_and_gradient(loop_gradient):
  gradient, loss = step_gradient(True)
  assert loss == pytest.approx(loop_gradient[1], rel=1e-5)
  assert_same_gradient(gradient, loop_gradient[0])


@pytest.mark.parametrize("policy", REMAT_POLICIES)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_every_remat_policy_gives_the_same_gradient(loop_gradient, scan_layers, policy):
  gradient, loss = step_gradient(scan_layers, policy)
  assert loss == pytest.approx(loop_gradient[1], rel=1e-5)
  assert_same_gradient(gradient, loop_gradient[0])


def test_remat_names_and_the_older_bool():
  assert [remat_policy(v) for v in (False, True, "save_matmuls")] == [
      "none", "full", "save_matmuls"]
  with pytest.raises(ValueError, match="remat='some'"):
    remat_policy("some")


def test_hf_files_are_the_loops_and_load_back(tmp_path):
  loop, scan = both("gemma2")
  save_hf(loop, None, tmp_path / "loop")
  save_hf(scan, None, tmp_path / "scan")
  written, expected = (load_file(str(tmp_path / d / "model.safetensors"))
                       for d in ("scan", "loop"))
  assert sorted(written) == sorted(expected)
  assert "model.layers.3.mlp.up_proj.weight" in written  # one tensor per layer, as HF names it
  for name, tensor in expected.items():
    np.testing.assert_array_equal(written[name], tensor)
  loaded, _ = load_hf_weights(tmp_path / "scan")
  assert max_diff(logits(stack_layers(loaded)), logits(loop)) < 1e-5


SETTINGS = lora.LoraSettings(rank=4, alpha=8.0)


def with_random_b(model, seed=5):
  """Trained-looking adapters (B is zero at initialisation), set layer by layer on the loop
  layout so both layouts get the same values."""
  adapters = nnx.state(model, nnx.LoRAParam)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(adapters))))
  nnx.update(model, jax.tree.map(
      lambda a: 0.05 * jax.random.normal(next(keys), a.shape, a.dtype), adapters))
  return model


def test_lora_adapters_carry_over_and_export_as_the_loops(tmp_path):
  loop_adapted = with_random_b(lora.apply_lora(create_model(CONFIGS["llama"], seed=0), SETTINGS))
  scan_adapted = stack_layers(loop_adapted)
  # apply_lora on a scanned model adapts it as the loop layout would (same A, zero B)
  fresh = lora.apply_lora(create_model(CONFIGS["llama"], seed=0, scan_layers=True), SETTINGS)
  assert fresh.scan_layers
  expected_a = nnx.state(stack_layers(lora.apply_lora(create_model(CONFIGS["llama"], seed=0),
                                                      SETTINGS)), nnx.LoRAParam)
  for a, b in zip(jax.tree.leaves(nnx.state(fresh, nnx.LoRAParam)),
                  jax.tree.leaves(expected_a), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  a_stack = nnx.state(scan_adapted)["layers"]["attn"]["q_proj_lora_a"]
  assert a_stack.shape == (3, 32, 4) and a_stack.get_metadata()["logical_axes"] == (
      "layers", None, None)
  # forward and decode see the adapters (qwix intercepts the scanned stack's projections)
  expected = logits(loop_adapted)
  assert max_diff(expected, logits(create_model(CONFIGS["llama"], seed=0))) > 1e-3
  assert max_diff(logits(scan_adapted), expected) < 1e-5
  positions = positions_from_mask(MASK)
  start = jnp.zeros(3, jnp.int32)
  loop_logits, _ = jitted_decode(loop_adapted)(
      TOKENS, positions, KVCache.init(CONFIGS["llama"], 3, 16), start)
  scan_logits, _ = jitted_decode(scan_adapted)(
      TOKENS, positions, KVCache.init(CONFIGS["llama"], 3, 16, stacked=True), start)
  assert max_diff(scan_logits, loop_logits) < 1e-5
  # merged weights (the sampler's "merged" copy, save_hf) and the PEFT files: the loop's
  merged = lora.merged_model(scan_adapted)
  assert merged.scan_layers
  assert max_diff(logits(merged), expected) < 1e-5
  lora.save_peft(loop_adapted, tmp_path / "loop")
  lora.save_peft(scan_adapted, tmp_path / "scan")
  assert ((tmp_path / "scan" / "adapter_config.json").read_text()
          == (tmp_path / "loop" / "adapter_config.json").read_text())
  written, wanted = (load_file(str(tmp_path / d / "adapter_model.safetensors"))
                     for d in ("scan", "loop"))
  assert sorted(written) == sorted(wanted)
  for name, tensor in wanted.items():
    np.testing.assert_array_equal(written[name], tensor)


def test_adapting_some_layers_only_is_refused_for_a_scanned_stack():
  some = dataclasses.replace(SETTINGS, target_modules=r"layers/1/(attn|mlp)")
  with pytest.raises(ConfigError, match="adapts some layers and not others"):
    lora.apply_lora(create_model(CONFIGS["llama"], seed=0, scan_layers=True), some)


def test_the_sampler_engine_decodes_a_scanned_model_as_the_loop():
  """Continuous batching (7 prompts over 3 slots: prefill, insert, decode of some rows only)
  through the stacked KV cache: the loop model's greedy and sampled completions."""
  from reasoning_rl.sampler import Engine, SamplingParams, generate_groups
  from tests.support.sampler import PROMPTS, tiny_model

  loop = tiny_model(1)
  outputs = []
  for model in (loop, stack_layers(loop)):
    engine = Engine(model, max_concurrent_decodes=3, max_prefill_length=32, max_decode_length=16,
                    steps_per_call=4)
    greedy = generate_groups(engine, PROMPTS, sampling=SamplingParams(temperature=0.0),
                             max_new_tokens=12)
    sampled = generate_groups(engine, PROMPTS[:3], num_samples=2, max_new_tokens=8, seed=3)
    outputs.append(greedy + sampled)
  for loop_completion, scan_completion in zip(*outputs, strict=True):
    assert scan_completion.completion_ids == loop_completion.completion_ids
    np.testing.assert_allclose(scan_completion.logprobs, loop_completion.logprobs, atol=1e-4)


def test_a_scanned_run_trains_as_the_loop_run_and_its_checkpoints_load(tmp_path):
  """configs/debug_cpu.py for 2 steps with and without model.scan_layers (LoRA, so the adapters,
  the base fingerprint and the adapters-only weight sync go through the scanned layout too): the
  same completions and losses; the scanned run's checkpoint loads (launch/evaluate.py) and
  reproduces its in-training evaluation."""
  import json

  from reasoning_rl.metrics import read_metrics
  from tests.support.runs import LOSS_ABS, assert_evaluate_cli_reproduces, rollouts, train

  # the evaluation as configs/debug_cpu.py has it: launch/evaluate.py reads that config alone
  common = ("--config.total_steps=2", "--config.checkpoint.every_steps=2",
            "--config.lora.rank=4", "--config.beta=0.04")
  train(tmp_path / "loop", *common)
  train(tmp_path / "scan", *common, "--config.model.scan_layers=True")
  assert json.loads((tmp_path / "scan" / "run_config.json").read_text())["model"]["scan_layers"]
  loop_rows, scan_rows = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("loop", "scan"))
  for loop_row, scan_row in zip(loop_rows, scan_rows, strict=True):
    assert scan_row["loss"] == pytest.approx(loop_row["loss"], rel=1e-4, abs=LOSS_ABS)
    assert scan_row["reward/mean"] == loop_row["reward/mean"]
  assert ([r["completion"] for r in rollouts(tmp_path / "scan")]
          == [r["completion"] for r in rollouts(tmp_path / "loop")])
  assert_evaluate_cli_reproduces(tmp_path / "scan", tmp_path / "eval.json", step=2)


def test_the_remat_field_is_validated():
  import importlib

  from reasoning_rl import config as config_lib

  config = importlib.import_module("configs.debug_cpu").get_config()
  config.workdir = "/unused"
  config.algo.remat = "save_matmuls"
  config_lib.validate(config)
  config.algo.remat = "some"
  with pytest.raises(ConfigError, match=r"^config\.algo\.remat='some': must be one of none"):
    config_lib.validate(config)


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_a_quantized_base_stacks_with_its_adapters(quantization):
  """QLoRA: qwix's quantized weights (values and scales) stack like any parameter, and the
  scanned stack computes the loop's logits."""
  settings = dataclasses.replace(SETTINGS, base_quantization=quantization, quantization_tile=8)
  loop = with_random_b(lora.apply_lora(create_model(CONFIGS["llama"], seed=0), settings))
  assert max_diff(logits(stack_layers(loop)), logits(loop)) < 1e-5
