"""Zero-mismatch rollouts (`rollout.exact_logprobs`, reasoning_rl/sampler/exact.py).

References: the trainer's `completion_logprobs` (the canonical forward computes the same numbers up
to rounding), a numpy Gumbel-max draw, and plain autoregressive sampling from the canonical forward
one token at a time (what the verify-and-repair loop must reproduce exactly, even from a draft
model whose tokens disagree often). Bit-for-bit claims are asserted on the int32 view of the
float32 log-probs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import packing
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig
from reasoning_rl.sampler import Engine, SamplingParams, generate_groups
from reasoning_rl.sampler.exact import CanonicalScorer, ExactStats, exact_groups
from reasoning_rl.sampler.sampling import sample_key
from tests.support.configs import debug_config
from tests.support.packing import T as PACKING_T
from tests.support.packing import ragged_batch
from tests.support.sampler import PROMPTS, AngleTokenizer, tiny_model
from tests.support.steps import fresh_params


MAX_PROMPT, MAX_NEW = 32, 12
WARPED = SamplingParams(temperature=0.7, top_p=0.9, top_k=6, min_p=0.02)
PLAIN = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)


def bits(x):
  return np.asarray(x, np.float32).view(np.int32)


@pytest.fixture(scope="module")
def model():
  return tiny_model(1)


@pytest.fixture(scope="module")
def scorer(model):
  return CanonicalScorer(nnx.graphdef(model), max_prompt_length=MAX_PROMPT,
                         max_completion_length=MAX_NEW)


@pytest.fixture(scope="module")
def draft_model():
  """The policy with every weight moved by N(0, 0.05²): its tokens often differ from the
  policy's, so the exact loop must repair many of them."""
  draft = tiny_model(1)
  state = nnx.state(draft, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(state))))
  nnx.update(draft, jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape),
                                 state))
  return draft


def engine_of(model, slots, steps):
  return Engine(model, max_concurrent_decodes=slots, max_prefill_length=MAX_PROMPT,
                max_decode_length=MAX_NEW, steps_per_call=steps)


def random_sequences(seed, n=9):
  rng = np.random.RandomState(seed)
  prompts = [rng.randint(1, 97, rng.randint(1, 20)).tolist() for _ in range(n)]
  completions = [rng.randint(1, 97, rng.randint(1, MAX_NEW + 1)).tolist() for _ in range(n)]
  keys = [sample_key(seed, i, 0) for i in range(n)]
  return prompts, completions, keys


def canonical_sample(scorer, params, prompt, key, sampling, *, stop_ids=(), stop_strings=()):
  """Autoregressive sampling from the canonical forward, one token per call: the distribution
  `exact_groups` must sample exactly."""
  tokens = []
  while True:
    draws = scorer.score(params, [prompt], [tokens + [0]], [key], sampling).draws
    tokens.append(int(draws[0, len(tokens)]))
    text = AngleTokenizer().decode(tokens)
    if (tokens[-1] in stop_ids or any(s in text for s in stop_strings)
        or len(tokens) == MAX_NEW):
      return tokens


def test_scores_do_not_depend_on_the_batch(model, scorer):
  params = nnx.state(model)
  prompts, completions, keys = random_sequences(0)
  whole = scorer.score(params, prompts, completions, keys, WARPED)
  order = np.random.RandomState(1).permutation(len(prompts))
  for rows in ([0], [3, 1, 4], list(order), list(range(5))):
    part = scorer.score(params, [prompts[i] for i in rows], [completions[i] for i in rows],
                        [keys[i] for i in rows], WARPED)
    for j, i in enumerate(rows):
      n = len(completions[i])
      np.testing.assert_array_equal(bits(part.logprobs[j, :n]), bits(whole.logprobs[i, :n]))
      np.testing.assert_array_equal(bits(part.sampling_logprobs[j, :n]),
                                    bits(whole.sampling_logprobs[i, :n]))
      np.testing.assert_array_equal(part.draws[j, :n], whole.draws[i, :n])


def test_scores_are_the_training_forwards_and_draws_are_gumbel_max(model, scorer):
  params = nnx.state(model)
  prompts, completions, keys = random_sequences(2, n=4)
  scores = scorer.score(params, prompts, completions, keys, SamplingParams(temperature=0.8))
  for i, (prompt, completion) in enumerate(zip(prompts, completions)):
    tokens = jnp.asarray([prompt + completion])
    reference, _ = completion_logprobs(model, tokens, jnp.ones_like(tokens), len(completion))
    np.testing.assert_allclose(scores.logprobs[i, :len(completion)], reference[0], atol=2e-5)
    # draw t: argmax(logits / 0.8 + Gumbel noise of fold_in(key, t)), in numpy
    logits = np.asarray(model(jnp.asarray([prompt + completion])))[0, len(prompt) - 1:]
    for t in range(len(completion)):
      noise = np.asarray(jax.random.gumbel(jax.random.fold_in(keys[i], t), (97,)))
      assert scores.draws[i, t] == np.argmax(logits[t] / np.float32(0.8) + noise)


@pytest.mark.parametrize("sampling", [PLAIN, WARPED], ids=["plain", "warped"])
def test_a_wrong_draft_still_gives_exact_samples(model, draft_model, scorer, sampling):
  params = nnx.state(model)
  stats = ExactStats()
  common = dict(num_samples=3, sampling=sampling, max_new_tokens=MAX_NEW, stop_ids=[7],
                stop_strings=["<11>"], tokenizer=AngleTokenizer(), seed=3)
  out = sorted(exact_groups(engine_of(draft_model, 2, 3), scorer, PROMPTS, stats=stats,
                            target_params=params, **common),
               key=lambda c: (c.prompt_id, c.sample_index))
  assert stats.repairs > 10 and stats.rounds > 2  # the draft really was wrong, often
  assert stats.draft_mismatch_mean > 0.01
  for c in out:
    key = sample_key(3, c.prompt_id, c.sample_index)
    assert c.completion_ids == canonical_sample(
        scorer, params, PROMPTS[c.prompt_id], key, sampling, stop_ids=[7],
        stop_strings=["<11>"]), (c.prompt_id, c.sample_index)
    again = scorer.score(params, [c.prompt_tokens], [c.completion_ids], [key], sampling)
    n = len(c.completion_ids)
    np.testing.assert_array_equal(bits(c.logprobs), bits(again.logprobs[0, :n]))
    if sampling is WARPED:
      np.testing.assert_array_equal(bits(c.sampling_logprobs), bits(again.sampling_logprobs[0, :n]))
    else:
      assert c.sampling_logprobs is None
    text = AngleTokenizer().decode(c.completion_ids)
    expected = ("stop_id" if c.completion_ids[-1] == 7 else
                "stop_string" if "<11>" in text else "length")
    assert c.finish_reason == expected and c.truncated == (expected == "length")
  assert stats.sequences == len(out) == 3 * len(PROMPTS)
  assert stats.tokens == sum(len(c.completion_ids) for c in out)


def test_exact_rollouts_do_not_depend_on_slots_or_steps(model, scorer):
  runs = []
  for slots, steps in ((1, 1), (3, 4), (8, 16)):
    stats = ExactStats()
    runs.append(sorted(exact_groups(engine_of(model, slots, steps), scorer, PROMPTS,
                                    num_samples=2, sampling=WARPED, max_new_tokens=MAX_NEW,
                                    seed=5, stats=stats),
                       key=lambda c: (c.prompt_id, c.sample_index)))
    assert stats.repairs == 0  # float32 decode and forward agree on every draw here
    # ... but not on every log-prob: the mismatch the mode removes is real
    assert 0 < stats.draft_mismatch_max < 1e-4
  for other in runs[1:]:
    for a, b in zip(runs[0], other):
      assert a.completion_ids == b.completion_ids
      np.testing.assert_array_equal(bits(a.logprobs), bits(b.logprobs))
      np.testing.assert_array_equal(bits(a.sampling_logprobs), bits(b.sampling_logprobs))
  # without repairs, the exact tokens are the engine's own
  plain = generate_groups(engine_of(model, 3, 4), PROMPTS, num_samples=2, sampling=WARPED,
                          max_new_tokens=MAX_NEW, seed=5)
  assert [c.completion_ids for c in plain] == [c.completion_ids for c in runs[0]]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_step_takes_pi_old_from_the_sampler(packed):
  batch = ragged_batch(2)
  graphdef, params = fresh_params(0)
  old, _ = completion_logprobs(nnx.merge(graphdef, params), jnp.asarray(batch["tokens"]),
                               jnp.asarray(batch["attention_mask"]), PACKING_T)
  # π_old as the trainer computes it, in the batch as the sampler's: the step must read it back
  batch["behavior_logprobs"] = np.asarray(old) * batch["completion_mask"] + np.float32(0.25)
  if packed:
    batch, _ = packing.pack_batch(batch)
  batch = jax.tree.map(jnp.asarray, batch)
  plain = StepConfig(learning_rate=1e-2, num_iterations=2, logprob_chunk=8)
  exact = dataclasses.replace(plain, old_logprobs_from_sampler=True)
  prepared = {}
  for name, config in (("plain", plain), ("exact", exact)):
    step = TrainStep(graphdef, config)
    prepared[name] = jax.jit(step._prepare)(step.init_state(params), batch)
  np.testing.assert_array_equal(bits(prepared["exact"]["old_logprobs"]),
                                bits(batch["behavior_logprobs"]))
  # the plain step recomputes π_old: the trainer's own numbers, not the shifted ones
  mask = np.asarray(batch["completion_mask"]) > 0
  np.testing.assert_allclose(np.asarray(prepared["plain"]["old_logprobs"])[mask] + 0.25,
                             np.asarray(batch["behavior_logprobs"])[mask], atol=1e-5)


@pytest.mark.parametrize("asynchronous, expected", [(False, True), (True, False)])
def test_only_synchronous_steps_take_pi_old_from_the_sampler(asynchronous, expected):
  from reasoning_rl.build import step_config
  layout = {"algo.packing": False, "algo.num_micro_batches": 1}
  config = debug_config(**{"rollout.exact_logprobs": True,
                           "async_rollouts.enabled": asynchronous, **layout})
  assert step_config(config).old_logprobs_from_sampler is expected
  assert step_config(debug_config(**layout)).old_logprobs_from_sampler is False


def test_exact_mode_refuses_what_it_does_not_cover():
  with pytest.raises(ConfigError, match=r"config\.rollout\.exact_logprobs=True: exact rollouts "
                                        r"verify single-turn"):
    from reasoning_rl import config as config_lib
    config_lib.validate(debug_config(**{"rollout.exact_logprobs": True,
                                        "environment.name": "guess_number"}), num_devices=8)
  from reasoning_rl import config as config_lib

  lora = {"rollout.exact_logprobs": True, "lora.rank": 4}
  with pytest.raises(ConfigError, match=r"config\.lora\.sampler_weights='merged': exact rollouts "
                                        r".*set lora\.sampler_weights='adapters'"):
    config_lib.validate(debug_config(**lora, **{"lora.sampler_weights": "merged"}),
                        num_devices=8)
  config_lib.validate(debug_config(**lora), num_devices=8)  # adapters: the trainer's weights


def test_smollm2_exact_logprobs_are_batch_invariant(smollm2):
  model, tokenizer = smollm2
  scorer = CanonicalScorer(nnx.graphdef(model), max_prompt_length=24, max_completion_length=8)
  prompts = [tokenizer.encode(q, add_special_tokens=False)
             for q in ("What is 17 + 25?", "Name a colour.", "2 + 2 =", "The sea is")]
  runs = []
  for slots, steps in ((1, 2), (4, 8)):
    engine = Engine(model, max_concurrent_decodes=slots, max_prefill_length=24,
                    max_decode_length=8, steps_per_call=steps)
    runs.append(sorted(exact_groups(engine, scorer, prompts, num_samples=2, sampling=WARPED,
                                    max_new_tokens=8, seed=0),
                       key=lambda c: (c.prompt_id, c.sample_index)))
  for a, b in zip(*runs):
    assert a.completion_ids == b.completion_ids
    np.testing.assert_array_equal(bits(a.logprobs), bits(b.logprobs))
    np.testing.assert_array_equal(bits(a.sampling_logprobs), bits(b.sampling_logprobs))
  # the numbers are π's log-probs: the trainer's own recomputation (rl/logprobs, not the scorer
  # that produced them), one sequence at a time. Two differently fused float32 forwards of 30
  # layers agree to ~1e-5 here; a log-prob of the wrong position or distribution is off by >0.1
  for c in runs[0][:3]:
    tokens = jnp.asarray([list(c.prompt_tokens) + list(c.completion_ids)])
    reference, _ = completion_logprobs(model, tokens, jnp.ones_like(tokens),
                                       len(c.completion_ids))
    np.testing.assert_allclose(c.logprobs, np.asarray(reference[0]), atol=1e-4, rtol=0)
