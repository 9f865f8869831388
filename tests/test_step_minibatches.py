"""The step at scale: frozen forwards one micro-batch at a time; μ epochs × mini-batches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from reasoning_rl import sharding
from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import losses
from reasoning_rl.rl import value as value_lib
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.rl.optimizer import applied_updates, learning_rate_schedule
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig
from tests.support.runs import LOSS_ABS
from tests.support.steps import B, T, flat_params, fresh_params, make_batch, rolled_epochs, run_step


def sgd():
  """Plain SGD (through a schedule, so the step's learning-rate stat finds its count): parameters
  move by lr × gradient, so a wrong gradient magnitude shows, which AdamW's update would hide."""
  return optax.sgd(lambda count: 0.05)


def ppo_batch():
  batch = make_batch()
  del batch["advantages"]
  return dict(batch, rewards=jnp.asarray(np.random.RandomState(3).randn(B), jnp.float32))


def ppo_state(step):
  """Initial state with a non-zero value head (the initial one is all zeros)."""
  state = step.init_state(fresh_params(0)[1], ref_params=fresh_params(1)[1])
  rng = np.random.RandomState(4)
  head = {"kernel": jnp.asarray(rng.randn(*state.value_head["kernel"].shape), jnp.float32),
          "bias": jnp.asarray(0.3, jnp.float32)}
  return state.replace(value_head=head)


def whole_batch_prepare(batch, head, gamma, lam):
  """Every frozen forward on the whole batch at once, as the step did before micro-batching."""
  graphdef, params = fresh_params(0)
  old, _, hidden = completion_logprobs(nnx.merge(graphdef, params), batch["tokens"],
                                       batch["attention_mask"], T, return_hidden=True)
  ref, _ = completion_logprobs(nnx.merge(*fresh_params(1)), batch["tokens"],
                               batch["attention_mask"], T)
  values = hidden @ head["kernel"] + head["bias"]
  mask = batch["completion_mask"]
  advantages, returns = value_lib.gae_advantages(
      value_lib.sequence_rewards_to_tokens(batch["rewards"], mask), values, mask, gamma=gamma,
      lam=lam)
  return dict(old_logprobs=old, ref_logprobs=ref, old_values=values, returns=returns,
              advantages=value_lib.masked_whiten(advantages, mask))


def intermediate_shapes(jaxpr):
  """Shapes of every value computed in a jaxpr, nested jaxprs (scan, remat, …) included."""
  for eqn in jaxpr.eqns:
    yield from (v.aval.shape for v in eqn.outvars)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from intermediate_shapes(sub)


@pytest.mark.parametrize("micro, mini", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_per_micro_batch_prepare_equals_whole_batch(micro, mini):
  config = StepConfig(algorithm="ppo", beta=0.05, num_micro_batches=micro, num_mini_batches=mini,
                      gamma=0.9, gae_lambda=0.8)
  step = TrainStep(fresh_params(0)[0], config)
  state, batch = ppo_state(step), ppo_batch()
  prepared = jax.jit(step._prepare)(state, batch)
  expected = whole_batch_prepare(batch, state.value_head, gamma=0.9, lam=0.8)
  valid = np.asarray(batch["completion_mask"]) > 0
  for key, want in expected.items():
    np.testing.assert_allclose(np.asarray(prepared[key])[valid], np.asarray(want)[valid],
                               atol=2e-5, err_msg=key)
  # Peak activations are one slice's: no [B, ...] array of rank ≥ 3 (hidden states, attention
  # scores) is ever formed when the batch is split.
  jaxpr = jax.make_jaxpr(step._prepare)(state, batch).jaxpr
  whole_batch_activations = [s for s in intermediate_shapes(jaxpr) if len(s) >= 3 and s[0] == B]
  assert bool(whole_batch_activations) == (micro * mini == 1), whole_batch_activations


def test_two_mini_batches_equal_two_sequential_updates():
  """μ = 1, M = 2 (each with 2 micro-batches) against a hand-rolled optax loop over the rows
  0, 2, 4, 6 then 1, 3, 5, 7, each slice a full update with its own token-mean normalizer."""
  config = StepConfig(learning_rate=1e-2, beta=0.05, loss_agg="token-mean",
                      num_mini_batches=2, num_micro_batches=2)
  batch = make_batch()
  state, stats = run_step(config, batch, ref_seed=1, optimizer=sgd())

  graphdef, params = fresh_params(0)
  logprobs_of = lambda p, rows: completion_logprobs(  # noqa: E731
      nnx.merge(graphdef, p), batch["tokens"][rows], batch["attention_mask"][rows], T)[0]
  everything = np.arange(B)
  old = logprobs_of(params, everything)  # π_old: the parameters the batch arrived with
  ref = completion_logprobs(nnx.merge(*fresh_params(1)), batch["tokens"],
                            batch["attention_mask"], T)[0]

  def loss_fn(trainable, rows):
    loss, _ = losses.policy_loss(
        logprobs_of(trainable["policy"], rows), old[rows], batch["advantages"][rows],
        batch["completion_mask"][rows], ref_logprobs=ref[rows], beta=0.05,
        loss_agg="token-mean")  # normalizers of `rows` alone
    return loss

  optimizer = sgd()
  trainable = {"policy": params}
  opt_state = optimizer.init(trainable)
  slice_losses = []
  for rows in (everything[0::2], everything[1::2]):
    loss, grads = jax.value_and_grad(loss_fn)(trainable, rows)
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    slice_losses.append(float(loss))

  for a, b in zip(flat_params(state), jax.tree.leaves(trainable["policy"])):
    np.testing.assert_allclose(a, np.asarray(b), atol=1e-5)
  assert stats["loss"] == pytest.approx(np.mean(slice_losses), abs=1e-5)
  assert slice_losses[0] != pytest.approx(slice_losses[1], abs=1e-3)  # the mean is informative
  assert int(applied_updates(state.opt_state)) == 2 and int(state.step) == 1


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_epochs_times_mini_batches_make_four_updates_that_clip(algorithm):
  config = StepConfig(algorithm=algorithm, learning_rate=5e-2, num_iterations=2,
                      num_mini_batches=2, warmup_steps=2, total_steps=10)
  batch = ppo_batch() if algorithm == "ppo" else make_batch()
  state, stats = run_step(config, batch)
  assert int(state.step) == 1  # RL steps
  assert int(applied_updates(state.opt_state)) == 4  # optimizer updates, the schedule's index
  adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu"))
          if hasattr(s, "mu")]
  assert [int(s.count) for s in adam] == [4]
  # Warm-up of 2 RL steps = 8 updates: the four updates ran at lr·0/8, lr·1/8, lr·2/8, lr·3/8.
  assert stats["learning_rate"] == pytest.approx(5e-2 * (0 + 1 + 2 + 3) / 8 / 4, rel=1e-6)
  assert int(state.skipped_updates) == 0 and np.isfinite(stats["loss"])
  # Later updates see π ≠ π_old and clip: the clip and ratio statistics are those of the four
  # AdamW updates rolled here (rows 0, 2, 4, 6 then 1, 3, 5, 7, twice), optax's AdamW and
  # gradient clipping with that warm-up written out as the reference optimizer.
  adamw = optax.chain(
      optax.clip_by_global_norm(config.max_grad_norm),
      optax.adamw(lambda count: 5e-2 * count / 8, b1=config.b1, b2=config.b2, eps=config.eps,
                  weight_decay=config.weight_decay))
  expected = rolled_epochs(config, batch, adamw)
  assert expected["clip_frac"] > 0.05, expected
  clip_keys = ("clip_frac", "clip_frac/low", "clip_frac/high")
  assert {k: stats[k] for k in clip_keys} == {k: expected[k] for k in clip_keys}
  for key in ("ratio/min", "ratio/mean", "ratio/max", "approx_kl"):
    assert stats[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
  for key in ("loss", "pg_loss"):  # near-cancelling means after AdamW updates: LOSS_ABS says why
    assert stats[key] == pytest.approx(expected[key], rel=1e-4, abs=LOSS_ABS), key


def test_sharded_mini_batches_equal_single_device():
  config = StepConfig(learning_rate=1e-3, beta=0.05, num_iterations=2, num_mini_batches=2,
                      num_micro_batches=2)
  single, single_stats = run_step(config, make_batch(), ref_seed=1, optimizer=sgd())
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sharded, sharded_stats = run_step(config, make_batch(), mesh=mesh, ref_seed=1,
                                    optimizer=sgd())
  for a, b in zip(flat_params(single), flat_params(sharded)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  for key in ("loss", "clip_frac", "kl", "grad_norm"):
    assert single_stats[key] == pytest.approx(sharded_stats[key], abs=1e-5), key


def test_schedule_spans_the_same_rl_steps_whatever_the_updates_per_step():
  plain = learning_rate_schedule(StepConfig(learning_rate=1.0, warmup_steps=2, total_steps=10))
  four = learning_rate_schedule(StepConfig(learning_rate=1.0, warmup_steps=2, total_steps=10,
                                           num_iterations=2, num_mini_batches=2))
  for rl_step in range(12):
    assert float(four(4 * rl_step)) == pytest.approx(float(plain(rl_step)), abs=1e-6)
  assert float(plain(1)) == pytest.approx(0.5) and float(four(1)) == pytest.approx(0.125)
  assert float(plain(10)) == pytest.approx(0.1)  # final_lr_fraction at total_steps


@pytest.mark.parametrize("mini, micro", [(3, 1), (2, 3)])
def test_batch_not_divisible_names_the_field(mini, micro):
  config = StepConfig(num_mini_batches=mini, num_micro_batches=micro)
  with pytest.raises(ConfigError, match=rf"config.algo.num_mini_batches={mini} × "
                                        rf"config.algo.num_micro_batches={micro} = {mini * micro}"
                                        rf" must divide the batch of {B} rows"):
    run_step(config, make_batch())


def test_num_mini_batches_must_be_positive():
  with pytest.raises(ConfigError, match="num_mini_batches=0 must be >= 1"):
    StepConfig(num_mini_batches=0)
