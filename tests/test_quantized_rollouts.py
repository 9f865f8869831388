"""Quantized rollouts (`rollout.weight_quantization`, reasoning_rl/sampler/quantized.py): what the
sampler holds and computes, that its reported log-probs are its own (the behaviour policy μ the
loss corrects against), that a weight sync re-quantizes, the planner's count, and the refusals.

How close the quantized sampler is to the float model, derived rather than measured: absmax
quantization per output channel j stores q = round(W / s_j) with s_j = max_i |W_ij| / q_max
(i over the contracting axes), so the dequantized kernel Ŵ = q · s_j is off by at most half a
step: |Ŵ − W| ≤ s_j / 2 for int8 (qwix takes q_max = 127.5, the top bucket's upper edge: W / s_j
lies in [−127.5, 127.5], rounds into [−128, 128] and 128 saturates to 127, still half a step). float8_e4m3fn keeps 3 mantissa
bits: a normal value is rounded to within half an ulp, 2^-4 of its magnitude, and a subnormal
(below 2^-6, steps of 2^-9) to within 2^-10, so |Ŵ − W| ≤ 2^-4 |W| + 2^-10 s_j (q_max = 448).
The quantized model computes exactly the float model at Ŵ (checked to float rounding), so one
projection's output moves by at most Σ_i |x_i| |Ŵ_ij − W_ij| (checked on qwix's own einsum).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx, traverse_util
from jax.sharding import AbstractMesh

from reasoning_rl import build as build_lib
from reasoning_rl import config as config_lib
from reasoning_rl import param_plan, run_settings
from reasoning_rl.errors import ConfigError
from reasoning_rl.loop import rl_stage
from reasoning_rl.loop.state import LoopState
from reasoning_rl.models.config import ModelConfig, MoEConfig
from reasoning_rl.models.transformer import create_model
from reasoning_rl.quantized_plan import CONTRACTING_AXES
from reasoning_rl.rl.sampler_weights import SamplerWeights
from reasoning_rl.rl.step_config import StepConfig
from reasoning_rl.sampler import SamplingParams
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.quantized import WeightQuantizer, quantized_model, sampler_bytes
from tests.support.configs import TINY, _config, debug_config
from tests.support.sampler import CONFIG
from tests.test_deepseek_v3 import tiny_config

Q_MAX = {"int8": 127.5, "fp8": 448.0}
PROMPT = [3, 14, 15, 92, 65, 35, 89]


def _flat(state) -> dict:
  return traverse_util.flatten_dict(nnx.to_pure_dict(state))


def _kernels(quantizer, params) -> dict:
  """path -> (float kernel W, quantized values q, scales s) of every quantized projection."""
  float_flat, quantized_flat = _flat(params), _flat(quantizer(params))
  return {path: (np.asarray(float_flat[path], np.float32),
                 np.asarray(quantized_flat[path + ("array", "qvalue")].astype(jnp.float32)),
                 np.asarray(quantized_flat[path + ("array", "scale")], np.float32))
          for path in quantizer.how}


def _dequantized_state(quantizer, params):
  """The plain model's state with every quantized kernel replaced by Ŵ = q · s."""
  flat = _flat(params)
  for path, (_, q, s) in _kernels(quantizer, params).items():
    flat[path] = jnp.asarray(q * s)
  state = jax.tree.map(lambda x: x, params)
  nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(flat))
  return state


def _full_logprobs(graphdef, params, tokens) -> np.ndarray:
  """log p(tokens[t] | tokens[:t]) for t ≥ 1, from one full forward."""
  return _full_logprobs_of_rows(graphdef, params, [tokens])[0]


def _full_logprobs_of_rows(graphdef, params, rows) -> list[np.ndarray]:
  """`_full_logprobs` of each row, from one forward over the rows right-padded to the longest
  (the model is causal: padding after a row's last token changes none of its log-probs)."""
  length = max(len(row) for row in rows)
  batch = np.zeros((len(rows), length), np.int32)
  for index, row in enumerate(rows):
    batch[index, :len(row)] = row
  logits = nnx.merge(graphdef, params)(jnp.asarray(batch))
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
  return [logp[index, np.arange(len(row) - 1), np.asarray(row[1:])]
          for index, row in enumerate(rows)]


def _decode(model, params, *, temperature=1.0, steps=6, seed=0):
  """(tokens, reported log-probs) of one sample of PROMPT decoded by an engine on `model`,
  after `update_params(params)` (the weight sync's path)."""
  engine = Engine(model, max_concurrent_decodes=2, max_prefill_length=16,
                  max_decode_length=steps, steps_per_call=steps)
  if params is not None:
    engine.update_params(params, version=1)
  request = engine.make_request(key=jax.random.key(seed),
                                sampling=SamplingParams(temperature=temperature),
                                max_new_tokens=steps)
  padded, length = engine.prepare_prompt(PROMPT)
  prefix, _ = engine.prefill(params=engine.params, padded_tokens=padded, true_length=length,
                             request=request)
  state = engine.insert(prefix, engine.init_decode_state(), 0)
  _, result = engine.generate(engine.params, state)
  result = result.to_host()
  valid = result.valid[0]
  return list(result.tokens[0][valid]), result.logprobs[0][valid]


@pytest.fixture(scope="module")
def float_model():
  return create_model(CONFIG, seed=0)


@pytest.fixture(scope="module", params=["int8", "fp8"])
def quantizer(request, float_model):
  graphdef, params = nnx.split(float_model)
  return WeightQuantizer(graphdef, params, request.param)


# ------------------------------------------------------------------------------ what it holds


def test_every_projection_is_quantized_per_output_channel_within_half_a_step(quantizer,
                                                                              float_model):
  params = nnx.state(float_model)
  kernels = _kernels(quantizer, params)
  names = {path[-1] for path in kernels}
  assert names == set(CONTRACTING_AXES) and len(kernels) == 7 * CONFIG.num_layers
  q_max = Q_MAX[quantizer.quantization]
  for path, (w, q, s) in kernels.items():
    contracted = CONTRACTING_AXES[path[-1]]
    # one scale per output channel: absmax over the contracting axes / q_max
    np.testing.assert_allclose(s, np.abs(w).max(axis=contracted, keepdims=True) / q_max,
                               rtol=1e-6)
    error = np.abs(q * s - w)
    if quantizer.quantization == "int8":
      assert np.all(q == np.round(q)) and -128 <= q.min() and q.max() <= 127
      bound = s / 2
    else:
      bound = 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * s
    # 1e-4: float32 rounding of W / s and q · s (the extreme element sits right at s / 2)
    assert np.all(error <= bound * (1 + 1e-4) + 1e-12), path
    assert error.max() > 0  # something was rounded
  dtypes = {leaf.dtype for path, leaf in _flat(quantizer(params)).items() if path[-1] == "qvalue"}
  assert dtypes == {jnp.dtype({"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[
      quantizer.quantization])}


def test_the_quantized_model_is_the_float_model_at_the_dequantized_weights(quantizer,
                                                                           float_model):
  graphdef, params = nnx.split(float_model)
  tokens = jnp.asarray([PROMPT])
  quantized = quantizer.model(params)(tokens)
  at_dequantized = nnx.merge(graphdef, _dequantized_state(quantizer, params))(tokens)
  np.testing.assert_allclose(quantized, at_dequantized, atol=2e-5)
  assert float(jnp.abs(quantized - float_model(tokens)).max()) > 1e-4  # not the float model


def test_one_projection_moves_by_at_most_the_derived_bound(quantizer, float_model):
  params = nnx.state(float_model)
  path = ("layers", 0, "mlp", "gate_proj")
  w, q, s = _kernels(quantizer, params)[path]
  x = np.asarray(jax.random.normal(jax.random.key(1), (5, w.shape[0])), np.float32)
  flat = _flat(quantizer(params))
  stored = qwix.QArray(qvalue=flat[path + ("array", "qvalue")],
                       scale=flat[path + ("array", "scale")], qtype=flat[
                           path + ("array", "qvalue")].dtype)
  y_quantized = np.asarray(qwix.einsum("td,df->tf", jnp.asarray(x), stored))
  error_bound = np.abs(x) @ np.abs(q * s - w)
  assert np.all(np.abs(y_quantized - x @ w) <= error_bound + 1e-5)
  np.testing.assert_allclose(y_quantized, x @ (q * s), atol=1e-5)


# ------------------------------------------------------------------------------ μ is its own


def test_the_samplers_logprobs_are_the_quantized_models_own(quantizer, float_model):
  graphdef, params = nnx.split(float_model)
  quantized_params = quantizer(params)
  tokens, reported = _decode(quantizer.model(params), None)
  sequence = PROMPT + tokens
  own = _full_logprobs(quantizer.graphdef, quantized_params, sequence)[len(PROMPT) - 1:]
  floats = _full_logprobs(graphdef, params, sequence)[len(PROMPT) - 1:]
  np.testing.assert_allclose(reported, own, atol=2e-5)
  # the float model's would be another μ, farther off than the decode path's rounding
  assert np.abs(reported - floats).max() > 20 * np.abs(reported - own).max() + 1e-4


def test_a_weight_sync_requantizes_and_sends_the_quantized_form(quantizer, float_model):
  graphdef, params = nnx.split(float_model)
  _, new_params = nnx.split(create_model(CONFIG, seed=1))
  sampler_weights = SamplerWeights(StepConfig(), quantizer)
  engine_model = quantizer.model(params)
  sent = sampler_weights(new_params, None)
  # what the sync sends: the quantized kernels and their scales, less than the float weights
  assert jax.tree.structure(sent) == jax.tree.structure(nnx.state(engine_model))
  assert sampler_bytes(sent) < 0.5 * sampler_bytes(new_params)
  tokens, reported = _decode(engine_model, sent)
  sequence = PROMPT + tokens
  new_own = _full_logprobs(quantizer.graphdef, quantizer(new_params), sequence)
  old_own = _full_logprobs(quantizer.graphdef, quantizer(params), sequence)
  np.testing.assert_allclose(reported, new_own[len(PROMPT) - 1:], atol=2e-5)
  assert np.abs(reported - old_own[len(PROMPT) - 1:]).max() > 1e-2


def test_the_engines_first_weights_come_from_the_sync_function(float_model):
  """build() makes the sampler's first model with the quantizer every sync uses."""
  model = quantized_model(float_model, "int8")
  graphdef, params = nnx.split(float_model)
  again = WeightQuantizer(graphdef, params, "int8")(params)
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------ the planner


def test_the_planner_counts_the_quantized_sampler_byte_for_byte():
  """TINY (2 layers, hidden 16, MLP 21, 3 heads, 1 KV head of 4, float32): 1520 projection
  elements per layer (q 192, k 64, v 64, o 192, gate / up / down 336 each) drop from 4 bytes to
  1, plus 94 float32 scales per layer (q 12, k 4, v 4, o 16, gate 21, up 21, down 16)."""
  single = AbstractMesh((1, 1, 1), ("data", "fsdp", "tensor"))
  counts = {}
  for quantization in ("none", "int8", "fp8"):
    config = _config()
    config.rollout.weight_quantization = quantization
    shapes = param_plan.ModelShapes.of(config, TINY)
    counts[quantization] = shapes.sampler_weights(single)
    assert shapes.sent(single) == counts[quantization]
  saved = 2 * (1520 * 4 - 1520 - 94 * 4)
  assert counts["none"] - counts["int8"] == saved == counts["none"] - counts["fp8"]
  # and the quantizer itself holds exactly that many bytes
  graphdef, params = nnx.split(create_model(TINY, seed=0))
  assert sampler_bytes(WeightQuantizer(graphdef, params, "int8").abstract) == counts["int8"]
  assert sampler_bytes(params) == counts["none"]


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("overrides, field, names", [
    ({"rollout.exact_logprobs": True}, "rollout.exact_logprobs",
     "rollout.weight_quantization"),
    ({"lora.rank": 4}, "lora.sampler_weights", "rollout.weight_quantization"),
    ({"model.scan_layers": True}, "model.scan_layers", "rollout.weight_quantization"),
])
def test_combinations_it_does_not_cover_are_refused_naming_both_fields(overrides, field, names):
  config = debug_config(**{"rollout.weight_quantization": "int8", **overrides})
  with pytest.raises(ConfigError, match=rf"config\.{field}=.*{names}"):
    config_lib.validate(config)
  config.rollout.weight_quantization = "none"
  config_lib.validate(config)  # fine without quantization


def test_merged_lora_is_accepted():
  config = debug_config(**{"rollout.weight_quantization": "int8", "lora.rank": 4,
                           "lora.sampler_weights": "merged"})
  config_lib.validate(config)


def test_models_it_cannot_quantize_are_refused_naming_the_field():
  moe = ModelConfig(model_type="qwen3_moe", vocab_size=97, hidden_size=32, intermediate_size=48,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    moe=MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=16,
                                  sparse_layers=(True, True)))
  for config, what in ((moe, "mixture-of-experts"),
                       (tiny_config(), "latent attention")):  # DeepSeek-V3: MLA (and MoE)
    graphdef, params = nnx.split(create_model(config, seed=0))
    with pytest.raises(ConfigError, match=rf"config\.rollout\.weight_quantization='int8'.*{what}"):
      WeightQuantizer(graphdef, params, "int8")


def test_quantized_rollouts_always_correct_against_the_sampler():
  config = debug_config(**{"rollout.weight_quantization": "int8"})
  assert config.algo.is_correction == "none"
  assert run_settings.sampler_correction(config) == "token-truncate"
  config.algo.is_correction = "sequence-mask"  # a chosen correction is kept
  assert run_settings.sampler_correction(config) == "sequence-mask"
  assert run_settings.sampler_correction(debug_config()) == "none"


# ------------------------------------------------------------------------------ end to end


def test_the_step_weighs_each_token_by_the_quantized_samplers_mu(monkeypatch, tmp_path):
  """One RL step of the debug config with int8 rollouts: the batch's behaviour log-probs are
  the quantized model's own, and the step's importance weights compare the trainer's float
  π_old with them (tis/abs_log_diff is their mismatch, not the decode path's rounding)."""
  config = debug_config(**{"rollout.weight_quantization": "int8"})
  config.workdir = str(tmp_path)
  run = build_lib.build(config)
  loop = build_lib.build_loop(run)
  assert loop.stage.with_sampler_logprobs
  float_params = jax.tree.map(np.array, run.step_fn.full_params(run.state))
  engine = run.backend.engine
  quantized_params, quantized_graphdef = engine.params, engine._graphdef  # pylint: disable=protected-access
  batches = []
  build_batch = rl_stage.batching.build_batch
  monkeypatch.setattr(rl_stage.batching, "build_batch",
                      lambda *a, **k: batches.append(build_batch(*a, **k)) or batches[-1])
  try:
    _, row = loop.stage.step(1, run.state, LoopState(guards=None))
  finally:
    run.scorer.close()
  [batch] = batches
  prompt_length = config.rollout.max_prefill_length
  sequences, offsets, reports = [], [], []
  for tokens, attention, mask, behavior in zip(batch["tokens"], batch["attention_mask"],
                                               batch["completion_mask"],
                                               batch["behavior_logprobs"]):
    if not mask.any():
      continue
    start = int(np.argmax(attention))  # prompts are left-padded
    sequences.append(list(tokens[start:prompt_length + int(mask.sum())]))
    offsets.append(prompt_length - start - 1)
    reports.append(behavior[mask > 0])
  quantized_rows = _full_logprobs_of_rows(quantized_graphdef, quantized_params, sequences)
  plain_rows = _full_logprobs_of_rows(run.graphdef, float_params, sequences)
  own, floats = [], []
  for offset, reported, quantized, plain in zip(offsets, reports, quantized_rows, plain_rows):
    quantized, plain = quantized[offset:], plain[offset:]
    np.testing.assert_allclose(reported, quantized, atol=5e-5)
    own.append(np.abs(reported - quantized))
    floats.append(np.abs(plain - reported))
  own, floats = np.concatenate(own), np.concatenate(floats)
  assert floats.mean() > 20 * own.mean() + 1e-5  # μ is not the float model
  # the step's |log π_old − log μ| is the float-vs-quantized mismatch of these very tokens
  assert row["train/tis/abs_log_diff"] == pytest.approx(float(floats.mean()), rel=0.02,
                                                        abs=1e-5)


def test_a_merged_lora_run_sends_the_merged_model_quantized(tmp_path):
  """LoRA with lora.sampler_weights='merged': the sampler decodes the plain model with the
  adapters folded in, quantized; a sync sends that (int8 kernels) and the engine takes it."""
  config = debug_config(**{"rollout.weight_quantization": "int8", "lora.rank": 4,
                           "lora.sampler_weights": "merged"})
  config.workdir = str(tmp_path)
  run = build_lib.build(config)
  try:
    published = run.weight_sync.push(run.state, 1)
  finally:
    run.scorer.close()
  engine = run.backend.engine
  sent = run.step_fn.sampler_weights(run.state)
  assert jax.tree.structure(sent) == jax.tree.structure(engine.params)
  assert published.num_bytes == sampler_bytes(sent) and engine.policy_version == 1
  kernels = [leaf for path, leaf in _flat(sent).items() if path[-1] == "qvalue"]
  assert kernels and all(leaf.dtype == jnp.int8 for leaf in kernels)
  assert not any("lora" in str(path) for path in _flat(sent))
