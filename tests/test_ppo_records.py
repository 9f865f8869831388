"""PPO's rollout records show the advantages its loss used: the step hands back the whitened
per-token GAE advantages (Schulman et al. 2016) it computed from π_old's values, in the padded and
in the packed layout, and the records hold them; GRPO's records keep their exact form."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reasoning_rl import build
from reasoning_rl.loop import telemetry
from reasoning_rl.loop.rl_stage import RLStage
from reasoning_rl.loop.rollouts import RolloutCollector
from reasoning_rl.loop.state import LoopState, SampledBatch
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model
from reasoning_rl.rl import packing
from reasoning_rl.rl.rollout_columns import Ragged
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig
from tests.conftest import REPO
from tests.support import rollouts

CONFIG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
B, P, T = 8, 5, 6
GAMMA, LAM = 0.9, 0.8


def numpy_gae_whitened(rewards, values, mask, *, gamma, lam, eps=1e-8):
  """GAE over each row's valid tokens with the sequence reward on the last one (V after it 0),
  then whitened over every valid token of the batch: written out loop by loop, independently of
  `rl.value`."""
  rewards, values, mask = (np.asarray(a, np.float64) for a in (rewards, values, mask))
  advantages = np.zeros_like(values)
  for b in range(values.shape[0]):
    steps = np.flatnonzero(mask[b])
    next_value = next_advantage = 0.0
    for t in steps[::-1]:
      reward = rewards[b] if t == steps[-1] else 0.0
      delta = reward + gamma * next_value - values[b, t]
      advantages[b, t] = delta + gamma * lam * next_advantage
      next_value, next_advantage = values[b, t], advantages[b, t]
  valid = mask > 0
  mean = advantages[valid].mean()
  std = np.sqrt(((advantages[valid] - mean) ** 2).mean() + eps)
  return np.where(valid, (advantages - mean) / std, 0.0)


def make_batch(seed=0):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, CONFIG.vocab_size, (B, P + T)).astype(np.int32)
  attention = np.ones((B, P + T), np.int32)
  attention[:2, :2] = 0  # left-padded prompts
  completion = np.ones((B, T), np.int32)
  completion[3, 4:] = 0  # short completions (right padding)
  attention[3, P + 4:] = 0
  completion[6, 1:] = 0
  attention[6, P + 1:] = 0
  return dict(tokens=tokens, attention_mask=attention, completion_mask=completion,
              advantages=np.zeros(B, np.float32),
              rewards=rng.randn(B).astype(np.float32))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_ppo_step_returns_the_whitened_gae_advantages_of_its_old_values(packed):
  config = StepConfig(algorithm="ppo", gamma=GAMMA, gae_lambda=LAM, num_mini_batches=2,
                      packing=packed, learning_rate=1e-2)
  graphdef, params = nnx.split(create_model(CONFIG, seed=0))
  step = TrainStep(graphdef, config)
  state = step.init_state(params)
  # A value head that predicts something (it starts at zero): GAE then depends on the values.
  rng = np.random.RandomState(1)
  state = state.replace(value_head={
      "kernel": jnp.asarray(rng.randn(CONFIG.hidden_size).astype(np.float32) * 0.3),
      "bias": jnp.asarray(0.25, jnp.float32)})
  batch = make_batch()
  # π_old's values: the parameters the batch arrives with (the state is donated by the step).
  policy_outputs = step.forward.policy_outputs
  _, _, old_values = policy_outputs(state.params, state.value_head,
                                    {k: jnp.asarray(v) for k, v in batch.items()})
  old_values = np.asarray(old_values)
  assert np.abs(old_values).max() > 0.1
  expected = numpy_gae_whitened(batch["rewards"], old_values, batch["completion_mask"],
                                gamma=GAMMA, lam=LAM)

  device_batch, layout = step.host_batch_with_layout(batch)
  assert (layout is not None) == packed == packing.is_packed(device_batch)
  state, stats, outputs = step.call_with_outputs(state, device_batch)
  got = np.asarray(jax.device_get(outputs["token_advantages"]))
  if packed:
    assert got.shape[1:] == (2, T)  # [slots, S = M·m slices, T]
    got = packing.unpack_sequences(got, layout, B)
  assert got.shape == (B, T)
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
  assert (got[batch["completion_mask"] == 0] == 0).all()
  assert np.isfinite(float(jax.device_get(stats["loss"][0])))


def test_grpo_steps_return_no_outputs():
  graphdef, params = nnx.split(create_model(CONFIG, seed=0))
  step = TrainStep(graphdef, StepConfig(algorithm="grpo"))
  batch = make_batch()
  batch["advantages"] = np.random.RandomState(2).randn(B).astype(np.float32)
  batch.pop("rewards")
  state, stats, outputs = step.call_with_outputs(step.init_state(params), batch)
  assert outputs == {}
  assert "loss" in stats and int(state.step) == 1


def _sampled(rewards_per_group, lengths, advantages=None):
  record = rollouts.record(*[
      rollouts.group(rewards, [[3] * n for n in lengths[g]], position=10 + g, prompt=[1, 2],
                     responses=tuple("r" * n for n in lengths[g]))
      for g, rewards in enumerate(rewards_per_group)])
  if advantages is not None:
    record = record.with_advantages(advantages)
  return SampledBatch(rollouts=record, outcome={}, groups_sampled=record.num_groups, scoring={},
                      sample_s=0.0, verify_s=0.0, policy_version=3)


_RECORD_KWARGS = dict(
    examples=lambda i: types.SimpleNamespace(prompt="q", answer="1", task="math", metadata={},
                                             tests=()),
    decode=lambda ids: "p", verifier_version="v",
    sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 4, "seed": 0})


def test_ppo_records_hold_the_token_advantages_and_their_mean():
  sampled = _sampled([[1.0, 0.0]], [[3, 1]])
  token_advantages = Ragged.from_rows([[0.123456, -1.5, 2.0], [-0.75]], np.float32)
  sampled = dataclasses.replace(
      sampled, rollouts=sampled.rollouts.with_token_advantages(token_advantages))
  records = telemetry.rollout_records(5, sampled, **_RECORD_KWARGS)
  assert [r["token_advantages"] for r in records] == [[0.1235, -1.5, 2.0], [-0.75]]
  assert records[0]["advantage"] == pytest.approx((0.123456 - 1.5 + 2.0) / 3, abs=1e-7)
  assert records[1]["advantage"] == -0.75
  json.dumps(records)  # plain JSON values


def test_grpo_records_keep_their_exact_form():
  sampled = _sampled([[1.0, 0.0]], [[3, 1]], advantages=[0.5, -0.5])
  records = telemetry.rollout_records(5, sampled, **_RECORD_KWARGS)
  # format_version 1's keys, in their order (the writer dumps them in this order)
  assert [list(r) for r in records] == [[
      "step", "prompt_id", "group_id", "sample_index", "prompt", "task_prompt", "completion",
      "reward", "advantage", "num_tokens", "truncated", "policy_version", "verifier_version",
      "scoring_status", "sampling", "ground_truth", "task", "metadata", "tests",
      "reward/correct"]] * 2
  assert records[0] == {
      "step": 5, "prompt_id": 10, "group_id": 0, "sample_index": 0, "prompt": "p",
      "task_prompt": "q", "completion": "rrr", "reward": 1.0, "advantage": 0.5, "num_tokens": 3,
      "truncated": False, "policy_version": 3, "verifier_version": "v", "scoring_status": "ok",
      "sampling": _RECORD_KWARGS["sampling"], "ground_truth": "1", "task": "math",
      "metadata": {}, "tests": [], "reward/correct": 1.0}


def _debug_config():
  spec = importlib.util.spec_from_file_location("debug_cpu", REPO / "configs" / "debug_cpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_the_rl_stage_records_what_ppo_trained_on_from_packed_batches():
  config = _debug_config()
  config.workdir = "/nonexistent"  # nothing is written: the stage is driven directly
  config.algo.name = "ppo"
  config.algo.packing = True
  config.algo.gamma, config.algo.gae_lambda = GAMMA, LAM
  run = build.build(config)
  r = config.rollout
  collector = RolloutCollector(run.backend, run.tokenizer, run.template, run.scorer,
                               num_samples=r.num_samples, max_new_tokens=r.max_new_tokens,
                               stop_strings=r.stop_strings, sampling=run.sampling, seed=config.seed)
  stage = RLStage(run, collector, staleness=0, with_sampler_logprobs=False)
  try:
    stage.step(1, run.state, LoopState(guards=None))
  finally:
    run.scorer.close()
  records = stage.rollout_records(1)
  assert len(records) == r.num_prompts * r.num_samples
  # Step 1's value head is the zero-initialised one: π_old's values are exactly 0.
  lengths = [min(rec["num_tokens"], r.max_new_tokens) for rec in records]
  mask = np.arange(r.max_new_tokens)[None, :] < np.array(lengths)[:, None]
  expected = numpy_gae_whitened([rec["reward"] for rec in records],
                                np.zeros(mask.shape), mask, gamma=GAMMA, lam=LAM)
  assert len(set(lengths)) > 1 and np.ptp([rec["reward"] for rec in records]) > 0
  for rec, row, n in zip(records, expected, lengths):
    assert len(rec["token_advantages"]) == n
    np.testing.assert_allclose(rec["token_advantages"], row[:n], atol=2e-4)
    assert rec["advantage"] == pytest.approx(row[:n].mean(), abs=1e-4)
