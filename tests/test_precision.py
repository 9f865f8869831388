"""Mixed precision (reasoning_rl/precision.py): float32 master weights under bfloat16 compute keep
R1-Zero-sized updates that bfloat16 weights round away; float32 gradient sums; the sampler gets
weights in the compute dtype; the config field and its warning. The runs accumulate two
micro-batches, so the float32 gradient carry meets bfloat16 gradients in the pure-bf16 run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reasoning_rl import config as config_lib
from reasoning_rl import precision
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.transformer import create_model
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig
from tests.support.configs import debug_config
from tests.support.steps import CONFIG, make_batch


LR = 1e-6  # DeepSeek-R1-Zero's learning rate
STEPS = 2


def train(dtype: str, weight_dtype: str, *, micro_batches: int = 2):
  """(weights before, weights after STEPS updates) as float32 leaves, and the final state."""
  model = create_model(CONFIG, seed=0, dtype=dtype, param_dtype=weight_dtype)
  graphdef, params = nnx.split(model)
  before = [np.asarray(x, np.float32) for x in jax.tree.leaves(params)]
  step = TrainStep(graphdef, StepConfig(learning_rate=LR, warmup_steps=0, total_steps=100,
                                        final_lr_fraction=1.0, num_micro_batches=micro_batches,
                                        compute_dtype=dtype), None)
  state = step.init_state(params)
  for seed in range(STEPS):
    state, _ = step(state, make_batch(seed))
  after = [np.asarray(x, np.float32) for x in jax.tree.leaves(state.params)]
  return before, after, state, step


def moved(before, after) -> tuple[float, np.ndarray]:
  """(fraction of weights that changed, the change as one flat float32 vector)."""
  delta = np.concatenate([(a - b).ravel() for a, b in zip(after, before)])
  return float(np.mean(delta != 0)), delta


@pytest.fixture(scope="module")
def runs():
  return {name: train(*dtypes) for name, dtypes in {
      "float32": ("float32", "float32"), "mixed": ("bfloat16", "float32"),
      "pure_bf16": ("bfloat16", "bfloat16")}.items()}


def test_mixed_precision_keeps_the_updates_that_bf16_weights_lose(runs):
  share_f32, delta_f32 = moved(*runs["float32"][:2])
  share_mixed, delta_mixed = moved(*runs["mixed"][:2])
  share_pure, delta_pure = moved(*runs["pure_bf16"][:2])
  # every weight with a gradient moves (embedding rows of tokens the batches lack do not)
  assert share_f32 > 0.95 and abs(share_mixed - share_f32) < 0.005
  # the same update as float32 up to bf16 compute's gradient noise (Adam's steps are ~lr·sign(g))
  cosine = delta_mixed @ delta_f32 / (np.linalg.norm(delta_mixed) * np.linalg.norm(delta_f32))
  assert cosine > 0.9
  assert 0.8 < np.linalg.norm(delta_mixed) / np.linalg.norm(delta_f32) < 1.25
  # pure bf16 weights: almost every update rounded away (N(0, 0.02) weights: ~2 % survive one
  # 1e-6 step; the norms and the zero-initialised biases keep some)
  assert share_pure < 0.15
  assert np.linalg.norm(delta_pure) < 0.5 * np.linalg.norm(delta_f32)


def test_master_weights_and_moments_stay_float32_and_the_sampler_gets_bf16(runs):
  _, _, state, step = runs["mixed"]
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  floats = [x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}
  weights = step.sampler_weights(state)
  assert {x.dtype for x in jax.tree.leaves(weights)} == {jnp.dtype(jnp.bfloat16)}
  for sent, master in zip(jax.tree.leaves(weights), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(sent), np.asarray(master.astype(jnp.bfloat16)))
  # float32 compute: the sampler is handed the parameters themselves (no copy)
  _, _, state32, step32 = runs["float32"]
  assert jax.tree.leaves(step32.sampler_weights(state32))[0] is jax.tree.leaves(state32.params)[0]


def test_pure_bf16_state_keeps_its_dtypes_across_updates(runs):
  _, _, state, _ = runs["pure_bf16"]
  floats = [x for x in jax.tree.leaves((state.params, state.opt_state))
            if jnp.issubdtype(x.dtype, jnp.floating)]
  assert {x.dtype for x in floats} == {jnp.dtype(jnp.bfloat16)}


def test_lost_update_fraction_matches_bf16_rounding():
  weights = np.random.default_rng(0).normal(0.0, 0.02, 100_000).astype(np.float32)
  lost = precision.lost_update_fraction(weights, 1e-6, "bfloat16")
  assert 0.97 < lost < 0.99  # ~1.9 % of weights change
  assert 0.65 < precision.lost_update_fraction(weights, 2e-5, "bfloat16") < 0.75  # ~30 % change
  assert precision.lost_update_fraction(weights, 1e-6, "float32") == 0.0
  assert precision.pure_low_precision_warning("float32", 1e-6) is None
  assert "98%" in precision.pure_low_precision_warning("bfloat16", 1e-6)


def test_cast_floating_leaves_integers_and_matching_leaves_alone():
  tree = {"w": jnp.ones((2,), jnp.float32), "q": jnp.ones((2,), jnp.int8),
          "b": jnp.ones((2,), jnp.bfloat16), "s": jax.ShapeDtypeStruct((3,), jnp.float32)}
  cast = precision.cast_floating(tree, "bfloat16")
  assert cast["w"].dtype == jnp.bfloat16 and cast["q"].dtype == jnp.int8
  assert cast["b"] is tree["b"] and cast["s"].dtype == jnp.bfloat16 and cast["s"].shape == (3,)


def test_config_weight_dtype_field():
  assert config_lib.base_config().model.weight_dtype == "float32"
  config_lib.validate(debug_config(**{"model.dtype": "bfloat16",
                                      "model.weight_dtype": "bfloat16"}), num_devices=8)
  for dtypes in ({"model.weight_dtype": "float16"},
                 {"model.weight_dtype": "bfloat16"}):  # with float32 compute: refused
    with pytest.raises(ConfigError, match="model.weight_dtype"):
      config_lib.validate(debug_config(**dtypes), num_devices=8)


def test_bf16_run_trains_checkpoints_float32_masters_and_loads_them_for_bf16_sampling(tmp_path):
  """launch/train.py with bfloat16 compute: the run (sampler, KL reference, step) works, its
  checkpoint holds float32 master weights, and loading it for bfloat16 sampling casts them."""
  import json
  import subprocess
  import sys

  from reasoning_rl.run_checkpoint import load_model
  from tests.conftest import REPO

  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, "launch/train.py", "--config=configs/debug_cpu.py",
       f"--config.workdir={workdir}", "--config.total_steps=2", "--config.beta=0.04",
       "--config.model.dtype=bfloat16", "--config.checkpoint.every_steps=2",
       "--config.eval.num_examples=4", "--config.logging.progress_bar=False"],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2]
  assert all(np.isfinite(r["loss"]) and np.isfinite(r["kl"]) for r in rows)
  master, _ = load_model(workdir, dtype="bfloat16", weight_dtype="float32")
  sampled, _ = load_model(workdir, dtype="bfloat16")
  masters = jax.tree.leaves(nnx.state(master))
  assert {x.dtype for x in masters} == {jnp.dtype(jnp.float32)}
  for low, high in zip(jax.tree.leaves(nnx.state(sampled)), masters):
    assert low.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(low), np.asarray(high.astype(jnp.bfloat16)))


def test_lora_adapters_are_float32_masters_cast_to_the_compute_dtype():
  """bfloat16 base + LoRA: the adapters train in float32 (small updates kept), the forward pass
  stays in bfloat16 (qwix's adapter product would promote the activations to float32), and the
  sampler receives the adapters in bfloat16."""
  from reasoning_rl import lora

  settings = lora.LoraSettings(rank=4)
  base = create_model(CONFIG, seed=0, dtype="bfloat16", param_dtype="bfloat16")
  graphdef, params = nnx.split(lora.apply_lora(base, settings))
  adapters, _ = lora.split_adapters(params)
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
  step = TrainStep(graphdef, StepConfig(learning_rate=LR, warmup_steps=0, total_steps=100,
                                        lora=settings, compute_dtype="bfloat16"), None)
  state = step.init_state(params)
  a_before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
  for seed in range(2):  # B starts at zero: A has a gradient from the second step on
    state, _ = step(state, make_batch(seed))
  a_after = [np.asarray(x) for x in jax.tree.leaves(state.params)]
  assert {x.dtype for x in a_after} == {np.dtype(np.float32)}
  # A (He-uniform, |a| ~ 0.1) moves by ~1e-6: kept in float32, lost in bfloat16
  share_moved = np.mean(np.concatenate([(a != b).ravel() for a, b in zip(a_after, a_before)]))
  assert share_moved > 0.9
  model = step.forward.model(state.params, state.frozen_params)
  hidden = model.hidden_states(make_batch(0)["tokens"])
  assert hidden.dtype == jnp.bfloat16
  sent = step.sampler_weights(state)
  assert {x.dtype for x in jax.tree.leaves(sent)} == {jnp.dtype(jnp.bfloat16)}
