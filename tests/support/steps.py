"""The fused training step on a tiny random model, and its references rolled here from public pieces
(completion_logprobs + losses): gradients, μ updates, mini-batch epochs. (From
test_train_step.py, test_step_minibatches.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from reasoning_rl import sharding
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model
from reasoning_rl.rl import losses, stats as stats_lib, value as value_lib
from reasoning_rl.rl.logprobs import TRUNCATION_FIELDS, completion_logprobs
from reasoning_rl.rl.stats import finalize
from reasoning_rl.rl.step import TrainStep


CONFIG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)


B, P, T = 8, 5, 6


def fresh_params(seed=0, config=CONFIG):
  return nnx.split(create_model(config, seed=seed))


def make_batch(seed=0):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, CONFIG.vocab_size, (B, P + T))
  attention = np.ones((B, P + T), np.int32)
  attention[:2, :2] = 0  # left-padded prompts
  completion = np.ones((B, T), np.int32)
  completion[3, 4:] = 0  # a short completion (right padding)
  attention[3, P + 4:] = 0
  return dict(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attention),
              completion_mask=jnp.asarray(completion),
              advantages=jnp.asarray(rng.randn(B).astype(np.float32)))


def run_step(config, batch, *, mesh=None, seed=0, ref_seed=None, optimizer=None):
  """One step from fresh parameters; `optimizer` replaces the step's AdamW when given."""
  graphdef, params = fresh_params(seed)
  ref = fresh_params(ref_seed)[1] if ref_seed is not None else None
  if mesh is not None:
    params = sharding.reshard(params, sharding.param_shardings(params, mesh))
    if ref is not None:
      ref = sharding.reshard(ref, sharding.param_shardings(ref, mesh))
  step = TrainStep(graphdef, config, mesh)
  if optimizer is not None:
    step.optimizer = optimizer
  state = step.init_state(params, ref_params=ref)
  state, stats = step(state, batch)
  return state, finalize(jax.device_get(stats))


def flat_params(state):
  return [np.asarray(x) for x in jax.tree.leaves(state.params)]


PROBE_LR = 1e3  # large, so parameters − update loses few of the gradient's bits to rounding


def gradient_probe() -> optax.GradientTransformation:
  """SGD at PROBE_LR (through a schedule, so the step's learning-rate stat finds its count)."""
  return optax.sgd(lambda count: PROBE_LR)


def step_gradient(config, batch, **kwargs):
  """(gradient of the step's single update as flat leaves, stats), read off an SGD update."""
  state, stats = run_step(config, batch, optimizer=gradient_probe(), **kwargs)
  before = jax.tree.leaves(fresh_params(kwargs.get("seed", 0))[1])
  return [(np.asarray(b, np.float64) - a) / PROBE_LR
          for b, a in zip(before, flat_params(state))], stats


def rolled_updates(batch, num_updates, learning_rate, **loss_options):
  """The stats of `num_updates` plain SGD updates on the whole batch against one fixed π_old,
  rolled here from public pieces (`completion_logprobs` + `losses.policy_loss`) and merged over
  the updates: what the step with μ = num_updates and `optax.sgd(learning_rate)` must report."""
  graphdef, params = fresh_params(0)
  logprobs_of = lambda p: completion_logprobs(  # noqa: E731
      nnx.merge(graphdef, p), batch["tokens"], batch["attention_mask"], T)[0]
  old = logprobs_of(params)

  def loss(p):
    return losses.policy_loss(logprobs_of(p), old, batch["advantages"], batch["completion_mask"],
                              **loss_options)

  per_update = []
  for _ in range(num_updates):
    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
    per_update.append(dict(stats, loss=(value, 1)))  # the step's loss: the mean over updates
    params = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
  return finalize(jax.device_get(stats_lib.merge_all(per_update)))


def reference_kl(policy, reference, batch):
  """The step's `kl` metric computed here: k3 per completion token (r − 1 − log r with
  r = π_ref / π), mean over the completion tokens."""
  logprobs_of = lambda model: np.asarray(completion_logprobs(  # noqa: E731
      model, batch["tokens"], batch["attention_mask"], T)[0], np.float64)
  log_ratio = logprobs_of(reference) - logprobs_of(policy)
  valid = np.asarray(batch["completion_mask"]) > 0
  return float(np.mean((np.exp(log_ratio) - log_ratio - 1)[valid]))


def assert_same_gradient(actual, expected, rtol=1e-4):
  """Leaf by leaf within rtol of the largest entry of the whole gradient: a gradient scaled by
  1 + 10·rtol fails on its largest entries."""
  scale = max(np.abs(e).max() for e in expected)
  assert scale > 0
  for a, e in zip(actual, expected, strict=True):
    np.testing.assert_allclose(a, e, rtol=0, atol=rtol * scale)


def rolled_epochs(config, batch, optimizer, graphdef=None, params=None):
  """The stats of μ passes over M mini-batches rolled here from public pieces: update e·M + k on
  the rows k, k+M, … alone (their own normalizers), every update against π_old (and, for ppo,
  the old values, GAE advantages and returns) of one forward at the initial parameters (default:
  `fresh_params(0)`), the parameters moved by `optimizer` (optax) on each update's gradient;
  merged over the updates as the step reports them. For ppo the value head starts at zeros, as
  `TrainStep.init_state`'s. With `config.truncated_ratio` and the batch's sampling settings the
  log-probs are the sampler's truncated ones; the batch's behavior_logprobs enter the loss with
  `config.is_correction`. No reference model (β = 0)."""
  assert config.beta == 0
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  if graphdef is None:
    graphdef, params = fresh_params(0)
  ppo = config.algorithm == "ppo"
  mask = batch["completion_mask"]
  everything = np.arange(mask.shape[0])
  truncated = config.truncated_ratio and all(k in batch for k in TRUNCATION_FIELDS)
  behavior = batch.get("behavior_logprobs")

  def outputs(trainable, rows):
    out = completion_logprobs(
        nnx.merge(graphdef, trainable["policy"]), batch["tokens"][rows],
        batch["attention_mask"][rows], mask.shape[1], return_hidden=True,
        truncation=tuple(batch[k][rows] for k in TRUNCATION_FIELDS) if truncated else None)
    head = trainable.get("value_head")
    values = out[-1].astype(jnp.float32) @ head["kernel"] + head["bias"] if ppo else None
    return out[0], out[1], values

  trainable = {"policy": params}
  if ppo:
    width = params["final_norm"]["scale"].shape[0]
    trainable["value_head"] = {"kernel": jnp.zeros((width,), jnp.float32),
                               "bias": jnp.zeros((), jnp.float32)}
  old, _, old_values = jax.jit(outputs)(trainable, jnp.asarray(everything))
  if ppo:
    gae, returns = value_lib.gae_advantages(
        value_lib.sequence_rewards_to_tokens(batch["rewards"], mask), old_values, mask,
        gamma=config.gamma, lam=config.gae_lambda)
    advantages = value_lib.masked_whiten(gae, mask)
  else:
    advantages = jnp.asarray(batch["advantages"])

  def loss_fn(trainable, rows):
    logprobs, entropy, values = outputs(trainable, rows)
    loss, stats = losses.policy_loss(
        logprobs, old[rows], advantages[rows], mask[rows], loss_type=config.loss_type,
        epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high,
        dual_clip=config.dual_clip, loss_agg=config.loss_agg, entropy=entropy,
        entropy_coef=config.entropy_coef, max_completion_length=config.max_completion_length,
        behavior_logprobs=None if behavior is None else behavior[rows],
        is_correction=config.is_correction, is_threshold=config.is_threshold)
    if ppo:
      v_loss, v_stats = value_lib.value_loss(values, old_values[rows], returns[rows], mask[rows],
                                             clip_epsilon=config.value_clip,
                                             loss_agg=config.loss_agg,
                                             max_completion_length=config.max_completion_length)
      loss, stats = loss + config.vf_coef * v_loss, stats_lib.merge(stats, v_stats)
    return loss, stats

  @jax.jit  # one compiled update (rows traced), for speed: eager autodiff dispatches per op
  def update(trainable, opt_state, rows):
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, rows)
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, dict(stats, loss=(loss, 1))

  opt_state = optimizer.init(trainable)
  per_update = []
  for _ in range(config.num_iterations):
    for k in range(config.num_mini_batches):
      trainable, opt_state, stats = update(trainable, opt_state,
                                           jnp.asarray(everything[k::config.num_mini_batches]))
      per_update.append(stats)
  return finalize(jax.device_get(stats_lib.merge_all(per_update)))
