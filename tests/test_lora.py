"""LoRA / QLoRA (reasoning_rl.lora): the adapted model, the adapters-only step, sampler sync and
exports to transformers / PEFT.

The gradient check uses fixed π_old log-probs: with μ = 1 the step's own π_old is the current
policy held constant, whose loss has the same gradient at the current parameters but a value that
does not move (ratio 1 everywhere), so only a fixed π_old gives finite differences something to
measure.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from reasoning_rl import lora
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import KVCache, create_model, positions_from_mask
from reasoning_rl.rl import losses
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.rl.stats import finalize
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig
from tests.support.steps import (  # the same vocabulary (64) as CONFIG
    B, T, make_batch, reference_kl)


CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
SETTINGS = lora.LoraSettings(rank=4, alpha=8.0)
def adapted_model(settings=SETTINGS, *, seed=0, random_b=False, config=CONFIG, dtype=jnp.float32):
  model = lora.apply_lora(create_model(config, seed=seed, dtype=dtype, param_dtype=dtype),
                          settings, seed=seed)
  if random_b:  # B is zero at initialisation; a trained adapter is not
    adapters = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda a: 0.05 * jax.random.normal(next(keys), a.shape, a.dtype),
                            adapters)
    nnx.update(model, adapters)
  return model


def test_zero_b_computes_exactly_the_base_in_forward_and_decode():
  base = create_model(CONFIG, seed=0)
  model = adapted_model()
  adapters = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
  assert len(adapters) == 2 * 7 * CONFIG.num_layers  # A and B of q k v o gate up down per layer
  tokens = make_batch()["tokens"]
  np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(base(tokens)))
  positions = positions_from_mask(jnp.ones_like(tokens))
  start = jnp.zeros(B, jnp.int32)
  base_logits, _ = base.decode(tokens, positions, KVCache.init(CONFIG, B, 16), start)
  lora_logits, _ = model.decode(tokens, positions, KVCache.init(CONFIG, B, 16), start)
  np.testing.assert_array_equal(np.asarray(lora_logits), np.asarray(base_logits))


def test_target_modules_select_modules_and_an_empty_match_is_refused():
  attention_only = adapted_model(dataclasses.replace(SETTINGS, target_modules=r"layers/1/attn"))
  names = {str(p[-1]) for p, _ in nnx.to_flat_state(nnx.state(attention_only, nnx.LoRAParam))}
  paths = {tuple(map(str, p[:3])) for p, _ in nnx.to_flat_state(
      nnx.state(attention_only, nnx.LoRAParam))}
  assert paths == {("layers", "1", "attn")}
  assert names == {f"{w}_proj_lora_{ab}" for w in "qkvo" for ab in "ab"}
  with pytest.raises(ConfigError, match="config.lora.target_modules='layers/9/mlp'"):
    adapted_model(dataclasses.replace(SETTINGS, target_modules=r"layers/9/mlp"))
  with pytest.raises(ConfigError, match="config.lora.base_quantization='int4'"):
    dataclasses.replace(SETTINGS, base_quantization="int4").validate()


def lora_step(settings=SETTINGS, *, beta=0.0, optimizer=None, **step_kwargs):
  graphdef, params = nnx.split(adapted_model(settings, random_b=True))
  step = TrainStep(graphdef, StepConfig(lora=settings, beta=beta, learning_rate=1e-2,
                                        **step_kwargs))
  if optimizer is not None:
    step.optimizer = optimizer
  return step, step.init_state(params)


def test_a_step_changes_only_the_adapters_and_the_optimizer_holds_only_them():
  step, state = lora_step(beta=0.04)
  base_before = [np.asarray(x).copy() for x in jax.tree.leaves(state.frozen_params)]
  adapters_before = [np.asarray(x).copy() for x in jax.tree.leaves(state.params)]
  assert state.ref_params is None  # the reference is the base itself: no copy of the weights
  adapter_elements = sum(x.size for x in adapters_before)
  moment_elements = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
  assert moment_elements == 2 * adapter_elements  # Adam's two moments, adapters only
  state, stats = step(state, make_batch())
  for before, after in zip(base_before, jax.tree.leaves(state.frozen_params), strict=True):
    np.testing.assert_array_equal(before, np.asarray(after))  # exact: the step never writes them
  changed = [not np.array_equal(b, np.asarray(a))
             for b, a in zip(adapters_before, jax.tree.leaves(state.params), strict=True)]
  assert all(changed)
  # β > 0: the KL term compares with the bare base, from which the (non-zero) adapters move it
  expected_kl = reference_kl(adapted_model(random_b=True), create_model(CONFIG, seed=0),
                             make_batch())
  assert expected_kl > 1e-4, expected_kl
  assert finalize(jax.device_get(stats))["kl"] == pytest.approx(expected_kl, rel=1e-3)


def test_reference_of_a_lora_step_is_the_base_model():
  """With β > 0 the step's reference log-probs are the base's (adapters zeroed)."""
  step, state = lora_step(beta=0.04)
  batch = make_batch()
  base = create_model(CONFIG, seed=0)
  expected, _ = completion_logprobs(base, batch["tokens"], batch["attention_mask"], T)
  prepared = jax.jit(step._prepare)(state, batch)  # the step's own π_old / reference pass
  # two float32 programs (the jitted step's forward through qwix's run_blocks with the adapters
  # zeroed, and the plain model's): log-probs up to ~4.5, where one ulp is 4.8e-7; 1e-6 was two
  # ulp (4.8e-7 seen here, 48 %). The adapted policy as reference is ~1e-2 away.
  np.testing.assert_allclose(np.asarray(prepared["ref_logprobs"]), np.asarray(expected),
                             rtol=0, atol=2e-5)


PROBE_LR = 1e3


def test_lora_gradient_matches_finite_differences():
  """The step's adapter gradient g (read off an SGD update) against central differences of the
  loss along three directions v: (L(θ + t·v) − L(θ − t·v)) / 2t ≈ g·v, for g itself and two
  random directions (float32 loss, so the step t moves the adapters by 1e-2 in norm)."""
  model = adapted_model(random_b=True)
  graphdef, params = nnx.split(model)
  adapters, base = lora.split_adapters(params)
  batch = make_batch()
  old = completion_logprobs(model, batch["tokens"], batch["attention_mask"], T)[0]

  @jax.jit
  def loss(adapters_):
    logprobs = completion_logprobs(nnx.merge(graphdef, base, adapters_), batch["tokens"],
                                   batch["attention_mask"], T)[0]
    return losses.policy_loss(logprobs, old, batch["advantages"], batch["completion_mask"],
                              loss_agg="seq-mean-token-mean")[0]

  step = TrainStep(graphdef, StepConfig(lora=SETTINGS, max_grad_norm=float("inf")))
  step.optimizer = optax.sgd(lambda count: PROBE_LR)
  before = jax.tree.map(lambda x: np.asarray(x, np.float64), adapters)
  state = step.init_state(jax.tree.map(jnp.copy, params))
  state, _ = step(state, batch)
  gradient = jax.tree.map(lambda b, a: (b - np.asarray(a, np.float64)) / PROBE_LR, before,
                          state.params)
  keys = iter(jax.random.split(jax.random.key(7), 2 * len(jax.tree.leaves(adapters))))
  directions = [gradient] + [jax.tree.map(lambda a: np.asarray(jax.random.normal(
      next(keys), a.shape), np.float64), adapters) for _ in range(2)]
  dot = lambda x, y: sum(float(np.sum(a * b)) for a, b in zip(
      jax.tree.leaves(x), jax.tree.leaves(y), strict=True))
  for direction in directions:
    t = 1e-2 / np.sqrt(dot(direction, direction))
    moved = lambda sign, direction=direction, t=t: loss(jax.tree.map(
        lambda a, v: (a + sign * t * v).astype(a.dtype), adapters, direction))
    numeric = (float(moved(1)) - float(moved(-1))) / (2 * t)
    assert numeric == pytest.approx(dot(gradient, direction), rel=2e-2)


@pytest.mark.parametrize("quantization,tolerance", [("int8", 0.02), ("nf4", 0.2)])
def test_qlora_logits_stay_near_the_unquantized_model(quantization, tolerance):
  """Weight-only quantization of the frozen base: logits within `tolerance` × the largest
  logit (documented in docs/lora.md), and still zero-B exact against the quantized base."""
  config = dataclasses.replace(CONFIG, hidden_size=64, intermediate_size=128, head_dim=16)
  settings = dataclasses.replace(SETTINGS, base_quantization=quantization, quantization_tile=16)
  base = create_model(config, seed=0)
  quantized = adapted_model(settings, config=config)
  tokens = make_batch()["tokens"]
  expected = np.asarray(base(tokens))
  actual = np.asarray(quantized(tokens))
  error = np.abs(actual - expected).max() / np.abs(expected).max()
  assert 0 < error < tolerance
  kinds = {str(p[-2]) for p, _ in nnx.to_flat_state(nnx.state(quantized))
           if "qvalue" in map(str, p)}
  assert kinds == {"array"}  # the projections hold quantized values
  # a LoRA step on the quantized base trains the adapters
  graphdef, params = nnx.split(quantized)
  step = TrainStep(graphdef, StepConfig(lora=settings, learning_rate=1e-2))
  state = step.init_state(params)
  before = [np.asarray(x).copy() for x in jax.tree.leaves(state.frozen_params)]
  state, stats = step(state, make_batch())
  assert np.isfinite(float(stats["loss"][0]))
  for b, a in zip(before, jax.tree.leaves(state.frozen_params), strict=True):
    np.testing.assert_array_equal(b, np.asarray(a))


def test_merge_into_base_equals_the_adapted_model():
  model = adapted_model(random_b=True)
  merged = lora.merged_model(model)
  assert not lora.is_adapted(merged)
  tokens = make_batch()["tokens"]
  np.testing.assert_allclose(np.asarray(merged(tokens)), np.asarray(model(tokens)),
                             rtol=0, atol=2e-5)


def test_engine_takes_adapters_alone_and_keeps_its_base():
  from reasoning_rl.sampler import Engine

  model = adapted_model(random_b=True)
  engine = Engine(model, max_concurrent_decodes=2, max_prefill_length=8, max_decode_length=4)
  base_before = [np.asarray(x) for x in jax.tree.leaves(lora.split_adapters(engine.params)[1])]
  new_adapters = jax.tree.map(lambda a: a + 1.0, nnx.state(model, nnx.LoRAParam))
  engine.update_params(new_adapters, version=3, adapters_only=True)
  adapters_now, base_now = lora.split_adapters(engine.params)
  for b, a in zip(base_before, jax.tree.leaves(base_now), strict=True):
    np.testing.assert_array_equal(b, np.asarray(a))
  for want, got in zip(jax.tree.leaves(new_adapters), jax.tree.leaves(adapters_now), strict=True):
    np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
  assert engine.policy_version == 3


# ------------------------------------------------------------------------------ exports


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_merged_and_peft_exports_load_in_transformers_and_peft(family, tmp_path):
  """save_hf(merged=True) loads in transformers, the PEFT adapter in peft on the base: both with
  our adapted model's logits (≤ 1e-4 in float32)."""
  peft = pytest.importorskip("peft")
  import transformers

  from reasoning_rl.errors import CheckpointError
  from reasoning_rl.models import save_hf
  from reasoning_rl.models.checkpoints import load_hf_weights
  from tests.hf_reference import reference_logits, write_tiny_model

  write_tiny_model(family, tmp_path / "base")
  base, _ = load_hf_weights(tmp_path / "base")
  settings = dataclasses.replace(SETTINGS, target_modules=r"layers/0/attn|layers/1/mlp")
  model = lora.apply_lora(base, settings, seed=0)
  adapters = nnx.state(model, nnx.LoRAParam)
  keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(adapters))))
  nnx.update(model, jax.tree.map(
      lambda a: 0.2 * jax.random.normal(next(keys), a.shape, a.dtype), adapters))
  ids = np.random.RandomState(1).randint(0, 97, size=(2, 9))
  mask = np.ones_like(ids)
  mask[1, :3] = 0
  ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  assert np.abs(ours - np.asarray(base(jnp.asarray(ids), jnp.asarray(mask)))).max() > 1e-2

  with pytest.raises(CheckpointError, match="merged=True"):
    save_hf(model, None, tmp_path / "refused")
  save_hf(model, None, tmp_path / "merged", merged=True)
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  for row, ref in enumerate(reference_logits(merged, ids, mask)):
    np.testing.assert_allclose(ours[row][mask[row] > 0], ref, atol=1e-4, rtol=0)

  lora.save_peft(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
  hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
  with_adapter = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
  adapted_names = {n for n, _ in with_adapter.named_modules() if n.endswith("lora_A")}
  assert len(adapted_names) == 4 + 3  # layer 0's q k v o, layer 1's gate up down
  for row, ref in enumerate(reference_logits(with_adapter, ids, mask)):
    np.testing.assert_allclose(ours[row][mask[row] > 0], ref, atol=1e-4, rtol=0)


def test_base_fingerprint_is_the_same_on_any_mesh_and_tells_bases_apart():
  from reasoning_rl import sharding

  state = nnx.state(create_model(CONFIG, seed=0))
  mesh = sharding.make_mesh((2, 2, 2), jax.devices()[:8])
  on_mesh = sharding.reshard(state, sharding.param_shardings(state, mesh))
  assert lora.base_fingerprint(on_mesh) == lora.base_fingerprint(state)
  assert lora.base_fingerprint(nnx.state(create_model(CONFIG, seed=1))) != \
      lora.base_fingerprint(state)
  swapped = jax.tree.map(lambda x: x, state)
  kernel = swapped["layers"][0]["mlp"]["up_proj"]
  kernel.set_value(kernel[...][::-1])  # the same numbers in another order
  assert lora.base_fingerprint(swapped) != lora.base_fingerprint(state)


@pytest.mark.parametrize("quantization,tile,max_error,max_kl", [("int8", 0, 0.05, 0.01),
                                                                ("nf4", 64, 0.4, 0.3)])
def test_qlora_on_smollm2_stays_within_the_documented_tolerance(smollm2, quantization, tile,
                                                                max_error, max_kl):
  """SmolLM2-135M with a quantized base (docs/lora.md): measured 0.033 / 0.0025 nats (int8) and
  0.29 / 0.16 nats (NF4) for the largest logit error relative to the largest logit / the mean
  KL(unquantized ‖ quantized) over a chat prompt's positions."""
  model, tokenizer = smollm2
  text = ("<|im_start|>user\nWhat is 12 times 7? Explain step by step.<|im_end|>\n"
          "<|im_start|>assistant\nTo find 12 times 7, we")
  ids = jnp.asarray([tokenizer.encode(text, add_special_tokens=False)])
  expected = np.asarray(model(ids))[0]
  settings = lora.LoraSettings(rank=16, alpha=32.0, base_quantization=quantization,
                               quantization_tile=tile)
  actual = np.asarray(lora.apply_lora(model, settings)(ids))[0]
  error = np.abs(actual - expected).max() / np.abs(expected).max()
  log_p, log_q = jax.nn.log_softmax(expected), jax.nn.log_softmax(actual)
  kl = float(jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)))
  assert 0 < error < max_error and 0 < kl < max_kl


def test_sharded_lora_step_with_micro_batches_equals_single_device():
  """The same fused step on a data x fsdp x tensor mesh with 2 micro-batches: the base keeps the
  partition rules' placement, the adapters are replicated, and the update equals one device's."""
  from reasoning_rl import sharding

  batch = make_batch()

  def one_step(mesh, micro_batches):
    graphdef, params = nnx.split(adapted_model(random_b=True))
    step = TrainStep(graphdef, StepConfig(lora=SETTINGS, beta=0.04, learning_rate=1e-2,
                                          num_micro_batches=micro_batches), mesh)
    state, stats = step(step.init_state(params), batch)
    return state, finalize(jax.device_get(stats))

  single, single_stats = one_step(None, 1)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sharded, sharded_stats = one_step(mesh, 2)
  for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
  assert single_stats["loss"] == pytest.approx(sharded_stats["loss"], abs=1e-5)
  q_proj = sharded.frozen_params["layers"][0]["attn"]["q_proj"][...]
  assert q_proj.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  adapter = sharded.params["layers"][0]["attn"]["q_proj_lora_a"][...]
  assert adapter.sharding.is_fully_replicated


def test_a_packed_lora_step_applies_the_padded_steps_update():
  """Packed rows go through qwix's intercepted `run_blocks` with their segment ids: adapters and
  the base-as-reference see each sequence alone, as in the padded step."""
  from reasoning_rl.rl import packing
  from tests.support.packing import ragged_batch

  batch = ragged_batch()
  packed, _ = packing.pack_batch(batch, num_micro_batches=2, head_chunk=8)
  assert packed["segment_ids"].max() > 1
  sgd = optax.sgd(lambda count: 1.0)
  updates = []
  for layout in (batch, packed):
    step, state = lora_step(beta=0.04, optimizer=sgd, num_micro_batches=2, logprob_chunk=8)
    before = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.params)]
    state, _ = step(state, layout)
    updates.append([np.asarray(x, np.float64) - b
                    for x, b in zip(jax.tree.leaves(state.params), before, strict=True)])
  scale = max(np.abs(u).max() for u in updates[0])
  for packed_update, padded_update in zip(*updates[::-1], strict=True):
    np.testing.assert_allclose(packed_update, padded_update, rtol=0, atol=1e-4 * scale)
