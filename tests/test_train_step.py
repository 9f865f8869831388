"""The fused training step: chunked log-probs, sharding, micro-batching, μ, skips, learning.

Equivalences (micro-batches, sharding, remat) compare the GRADIENT the step applies, not the
parameters after one AdamW update: Adam's first update is lr·g/(|g| + ε) ≈ lr·sign(g), and AdamW
is invariant to rescaling the gradient, so a wrong gradient magnitude would pass unseen. With its
optimizer swapped for `gradient_probe` (plain SGD), the step's update is exactly −lr·gradient;
both sides are also checked against a gradient computed here from public pieces
(`completion_logprobs` + `losses.policy_loss`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from reasoning_rl import sharding
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import KVCache
from reasoning_rl.rl import advantages as advantages_lib
from reasoning_rl.rl import losses
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.rl.optimizer import applied_updates
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig
from tests.support.steps import (
    P, T, assert_same_gradient, flat_params, fresh_params, make_batch, reference_kl,
    rolled_updates, run_step, step_gradient)


def reference_gradient(config, batch, *, ref_seed=None):
  """The gradient of the μ = 1 GRPO loss over the whole batch, from public pieces."""
  graphdef, params = fresh_params(0)
  logprobs_of = lambda model: completion_logprobs(  # noqa: E731
      model, batch["tokens"], batch["attention_mask"], T)[0]
  ref = logprobs_of(nnx.merge(*fresh_params(ref_seed))) if ref_seed is not None else None

  def loss(p):
    logprobs = logprobs_of(nnx.merge(graphdef, p))
    return losses.policy_loss(logprobs, jax.lax.stop_gradient(logprobs), batch["advantages"],
                              batch["completion_mask"], ref_logprobs=ref, beta=config.beta,
                              loss_agg=config.loss_agg)[0]

  return [np.asarray(g, np.float64) for g in jax.tree.leaves(jax.grad(loss)(params))]


def test_chunked_logprobs_equal_full_log_softmax():
  graphdef, params = fresh_params()
  model = nnx.merge(graphdef, params)
  batch = make_batch()
  logprobs, entropy = completion_logprobs(model, batch["tokens"], batch["attention_mask"], T,
                                          chunk_size=4)  # 6 steps in chunks of 4: padding path
  logits = np.asarray(model(batch["tokens"], batch["attention_mask"]), np.float64)
  log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  targets = np.asarray(batch["tokens"])[:, P:]
  expected = np.take_along_axis(log_softmax[:, P - 1:-1], targets[..., None], -1)[..., 0]
  expected_entropy = -(np.exp(log_softmax) * log_softmax).sum(-1)[:, P - 1:-1]
  np.testing.assert_allclose(np.asarray(logprobs), expected, atol=1e-5)
  np.testing.assert_allclose(np.asarray(entropy), expected_entropy, atol=1e-5)


def test_four_micro_batches_equal_one_full_batch():
  batch = make_batch()
  config = dict(learning_rate=1e-3, beta=0.05, loss_agg="seq-mean-token-mean")
  full, full_stats = step_gradient(StepConfig(**config), batch, ref_seed=1)
  micro, micro_stats = step_gradient(StepConfig(**config, num_micro_batches=4), batch, ref_seed=1)
  assert_same_gradient(micro, full)
  assert_same_gradient(full, reference_gradient(StepConfig(**config), batch, ref_seed=1))
  for key in ("loss", "kl", "pg_loss", "entropy", "grad_norm"):
    assert full_stats[key] == pytest.approx(micro_stats[key], abs=1e-5), key
  expected_kl = reference_kl(nnx.merge(*fresh_params(0)), nnx.merge(*fresh_params(1)), batch)
  assert expected_kl > 0.01  # the reference (another seed) really differs
  assert full_stats["kl"] == pytest.approx(expected_kl, rel=1e-4)


def test_sharded_step_equals_single_device():
  batch = make_batch()
  config = StepConfig(learning_rate=1e-3, beta=0.05, loss_agg="token-mean")
  single, single_stats = step_gradient(config, batch, ref_seed=1)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  sharded, sharded_stats = step_gradient(config, batch, mesh=mesh, ref_seed=1)
  assert_same_gradient(sharded, single)
  assert_same_gradient(single, reference_gradient(config, batch, ref_seed=1))
  assert single_stats["loss"] == pytest.approx(sharded_stats["loss"], abs=1e-5)
  # The AdamW step still runs on the mesh and keeps the partition rules' placement.
  state, _ = run_step(config, batch, mesh=mesh, ref_seed=1)
  q_proj = state.params["layers"][0]["attn"]["q_proj"][...]
  assert q_proj.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)


def test_beta_zero_never_builds_a_reference():
  state, stats = run_step(StepConfig(learning_rate=1e-3), make_batch())
  assert state.ref_params is None and "kl" not in stats
  # μ = 1: π_old is the policy itself, so every ratio is exactly 1 and nothing is clipped.
  assert stats["ratio/min"] == stats["ratio/max"] == 1.0 and stats["clip_frac"] == 0.0


def test_inner_updates_reuse_old_logprobs():
  batch = make_batch()
  state, stats = run_step(StepConfig(learning_rate=5e-2, num_iterations=3), batch,
                          optimizer=optax.sgd(lambda count: 1.0))
  assert int(state.step) == 1
  # later updates see π ≠ π_old, π_old being the batch's first forward: the same three SGD
  # updates rolled by hand give every ratio statistic (a π_old recomputed per update: ratio 1)
  expected = rolled_updates(batch, 3, 1.0, loss_agg=StepConfig().loss_agg)
  assert expected["ratio/max"] > 1.5 and expected["ratio/min"] < 0.5, expected
  for key in ("ratio/min", "ratio/mean", "ratio/max", "approx_kl", "loss"):
    assert stats[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
  assert stats["clip_frac"] == expected["clip_frac"]


def test_non_finite_loss_skips_the_update():
  batch = make_batch()
  batch["advantages"] = batch["advantages"].at[0].set(jnp.nan)
  _, params_before = fresh_params()
  before = [np.asarray(x) for x in jax.tree.leaves(params_before)]
  state, stats = run_step(StepConfig(learning_rate=1e-2), batch)
  assert int(state.skipped_updates) == 1 and stats["skipped_update"] == 1.0
  for a, b in zip(before, flat_params(state)):
    np.testing.assert_array_equal(a, b)


def test_an_update_without_completion_tokens_moves_nothing():
  """After a real update AdamW has momentum; a batch with no completion token (dynamic sampling
  came back empty) would still move every weight along it. It is not applied, nor skipped."""
  graphdef, params = fresh_params()
  step = TrainStep(graphdef, StepConfig(learning_rate=1e-2))
  state, _ = step(step.init_state(params), make_batch())
  after_first = [np.asarray(x) for x in flat_params(state)]
  count = int(applied_updates(state.opt_state))
  empty = make_batch(1)
  empty["completion_mask"] = jnp.zeros_like(empty["completion_mask"])
  state, stats = step(state, empty)
  for a, b in zip(after_first, flat_params(state)):
    np.testing.assert_array_equal(a, b)
  assert int(applied_updates(state.opt_state)) == count == 1
  assert int(state.skipped_updates) == 0 and float(stats["skipped_update"][0]) == 0.0
  state, _ = step(state, make_batch(1))  # a batch with tokens moves them again
  assert any((a != b).any() for a, b in zip(after_first, flat_params(state)))


# ------------------------------------------------------------------------------ learning

LEARN_CONFIG = ModelConfig(model_type="llama", vocab_size=16, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                           tie_word_embeddings=True)
TARGET_TOKEN = 3


def sample(graphdef, params, prompts, length, key):
  """Plain temperature-1 sampling through the KV cache (independent of the sampler package)."""
  model = nnx.merge(graphdef, params)
  batch, prompt_len = prompts.shape
  cache = KVCache.init(model.config, batch, prompt_len + length)
  positions = jnp.broadcast_to(jnp.arange(prompt_len), prompts.shape)
  logits, cache = model.decode(prompts, positions, cache, jnp.zeros(batch, jnp.int32))
  tokens = []
  last = logits[:, -1]
  for t in range(length):
    key, sub = jax.random.split(key)
    token = jax.random.categorical(sub, last)
    tokens.append(token)
    position = prompt_len + t
    logits, cache = model.decode(token[:, None], jnp.full((batch, 1), position), cache,
                                 jnp.full(batch, position, jnp.int32))
    last = logits[:, -1]
  return jnp.stack(tokens, axis=1)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_rl_raises_a_programmatic_reward(algorithm):
  """Reward = share of completion tokens equal to TARGET_TOKEN; 30 steps must raise it."""
  num_prompts, group, prompt_len, length = 4, 8, 4, 8
  graphdef, params = fresh_params(config=LEARN_CONFIG)
  config = StepConfig(algorithm=algorithm, learning_rate=3e-3, total_steps=30,
                      loss_agg="token-mean", max_grad_norm=1.0, gamma=1.0, gae_lambda=1.0)
  step = TrainStep(graphdef, config)
  state = step.init_state(params)
  sample_fn = jax.jit(lambda p, prompts, key: sample(graphdef, p, prompts, length, key))
  prompts = jnp.asarray(np.random.RandomState(0).randint(4, 16, (num_prompts, prompt_len)))
  prompts = jnp.repeat(prompts, group, axis=0)
  key = jax.random.key(0)
  mean_rewards = []
  for _ in range(30):
    key, sub = jax.random.split(key)
    completions = sample_fn(state.params, prompts, sub)
    rewards = jnp.mean(completions == TARGET_TOKEN, axis=1).astype(jnp.float32)
    mean_rewards.append(float(rewards.mean()))
    batch = dict(tokens=jnp.concatenate([prompts, completions], axis=1),
                 attention_mask=jnp.ones((len(prompts), prompt_len + length), jnp.int32),
                 completion_mask=jnp.ones((len(prompts), length), jnp.int32))
    if algorithm == "grpo":
      batch["advantages"] = jnp.asarray(advantages_lib.group_advantages(
          rewards.reshape(num_prompts, group)).reshape(-1), jnp.float32)
    else:
      batch["rewards"] = rewards
    state, _ = step(state, batch)
  start, end = np.mean(mean_rewards[:3]), np.mean(mean_rewards[-3:])
  assert start < 0.15  # chance is 1/16 for a random model
  assert end > start + 0.25, (algorithm, mean_rewards)


def test_remat_changes_nothing_but_memory():
  batch = make_batch()
  config = dict(learning_rate=1e-3, beta=0.05)
  plain, plain_stats = step_gradient(StepConfig(**config), batch, ref_seed=1)
  remat, remat_stats = step_gradient(StepConfig(**config, remat=True), batch, ref_seed=1)
  # remat recomputes the forward with a different fusion: the gradients differ in the last bits.
  assert_same_gradient(remat, plain)
  assert_same_gradient(remat, reference_gradient(StepConfig(**config), batch, ref_seed=1))
  assert plain_stats["loss"] == pytest.approx(remat_stats["loss"], abs=1e-6)
