"""The truncated importance ratio (`algo.truncated_ratio`, docs/off_policy.md) against a numpy
reference: the sampler draws from π^W (temperature, top-k, top-p, min-p, renormalised); the ratio
π_θ^W/π_old^W reweights those draws into exact expectations under π_θ^W, the full-softmax ratio
π_θ/π_old does not.

Statistical tolerances: an importance-sampling mean of N = 200 000 draws is compared with the
exact expectation within 4 standard errors (SE = std/√N of the weighted values; a correct
estimator fails with probability ~6e-5 for a random seed, and the seed is fixed). "Biased" means
off by more than 20 standard errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reasoning_rl import sharding
from reasoning_rl.config import validate
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model
from reasoning_rl.rl import batching, losses, packing
from reasoning_rl.rl.logprobs import TRUNCATION_FIELDS, completion_logprobs
from reasoning_rl.rl.rollout_columns import RolloutColumns
from reasoning_rl.rl.stats import finalize
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig
from reasoning_rl.sampler.sampling import sample_tokens, truncated_logprobs
from tests.support import rollouts
from tests.support.configs import debug_config


DRAWS = 200_000
VOCAB = 12


def softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def numpy_truncated(logits, temperature, top_p, top_k, min_p):
  """π^W from the papers' definitions (see tests/test_sampler_sampling.py): temperature, top-k,
  top-p on the renormalised top-k (kept iff the mass strictly before is < p), min-p."""
  scaled = np.asarray(logits, np.float64) / temperature
  keep = np.ones(scaled.shape, bool)
  if top_k > 0:
    keep &= scaled >= np.sort(scaled)[::-1][top_k - 1]
  if top_p < 1:
    probs = np.where(keep, softmax(np.where(keep, scaled, -np.inf)), 0.0)
    order = np.argsort(-scaled, kind="stable")
    nucleus = np.zeros_like(keep)
    nucleus[order] = np.cumsum(probs[order]) - probs[order] < top_p
    keep &= nucleus
  if min_p > 0:
    keep &= softmax(scaled) >= min_p * softmax(scaled).max()
  out = np.zeros(scaled.shape)
  out[keep] = softmax(scaled[keep])
  return out


OLD = np.array([3.0, 2.6, 2.2, 1.9, 1.5, 1.0, 0.4, 0.0, -0.5, -1.0, -2.0, -3.0])
# π_θ after an update: the kept tokens reordered a little, the tail raised (a full-softmax
# update moves mass there too). The kept set stays the same (asserted), the condition under
# which the truncated ratio is exact.
NEW = OLD + np.array([-0.3, 0.2, 0.1, -0.1, 0.25, 0.0, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3])
F = np.random.default_rng(3).normal(0, 1, VOCAB)  # the function whose expectation is estimated

SETTINGS = {  # (temperature, top_p, top_k, min_p)
    "top_p 0.9": (1.0, 0.9, 0, 0.0),
    "top_k 4": (1.0, 1.0, 4, 0.0),
    "T 0.7, top_k 5, top_p 0.9, min_p 0.05": (0.7, 0.9, 5, 0.05),
    "min_p 0.2": (1.0, 1.0, 0, 0.2),
}


def jax_logprobs(logits, settings):
  """log π^W of every token by the trainer's function (`truncated_logprobs`), and log π."""
  t, p, k, m = settings
  z = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (VOCAB, VOCAB))
  full = lambda v, dtype: jnp.full(VOCAB, v, dtype)  # noqa: E731
  truncated = truncated_logprobs(z, jnp.arange(VOCAB), full(t, jnp.float32),
                                 full(p, jnp.float32), full(k, jnp.int32), full(m, jnp.float32))
  return np.asarray(truncated, np.float64), np.log(softmax(np.asarray(logits, np.float64)))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_truncated_ratio_is_unbiased_and_the_full_softmax_ratio_is_not(name):
  settings = SETTINGS[name]
  q, target = numpy_truncated(OLD, *settings), numpy_truncated(NEW, *settings)
  kept = q > 0
  assert np.array_equal(kept, target > 0)  # the exactness condition: supp π_θ^W ⊆ supp π_old^W
  assert 1 < kept.sum() < VOCAB  # something is truncated, and something is left to sample
  trunc_new, full_new = jax_logprobs(NEW, settings)
  trunc_old, full_old = jax_logprobs(OLD, settings)
  # The trainer's rebuild is the numpy reference on the kept set.
  np.testing.assert_allclose(np.exp(trunc_old[kept]), q[kept], rtol=1e-5)
  truncated_ratio = np.exp(trunc_new - trunc_old)
  full_ratio = np.exp(full_new - full_old)
  truth = float(target @ F)  # E_{π_θ^W}[f], what the truncated sampler's policy achieves

  # Exactly (sums over the support): the truncated ratio reweights q into π_θ^W — its weights
  # have mean 1 — while the full-softmax weights have mean π_θ(S)/π_old(S) ≠ 1 (and, at T ≠ 1,
  # not even that): no normalised distribution is reached.
  np.testing.assert_allclose(q @ (truncated_ratio * F), truth, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(q @ truncated_ratio, 1.0, rtol=1e-5)
  assert abs(q @ full_ratio - 1.0) > 1e-2

  # By sampling from the truncated sampler: f = F and f = 1 (the weights' mean).
  draws = np.random.default_rng(0).choice(VOCAB, size=DRAWS, p=q)
  for f, expected in ((F, truth), (np.ones(VOCAB), 1.0)):
    for ratio, biased in ((truncated_ratio, False), (full_ratio, True)):
      values = ratio[draws] * f[draws]
      error = abs(values.mean() - expected) / (values.std() / np.sqrt(DRAWS))
      if not biased:
        assert error < 4, (name, error)
      elif f is not F:
        assert error > 20, (name, error)


def test_when_the_kept_set_grows_the_truncated_ratio_misses_exactly_the_new_tokens():
  """supp π_θ^W ⊄ supp π_old^W (here min-p lets a raised tail token in): E_q[r^W f] is
  E_{π_θ^W}[f] less the part on tokens the sampler never draws, Σ_{y ∉ S_old} π_θ^W(y) f(y)."""
  settings = (1.0, 1.0, 0, 0.1)
  grown = OLD + np.array([-0.3, 0.2, 0.1, -0.1, 0.25, 0.0, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6])
  q, target = numpy_truncated(OLD, *settings), numpy_truncated(grown, *settings)
  new_tokens = (target > 0) & (q == 0)
  assert new_tokens.any()
  ratio = np.exp(jax_logprobs(grown, settings)[0] - jax_logprobs(OLD, settings)[0])
  np.testing.assert_allclose(q @ (ratio * F), target @ F - target[new_tokens] @ F[new_tokens],
                             rtol=1e-5, atol=1e-6)


def test_at_pi_old_the_truncated_surrogate_gives_the_exact_policy_gradient():
  """∇_z E_{y~q}[exp(log π_z^W(y) − sg) A(y)] at z = z_old is ∇_z E_{π_z^W}[A] exactly (the
  kept set is locally constant); the full-softmax surrogate's gradient is not."""
  settings = (0.8, 0.9, 6, 0.0)
  t, p, k, m = settings
  z_old = jnp.asarray(OLD, jnp.float32)
  advantage = jnp.asarray(F, jnp.float32)
  q = jnp.asarray(numpy_truncated(OLD, *settings), jnp.float32)
  kept = q > 0
  tokens = jnp.arange(VOCAB)
  full = lambda v, dtype: jnp.full(VOCAB, v, dtype)  # noqa: E731

  def log_pi_w(z):
    return truncated_logprobs(jnp.broadcast_to(z, (VOCAB, VOCAB)), tokens, full(t, jnp.float32),
                              full(p, jnp.float32), full(k, jnp.int32), full(m, jnp.float32))

  def objective(z):  # E_{π_z^W}[A] with π_z^W on the (fixed) kept set
    return jnp.sum(jax.nn.softmax(jnp.where(kept, z / t, -jnp.inf)) * advantage)

  def surrogate(z, log_pi):
    lp = log_pi(z)
    return jnp.sum(jnp.where(kept, q * jnp.exp(lp - jax.lax.stop_gradient(lp)) * advantage, 0))

  exact = jax.grad(objective)(z_old)
  np.testing.assert_allclose(jax.grad(surrogate)(z_old, log_pi_w), exact, atol=1e-6)
  full_grad = jax.grad(surrogate)(z_old, lambda z: jax.nn.log_softmax(z))
  assert np.abs(np.asarray(full_grad - exact)).max() > 1e-2


# ------------------------------------------------------------------ the step, on a small model

CONFIG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
B, P, T = 8, 4, 6
ROWS = {"sampling_temperature": np.array([1.0, 1.0, 0.7, 0.7, 1.3, 1.3, 1.0, 0.0], np.float32),
        "sampling_top_p": np.array([0.9, 0.9, 1.0, 0.8, 0.9, 1.0, 1.0, 1.0], np.float32),
        "sampling_top_k": np.array([0, 20, 20, 0, 5, 0, 0, 0], np.int32),
        "sampling_min_p": np.array([0.0, 0.0, 0.0, 0.05, 0.0, 0.1, 0.0, 0.0], np.float32)}


def sampled_batch(graphdef, params):
  """Completions drawn by the sampler's own function with each row's settings; the batch
  carries the settings and the sampler's sampling log-probs as behavior_logprobs."""
  model = nnx.merge(graphdef, params)
  rng = np.random.RandomState(0)
  tokens = jnp.asarray(rng.randint(0, CONFIG.vocab_size, (B, P)))
  settings = [jnp.asarray(ROWS[name]) for name in TRUNCATION_FIELDS]
  behavior = []
  for t in range(T):
    logits = model(tokens, jnp.ones(tokens.shape, jnp.int32))[:, -1]
    keys = jax.random.split(jax.random.key(t), B)
    token, _, sampling_lp = sample_tokens(logits, keys, *settings)
    # a greedy row's sampling log-prob is 0 (a point mass): the batch holds the model's own
    model_lp = jax.nn.log_softmax(logits)[jnp.arange(B), token]
    behavior.append(jnp.where(settings[0] <= 0, model_lp, sampling_lp))
    tokens = jnp.concatenate([tokens, token[:, None]], axis=1)
  batch = dict(tokens=tokens, attention_mask=jnp.ones((B, P + T), jnp.int32),
               completion_mask=jnp.ones((B, T), jnp.int32),
               advantages=jnp.asarray(rng.randn(B).astype(np.float32)),
               behavior_logprobs=jnp.stack(behavior, axis=1))
  batch.update({name: jnp.asarray(value) for name, value in ROWS.items()})
  return batch


def test_step_with_truncated_ratio_matches_the_sampler_and_the_public_pieces():
  graphdef, params = nnx.split(create_model(CONFIG, seed=0))
  batch = sampled_batch(graphdef, params)
  config = StepConfig(truncated_ratio=True, is_correction="token-truncate", learning_rate=1e3)
  step = TrainStep(graphdef, config)
  step.optimizer = __import__("optax").sgd(lambda count: 1e3)
  before = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
  state = step.init_state(jax.tree.map(jnp.copy, params))
  state, stats = step(state, batch)
  stats = finalize(jax.device_get(stats))
  # π_old^W rebuilt on the trainer equals μ^W: the truncated mismatch is rounding, the
  # full-softmax one is what truncation and temperature change.
  assert stats["mismatch/truncated/abs_log_diff"] < 1e-4
  assert stats["mismatch/truncated/ratio/max"] < 1 + 1e-4
  assert stats["mismatch/full/abs_log_diff"] > 0.05
  assert stats["tis/weight"] == pytest.approx(1.0, abs=1e-4)

  # The update's gradient is the truncated loss's, computed from public pieces.
  def loss(p):
    settings = tuple(batch[name] for name in TRUNCATION_FIELDS)
    logprobs = completion_logprobs(nnx.merge(graphdef, p), batch["tokens"],
                                   batch["attention_mask"], T, truncation=settings)[0]
    return losses.policy_loss(logprobs, jax.lax.stop_gradient(logprobs), batch["advantages"],
                              batch["completion_mask"],
                              behavior_logprobs=batch["behavior_logprobs"],
                              is_correction="token-truncate")[0]

  expected = [np.asarray(g, np.float64) for g in jax.tree.leaves(jax.grad(loss)(params))]
  actual = [(b - np.asarray(a, np.float64)) / 1e3
            for b, a in zip(before, jax.tree.leaves(state.params))]
  scale = max(np.abs(e).max() for e in expected)
  for a, e in zip(actual, expected, strict=True):
    np.testing.assert_allclose(a, e, rtol=0, atol=1e-4 * scale)


def test_inner_updates_truncate_pi_old_too():
  """With μ = 2, π_old comes from `_prepare`'s own forward: truncated like π_θ, so the first
  update's ratio is exactly 1 and the mismatch against the sampler is rounding."""
  graphdef, params = nnx.split(create_model(CONFIG, seed=0))
  batch = sampled_batch(graphdef, params)
  step = TrainStep(graphdef, StepConfig(truncated_ratio=True, num_iterations=2,
                                        num_micro_batches=2, learning_rate=1e-4))
  state = step.init_state(params)
  _, stats = step(state, batch)
  stats = finalize(jax.device_get(stats))
  assert stats["ratio/min"] <= 1.0 <= stats["ratio/max"]
  assert np.isfinite(stats["loss"])
  assert stats["mismatch/truncated/abs_log_diff"] < stats["mismatch/full/abs_log_diff"]


def test_a_batch_without_the_settings_is_refused_with_the_fix():
  graphdef, params = nnx.split(create_model(CONFIG, seed=0))
  batch = {k: v for k, v in sampled_batch(graphdef, params).items()
           if k not in TRUNCATION_FIELDS}
  step = TrainStep(graphdef, StepConfig(truncated_ratio=True))
  with pytest.raises(ConfigError, match="algo.truncated_ratio.*sampling_temperature"):
    step(step.init_state(params), batch)


def group(sampling, logprobs=(-0.5, -0.25), sampling_logprobs=(-0.1, -0.2), position=0):
  return rollouts.group(
      [0.0, 1.0], [[3, 4], [5, 6]], position=position, prompt=[1, 2],
      logprobs=[list(logprobs)] * 2, parts={},
      sampling_logprobs=[list(sampling_logprobs)] * 2 if sampling else None,
      sampling=rollouts.sampling_settings(**sampling) if sampling else None)


def test_build_batch_carries_each_rows_settings_and_sampling_logprobs():
  record = rollouts.record(
      group({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05}),
      group({"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}, position=1))
  batch = batching.build_batch(record, num_groups=3, group_size=2, prompt_length=2,
                               completion_length=3, pad_id=0, truncation=True)
  np.testing.assert_allclose(batch["sampling_temperature"], [0.7, 0.7, 0, 0, 1, 1])
  np.testing.assert_allclose(batch["sampling_top_p"], [0.9, 0.9, 1, 1, 1, 1])
  np.testing.assert_array_equal(batch["sampling_top_k"], [20, 20, 0, 0, 0, 0])
  np.testing.assert_allclose(batch["sampling_min_p"], [0.05, 0.05, 0, 0, 0, 0])
  # sampled rows: the sampling log-probs; the greedy group: the model's own
  np.testing.assert_allclose(batch["behavior_logprobs"][:4, :2],
                             [[-0.1, -0.2]] * 2 + [[-0.5, -0.25]] * 2)
  with pytest.raises(ValueError, match="truncation=True"):
    batching.build_batch(group(None), num_groups=1, group_size=2, prompt_length=2,
                         completion_length=3, pad_id=0, truncation=True)


def test_packing_carries_the_settings_with_the_truncated_ratio():
  groups = [group({"temperature": 1.0, "top_p": 0.9, "top_k": 0, "min_p": 0.0}),
            group({"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0})]
  graphdef, _ = nnx.split(create_model(CONFIG, seed=0))
  step = TrainStep(graphdef, StepConfig(truncated_ratio=True, packing=True, logprob_chunk=4))
  build = lambda gs, num_groups=1: batching.build_batch(  # noqa: E731
      RolloutColumns.concat(gs, group_size=2), num_groups=num_groups, group_size=2,
      prompt_length=2, completion_length=3, pad_id=0, truncation=True)
  packed = step.host_batch(build(groups[:1]))
  assert not set(TRUNCATION_FIELDS) & set(packed)
  top_p = packed["head_sampling_top_p"]
  assert top_p.shape == packed["head_targets"].shape
  # the 2 x 2 completion tokens' head positions hold the rows' 0.9, the others the full softmax
  np.testing.assert_allclose(np.sort(top_p.ravel())[:4], 0.9)
  assert (np.sort(top_p.ravel())[4:] == 1.0).all()
  assert ((top_p < 1) == (packed["head_targets"] >= 0)).all()
  # The arrays follow the config, not the rows: a batch that samples the model as is, and one
  # whose groups all went missing (dynamic sampling came up short), feed the same compiled step.
  for other in (build(groups[1:]), build([], num_groups=1)):
    assert set(step.host_batch(other)) == set(packed)
  step = TrainStep(graphdef, StepConfig(truncated_ratio=False, packing=True))
  assert not set(packing.HEAD_TRUNCATION_FIELDS) & set(step.host_batch(build(groups[:1])))


def ragged(batch):
  """The sampled batch cut to prompts of 1–4 and completions of 1–6 tokens, so that packed rows
  hold several sequences of different settings."""
  batch = {k: np.array(v) for k, v in batch.items()}
  for row, (p, c) in enumerate(zip([4, 1, 2, 3, 4, 2, 1, 3], [6, 2, 3, 6, 1, 4, 5, 2])):
    batch["attention_mask"][row, :P - p] = 0
    batch["attention_mask"][row, P + c:] = 0
    batch["completion_mask"][row, c:] = 0
  return batch


def probed_step(graphdef, params, config, batch, mesh=None):
  """(the update's gradient as flat float64 leaves, finalized stats): one SGD step at rate 1."""
  step = TrainStep(graphdef, config, mesh)
  step.optimizer = __import__("optax").sgd(lambda count: 1.0)
  start = jax.tree.map(jnp.copy, params)
  if mesh is not None:
    start = sharding.reshard(start, sharding.param_shardings(start, mesh))
  reference = {"ref_params": jax.tree.map(jnp.copy, params)} if config.beta > 0 else {}
  state, stats = step(step.init_state(start, **reference), step.host_batch(batch))
  grads = [np.asarray(b, np.float64) - np.asarray(a, np.float64)
           for b, a in zip(jax.tree.leaves(params), jax.tree.leaves(state.params))]
  return grads, finalize(jax.device_get(stats))


PACKED_CASES = {"one update, 2 micro-batches": (dict(num_micro_batches=2), None),
                "2 epochs (pi_old from its own forward)": (dict(num_iterations=2), None),
                "2 data x 4 tensor devices": (dict(), {"data": 2, "fsdp": 1, "tensor": 4})}


@pytest.mark.parametrize("overrides, mesh_shape", PACKED_CASES.values(), ids=PACKED_CASES.keys())
def test_packed_step_truncates_like_the_padded_step(overrides, mesh_shape):
  """Rows of six different settings (greedy among them) packed together: each head position is
  truncated with its own sequence's settings, so loss, ratio, mismatch and gradient are the
  padded step's."""
  graphdef, params = nnx.split(create_model(CONFIG, seed=0))
  batch = ragged(sampled_batch(graphdef, params))
  common = dict(truncated_ratio=True, is_correction="token-truncate", logprob_chunk=4,
                learning_rate=1.0, **overrides)
  padded, padded_stats = probed_step(graphdef, params, StepConfig(packing=False, **common), batch)
  mesh = sharding.make_mesh(mesh_shape) if mesh_shape else None
  packed, packed_stats = probed_step(graphdef, params, StepConfig(packing=True, **common), batch,
                                     mesh)
  scale = max(np.abs(e).max() for e in padded)
  for a, e in zip(packed, padded, strict=True):
    np.testing.assert_allclose(a, e, rtol=0, atol=1e-4 * scale)
  for name in ("loss", "entropy", "ratio/min", "ratio/max", "mismatch/truncated/abs_log_diff",
               "mismatch/full/abs_log_diff", "tis/weight"):
    np.testing.assert_allclose(packed_stats[name], padded_stats[name], rtol=1e-4, atol=1e-6)
  if mesh is not None:
    return
  # the settings matter: the full-softmax ratio on the same packed rows is another update
  full, _ = probed_step(graphdef, params,
                        StepConfig(packing=True, **{**common, "truncated_ratio": False}), batch)
  assert max(np.abs(f - e).max() for f, e in zip(full, padded)) > 1e-2 * scale


def test_config_accepts_packing_with_a_truncating_rollout():
  config = debug_config(**{"algo.packing": True, "rollout.top_p": 0.9,
                           "rollout.temperature": 0.7})
  validate(config)  # the packed rows carry each head position's settings


def test_the_kl_to_the_reference_compares_full_softmax_with_full_softmax():
  """At θ = θ_ref the KL is 0 and adds no gradient, whatever temperature the rows were sampled
  at: the policy side of the KL is the full softmax, like the reference's, not the truncated
  π^W of the ratio (which at T 0.7 / 1.3 differs from the reference it starts equal to)."""
  graphdef, params = nnx.split(create_model(CONFIG, seed=0))
  batch = sampled_batch(graphdef, params)
  common = dict(truncated_ratio=True, is_correction="token-truncate", learning_rate=1.0)
  with_kl, stats = probed_step(graphdef, params, StepConfig(beta=0.5, **common), batch)
  without_kl, _ = probed_step(graphdef, params, StepConfig(beta=0.0, **common), batch)
  assert abs(stats["kl"]) < 1e-6
  scale = max(np.abs(g).max() for g in without_kl)
  for a, b in zip(with_kl, without_kl, strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale)


def test_a_sampled_token_that_left_the_kept_set_has_ratio_zero_and_no_gradient():
  """docs/off_policy.md: a token in π_old's kept set that is not in π_θ's has π_θ^W(y) = 0, so its
  ratio is 0 and it gets no gradient; the value the rebuild gives its log-prob stays finite (its
  share of S ∪ {y}), and the membership flag is what tells it apart. Hand computation: T = 1,
  top-p 0.8 keeps {0, 1} of these logits, so token 3 is outside and token 1 inside."""
  logits = np.array([3.0, 2.0, 0.5, -1.0, -2.0], np.float32)
  probs = np.exp(logits) / np.exp(logits).sum()
  assert probs[0] + probs[1] > 0.8 and probs[0] < 0.8  # the set is exactly {0, 1}
  settings = (jnp.array(1.0), jnp.array(0.8), jnp.array(0), jnp.array(0.0))
  outside, outside_in_set = truncated_logprobs(jnp.asarray(logits), jnp.array(3), *settings,
                                               with_membership=True)
  inside, inside_in_set = truncated_logprobs(jnp.asarray(logits), jnp.array(1), *settings,
                                             with_membership=True)
  assert not bool(outside_in_set) and bool(inside_in_set)
  kept = logits[[0, 1, 3]].astype(np.float64)
  assert float(outside) == pytest.approx(logits[3] - np.log(np.exp(kept).sum()), abs=1e-6)
  assert float(inside) == pytest.approx(
      logits[1] - np.log(np.exp(logits[:2].astype(np.float64)).sum()), abs=1e-6)

  # The loss: token (0, 1) left the set (π_old^W(y) = 0.3, π_θ^W(y) = 0 in truth), the rest did
  # not. Hand values with ppo, ε = 0.2, token-mean over the 4 valid tokens.
  old = np.log(np.array([[0.5, 0.3, 0.4], [0.6, 0.2, 0.9]]))
  new = np.log(np.array([[0.55, 0.25, 0.4], [0.45, 0.3, 0.9]]))  # 0.25: the rebuild's finite value
  mask = np.array([[1, 1, 1], [1, 0, 0]])
  left = np.array([[False, True, False], [False, False, False]])
  adv = np.array([1.0, -1.0])
  with jax.enable_x64(True):
    def loss_fn(logp):
      return losses.policy_loss(logp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                loss_agg="token-mean", left_kept_set=jnp.asarray(left))
    (loss, stats), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(new))
  # per token: -A·clip-surrogate; (0,0): r = 1.1 → -1.1; (0,1): r = 0 → 0; (0,2): r = 1 → -1;
  # (1,0): A = -1, r = 0.75 < 0.8 → max(0.75, 0.8) = 0.8
  assert float(loss) == pytest.approx((-1.1 + 0.0 - 1.0 + 0.8) / 4, abs=1e-12)
  grad = np.asarray(grad)
  np.testing.assert_allclose(grad[0], [-1.1 / 4, 0.0, -1.0 / 4], atol=1e-12)
  assert grad[1, 0] == 0.0  # clipped
  assert np.all(np.isfinite(grad))
  got = finalize(jax.device_get(stats))
  assert got["ratio/min"] == 0.0
  assert got["truncation/left_token_frac"] == pytest.approx(1 / 4)
  # KL(π_old‖π_θ) ≈ r − 1 − log r over the 3 tokens still in the set, finite
  r = np.array([1.1, 1.0, 0.75])
  assert got["approx_kl"] == pytest.approx(np.mean(r - 1 - np.log(r)), abs=1e-12)
  assert all(np.isfinite(v) for v in got.values())


def test_gspo_sequence_holding_a_token_that_left_has_ratio_zero():
  """GSPO's sequence ratio (Π_t r_t)^(1/n) is 0 when one token's is: the whole sequence gets no
  gradient, the other rows keep theirs."""
  old = np.log(np.array([[0.5, 0.3], [0.6, 0.2]]))
  new = np.log(np.array([[0.6, 0.25], [0.5, 0.3]]))
  left = np.array([[False, True], [False, False]])
  with jax.enable_x64(True):
    def loss_fn(logp):
      return losses.policy_loss(logp, jnp.asarray(old), jnp.asarray([1.0, 1.0]),
                                jnp.ones((2, 2)), loss_type="gspo", left_kept_set=left)[0]
    loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(new))
  s1 = np.exp(np.mean(np.log([0.5 / 0.6, 0.3 / 0.2])))  # row 1's sequence ratio, inside the clip
  assert float(loss) == pytest.approx(-s1 / 2, abs=1e-12)  # row 0 contributes 0
  np.testing.assert_array_equal(np.asarray(grad)[0], [0.0, 0.0])
  np.testing.assert_allclose(np.asarray(grad)[1], [-s1 / 4, -s1 / 4], atol=1e-12)


def test_inner_updates_zero_the_ratio_of_tokens_that_left_the_kept_set():
  """μ = 2 with a large step: π_θ's kept sets shrink after the first update, so some sampled
  tokens leave them; the step reports how many, and nothing is NaN or infinite."""
  graphdef, params = nnx.split(create_model(CONFIG, seed=0))
  batch = sampled_batch(graphdef, params)
  step = TrainStep(graphdef, StepConfig(truncated_ratio=True, num_iterations=4,
                                        learning_rate=0.3))
  state = step.init_state(params)
  _, stats = step(state, batch)
  stats = finalize(jax.device_get(stats))
  assert all(np.all(np.isfinite(v)) for v in stats.values()), stats
  assert stats["truncation/left_token_frac"] > 0
  assert stats["ratio/min"] == 0.0
