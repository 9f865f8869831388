"""RL on a mixture of experts: the sampler records each token's experts, exact rollouts record the
canonical forward's, batches (padded and packed) carry them beside their tokens, the training
step replays them (R3) and reports routing disagreement, load and collapse, and the guard stops a
collapsed run."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from reasoning_rl import guards as guards_lib
from reasoning_rl.models.config import ModelConfig, MoEConfig
from reasoning_rl.models.transformer import create_model
from reasoning_rl.rl import batching, packing
from reasoning_rl.rl.stats import finalize
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.exact import CanonicalScorer, exact_groups
from reasoning_rl.sampler.rollout import array_from_json, array_to_json, generate_groups
from reasoning_rl.sampler.sampling import SamplingParams, sample_key
from tests.support import rollouts

CONFIG = ModelConfig(
    model_type="qwen3_moe", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
    moe=MoEConfig(num_experts=4, experts_per_token=2, intermediate_size=24,
                  sparse_layers=(True, True), normalize_top_k=True))
PROMPTS = [[1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15, 16]]
SAMPLING = SamplingParams(temperature=1.0)
NEW_TOKENS = 6


@jax.jit
def _routing_of(model, tokens, mask):
  return model.hidden_states(tokens, mask, with_router_stats=True)[1].experts


def _own_routing(model, sequence, width: int = 16) -> np.ndarray:
  """[len, L_sparse, k]: the full forward's own experts for one sequence, left-padded to
  `width` (one compiled program for every sequence; a left-padded row computes what the
  sequence computes alone)."""
  tokens, mask = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
  tokens[0, width - len(sequence):], mask[0, width - len(sequence):] = sequence, 1
  experts = _routing_of(model, jnp.asarray(tokens), jnp.asarray(mask))
  return np.moveaxis(np.asarray(experts)[:, 0, width - len(sequence):], 0, 1)


def _engine(model):
  return Engine(model, max_concurrent_decodes=4, max_prefill_length=8,
                max_decode_length=NEW_TOKENS, steps_per_call=NEW_TOKENS)


@pytest.fixture(scope="module")
def sampled():
  """(model, engine, the engine's completions of PROMPTS, two samples each)."""
  model = create_model(CONFIG, seed=2)
  engine = _engine(model)
  return model, engine, generate_groups(engine, PROMPTS, num_samples=2, sampling=SAMPLING,
                                        max_new_tokens=NEW_TOKENS, seed=3)


def test_engine_records_the_experts_of_every_prompt_and_completion_token(sampled):
  model, _, completions = sampled
  for c in completions:
    sequence = c.prompt_tokens + c.completion_ids
    assert c.experts.shape == (len(sequence), 2, 2) and c.experts.dtype == np.uint8
    # the cached decode path routes as the full forward does (sets: top-k order may differ
    # only between equal scores)
    np.testing.assert_array_equal(np.sort(c.experts, -1), np.sort(_own_routing(model, sequence),
                                                                  -1))
    again = array_from_json(array_to_json(c.experts))
    assert again.dtype == np.uint8 and np.array_equal(again, c.experts)


def test_exact_rollouts_record_the_canonical_routing_and_logprobs(sampled):
  """In exact mode each completion's experts and log-probs are the canonical forward's, bit for
  bit (re-scored here); the trainer's own forward at the same weights routes every token the same
  way (disagreement 0), and the decode path's recorded routing is compared for the record."""
  model, engine, completions = sampled
  scorer = CanonicalScorer(nnx.graphdef(model), max_prompt_length=8,
                           max_completion_length=NEW_TOKENS, rows_per_call=4)
  exact = list(exact_groups(engine, scorer, PROMPTS, num_samples=2, sampling=SAMPLING,
                            max_new_tokens=NEW_TOKENS, seed=3))
  drafts = {(c.prompt_id, c.sample_index): c for c in completions}
  scores = scorer.score(engine.params, [c.prompt_tokens for c in exact],
                        [c.completion_ids for c in exact],
                        [sample_key(3, c.prompt_id, c.sample_index) for c in exact], SAMPLING)
  disagree = total = 0
  for index, c in enumerate(exact):
    n, length = len(c.completion_ids), len(c.prompt_tokens) + len(c.completion_ids)
    np.testing.assert_array_equal(c.experts, scores.experts[index, :length].astype(np.uint8))
    assert c.logprobs == scores.logprobs[index, :n].tolist()
    sequence = c.prompt_tokens + c.completion_ids
    own = np.sort(_own_routing(model, sequence), -1)
    assert np.array_equal(own, np.sort(c.experts, -1))
    draft = drafts[(c.prompt_id, c.sample_index)]
    if draft.completion_ids == c.completion_ids:
      differs = np.any(np.sort(draft.experts, -1) != np.sort(c.experts, -1), axis=-1)
      disagree, total = disagree + int(differs.sum()), total + differs.size
  assert total > 0 and 0 <= disagree / total <= 0.05


def _group(prompt, completions, experts_width=2, k=2, seed=0):
  rng = np.random.RandomState(seed)
  experts = [rng.randint(0, 4, (len(prompt) + len(c), experts_width, k)).astype(np.uint8)
             for c in completions]
  return rollouts.group([float(i) for i in range(len(completions))], completions, prompt=prompt,
                        logprobs=[[0.0] * len(c) for c in completions], parts={},
                        experts=experts)


def test_batches_padded_and_packed_carry_each_tokens_experts():
  record = rollouts.record(
      _group([5, 6, 7], [[1, 2], [3, 4, 8, 9]], seed=1),
      _group([9, 10, 11, 12, 13, 14], [[1], [2, 3, 4]], seed=2))  # prompt cut to 4
  batch = batching.build_batch(record, num_groups=2, group_size=2, prompt_length=4,
                               completion_length=3, pad_id=0, with_routing=True)
  experts = batch["recorded_experts"]
  assert experts.shape == (4, 7, 2, 2) and experts.dtype == np.uint8
  g0 = record.experts[1]  # prompt of 3 (left-padded by one), completion of 4 cut to 3
  np.testing.assert_array_equal(experts[1, 1:4], g0[:3])
  np.testing.assert_array_equal(experts[1, 4:7], g0[3:6])
  assert not experts[1, 0].any()
  g1 = record.experts[2]  # prompt of 6 keeps its last 4, completion of 1 then padding
  np.testing.assert_array_equal(experts[2, :4], g1[2:6])
  np.testing.assert_array_equal(experts[2, 4], g1[6])
  assert not experts[2, 5:].any()
  packed, _ = packing.pack_batch(batch, row_groups=1, head_chunk=8)
  # every real token keeps its experts: packed positions with a segment hold the experts of the
  # padded position with the same token of the same sequence
  for r, s in np.argwhere(packed["segment_ids"].any(-1)):
    for p in np.flatnonzero(packed["segment_ids"][r, s]):
      token = packed["tokens"][r, s, p]
      assert token in batch["tokens"]
  seq_experts = [np.concatenate([experts[i, :4][batch["attention_mask"][i, :4] > 0],
                                 experts[i, 4:4 + batch["attention_mask"][i, 4:].sum()]])
                 for i in range(4)]
  packed_seqs = []
  for r in range(packed["tokens"].shape[0]):
    ids = packed["segment_ids"][r, 0]
    for segment in range(1, ids.max() + 1):
      packed_seqs.append(packed["recorded_experts"][r, 0][ids == segment])
  assert sorted(map(lambda a: a.tobytes(), packed_seqs)) == sorted(
      map(lambda a: a.tobytes(), seq_experts))


def _step_batch(model, seed=0, replace_tokens=()):
  """A padded batch of 4 rows with the model's own routing recorded; `replace_tokens`
  [(row, position)] get another expert set recorded."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, CONFIG.vocab_size, (4, 9))
  attention = np.ones((4, 9), np.int32)
  attention[0, :2] = 0
  _, stats = model.hidden_states(jnp.asarray(tokens), jnp.asarray(attention),
                                 with_router_stats=True)
  recorded = np.moveaxis(np.asarray(stats.experts), 0, 2).astype(np.uint8)  # [B, T, L, k]
  for row, position in replace_tokens:
    for layer in range(2):
      own = set(recorded[row, position, layer].tolist())
      recorded[row, position, layer] = [e for e in range(4) if e not in own][:2]
  return dict(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attention),
              completion_mask=jnp.ones((4, 4), jnp.int32),
              advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5], jnp.float32),
              recorded_experts=jnp.asarray(recorded))


_STEPS = {}  # one compiled step per configuration, shared by the tests


def _step(batch, *, replay, **fields):
  model = create_model(CONFIG, seed=4)
  graphdef, params = nnx.split(model)
  config = StepConfig(routing_replay=replay, **fields)
  if config not in _STEPS:
    _STEPS[config] = TrainStep(graphdef, config)
    _STEPS[config].optimizer = optax.sgd(lambda count: 1.0)  # update = −gradient, read as is
  step = _STEPS[config]
  state = step.init_state(jax.tree.map(jnp.array, params))  # a copy: the step donates it
  new_state, stats = step(state, batch)
  grads = [np.asarray(a) - np.asarray(b) for a, b in zip(jax.tree.leaves(new_state.params),
                                                         jax.tree.leaves(params))]
  return grads, finalize(jax.device_get(stats))


def test_step_replays_recorded_experts_and_reports_routing():
  model = create_model(CONFIG, seed=4)
  own = _step_batch(model)
  base, stats = _step(own, replay=False)
  replayed, replay_stats = _step(own, replay=True)
  # replaying the forward's own choice changes nothing, and nothing disagrees — up to rounding:
  # the replaying program gathers the recorded experts instead of taking its own top-k, and XLA
  # may order the two programs' sums differently (1.5e-8 apart under tests/conftest.py's flags).
  # A gradient is read as new − old parameters, so a last-bit difference lands on the grid of
  # the parameter's float32 spacing: 1.19e-7 for the norm scales at 1.0 (seen on a Zen 5)
  for a, b in zip(base, replayed):
    np.testing.assert_allclose(a, b, rtol=0, atol=2.5e-7)
  assert stats["routing/disagreement"] == 0 == replay_stats["routing/disagreement"]
  assert abs(stats["loss"] - replay_stats["loss"]) < 1e-7
  # 3 tokens (of 34 real ones, 2 sparse layers each) recorded with other experts: the replaying
  # step trains through those experts (another gradient); both report the disagreement
  moved = _step_batch(model, replace_tokens=((0, 3), (1, 7), (3, 8)))
  plain, plain_stats = _step(moved, replay=False)
  forced, forced_stats = _step(moved, replay=True)
  for a, b in zip(base, plain):
    np.testing.assert_array_equal(a, b)  # without replay the recorded experts are only read
  assert max(np.abs(a - b).max() for a, b in zip(base, forced)) > 1e-4  # far past rounding
  expected = 6 / 68
  assert abs(plain_stats["routing/disagreement"] - expected) < 1e-7
  assert abs(forced_stats["routing/disagreement"] - expected) < 1e-7
  for key in ("routing/entropy", "routing/balance_loss", "routing/z_loss",
              "routing/max_load_over_mean", "routing/collapse"):
    assert np.isfinite(stats[key]), key
  assert 0.5 <= stats["routing/collapse"] <= 1.0  # between uniform (k/E) and total collapse
  assert stats["routing/max_load_over_mean"] == 2 * stats["routing/collapse"]  # E / k = 2


def test_auxiliary_losses_enter_the_gradient_only_when_weighted():
  model = create_model(CONFIG, seed=4)
  batch = _step_batch(model)
  base, stats = _step(batch, replay=False)
  weighted, weighted_stats = _step(batch, replay=False, moe_load_balance_coef=0.5,
                                   moe_router_z_coef=0.1)
  router_changed = [not np.array_equal(a, b) for a, b in zip(base, weighted)]
  assert any(router_changed)
  assert abs(weighted_stats["loss"] - stats["loss"]
             - (0.5 * stats["routing/balance_loss"] + 0.1 * stats["routing/z_loss"])) < 1e-5


def test_routing_collapse_guard():
  guards = guards_lib.Guards({"max_routing_collapse": 0.9})
  assert guards.check_step(1, {guards_lib.ROUTING_COLLAPSE_KEY: 0.89}) is None
  trip = guards.check_step(2, {guards_lib.ROUTING_COLLAPSE_KEY: 0.93})
  assert trip.guard == "max_routing_collapse" and trip.step == 2
  assert guards_lib.Guards({"max_routing_collapse": 1.0}).check_step(
      1, {guards_lib.ROUTING_COLLAPSE_KEY: 1.0}) is None



def test_experts_split_four_ways_over_an_expert_axis_equal_one_device():
  """8 simulated devices as data 2 × expert 4: each device holds 2 of the 8 experts and a quarter
  of its data shard's tokens; the step's loss, gradient (SGD update) and routing metrics equal
  one device's to float rounding, and the expert weights really are split."""
  from reasoning_rl import sharding

  config = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, num_experts=8))
  model = create_model(config, seed=6)
  graphdef, params = nnx.split(model)
  rng = np.random.RandomState(7)
  tokens = rng.randint(1, config.vocab_size, (8, 9))
  attention = np.ones((8, 9), np.int32)
  attention[0, :2] = 0
  batch = dict(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attention),
               completion_mask=jnp.ones((8, 4), jnp.int32),
               advantages=jnp.asarray(rng.randn(8).astype(np.float32)))
  mesh = sharding.make_mesh((2, 1, 4, 1))
  results = []
  for on_mesh in (None, mesh):
    step = TrainStep(graphdef, StepConfig(), on_mesh)
    step.optimizer = optax.sgd(lambda count: 1.0)
    start = jax.tree.map(jnp.array, params)
    if on_mesh is not None:
      start = sharding.reshard(start, sharding.param_shardings(start, on_mesh))
    state = step.init_state(start)
    if on_mesh is not None:
      gate = next(v for p, v in nnx.to_flat_state(state.params) if p[-1] == "gate_proj")
      assert gate[...].sharding.spec[0] == "expert"
    new_state, stats = step(state, batch)
    update = [np.asarray(a) - np.asarray(b) for a, b in
              zip(jax.tree.leaves(new_state.params), jax.tree.leaves(params))]
    results.append((update, finalize(jax.device_get(stats))))
  (single, single_stats), (split, split_stats) = results
  assert abs(single_stats["loss"] - split_stats["loss"]) < 1e-6
  for key in ("routing/entropy", "routing/max_load_over_mean", "routing/balance_loss"):
    assert abs(single_stats[key] - split_stats[key]) < 1e-5, key
  # update = new − old parameters: both sides carry the rounding of that subtraction (a few ulp
  # of the parameter), beside the gradient's own float-order differences (1e-5 of its scale)
  for a, b, old in zip(single, split, jax.tree.leaves(params)):
    ulp = np.spacing(np.float32(np.abs(np.asarray(old)).max()))
    np.testing.assert_allclose(b, a, atol=4 * ulp + 1e-5 * np.abs(a).max(), rtol=0)
  assert any(np.abs(a).max() > 0 for a in single)
