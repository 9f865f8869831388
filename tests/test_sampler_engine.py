"""Engine and group rollouts on a tiny random model: references are the model's own full forward
(greedy continuation recomputed without a cache), one-request-at-a-time runs, and the trainer's
`completion_logprobs`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reasoning_rl import sharding
from reasoning_rl.errors import SamplingError
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.sampler import Engine, SamplingParams, generate_groups
from reasoning_rl.sampler.rollout import find_stop_string
from tests.support.sampler import (
    AngleTokenizer, GREEDY, PROMPTS, by_key, full_forward_greedy, tiny_model)


@pytest.fixture(scope="module")
def model():
  return tiny_model(1)


@pytest.fixture(scope="module")
def engine(model):
  return Engine(model, max_concurrent_decodes=3, max_prefill_length=32, max_decode_length=16,
                steps_per_call=4)


@pytest.fixture(scope="module")
def single_slot_engine(model):
  return Engine(model, max_concurrent_decodes=1, max_prefill_length=32, max_decode_length=16,
                steps_per_call=4)


def test_greedy_matches_uncached_forward_and_flags_truncation(model, engine):
  out = generate_groups(engine, PROMPTS[:3], sampling=GREEDY, max_new_tokens=10)
  assert [(c.prompt_id, c.sample_index) for c in out] == [(0, 0), (1, 0), (2, 0)]
  for c, prompt in zip(out, PROMPTS[:3]):
    assert c.completion_ids == full_forward_greedy(model, prompt, 10)
    assert c.prompt_tokens == prompt
    assert (c.finish_reason, c.truncated) == ("length", True)
    assert c.sampling_logprobs == [0.0] * 10  # greedy draws from a point mass


def test_one_prefill_per_prompt_for_a_group(engine):
  before = (engine.num_prefills, engine.num_inserts)
  out = generate_groups(engine, PROMPTS[:3], num_samples=4, max_new_tokens=6, seed=7)
  assert engine.num_prefills - before[0] == 3  # one per prompt, not one per sample
  assert engine.num_inserts - before[1] == 12
  assert sorted(by_key(out)) == [(p, g) for p in range(3) for g in range(4)]
  # The four samples of a prompt differ (distinct keys), all from the same shared prefix.
  for p in range(3):
    assert len({tuple(c.completion_ids) for c in out if c.prompt_id == p}) > 1


def test_continuous_batching_equals_one_at_a_time(engine, single_slot_engine):
  alone = [generate_groups(single_slot_engine, [p], sampling=GREEDY, max_new_tokens=12)[0]
           for p in PROMPTS]
  # A stop id that ends some completions early, so slots free up at different times.
  stop_id = alone[0].completion_ids[3]
  alone = [generate_groups(single_slot_engine, [p], sampling=GREEDY, max_new_tokens=12,
                           stop_ids=[stop_id])[0] for p in PROMPTS]
  lengths = {len(c.completion_ids) for c in alone}
  assert len(lengths) > 1, "the stop id should end completions at different lengths"
  batched = generate_groups(engine, PROMPTS, sampling=GREEDY, max_new_tokens=12,
                            stop_ids=[stop_id])
  assert len(batched) == len(PROMPTS) > engine.max_concurrent_decodes
  for one, many in zip(alone, batched):
    assert many.completion_ids == one.completion_ids
    np.testing.assert_allclose(many.logprobs, one.logprobs, atol=1e-5)
    assert many.finish_reason == one.finish_reason
    assert many.finish_reason == ("stop_id" if many.completion_ids[-1] == stop_id else "length")
    assert many.truncated == (many.finish_reason == "length")


def test_sampling_is_independent_of_slots_and_order(engine, single_slot_engine):
  kwargs = dict(num_samples=2, sampling=SamplingParams(temperature=1.0, top_k=20),
                max_new_tokens=8, seed=3)
  prompts, ids = PROMPTS[:4], [10, 11, 12, 13]
  forward = by_key(generate_groups(engine, prompts, prompt_ids=ids, **kwargs))
  backward = by_key(generate_groups(engine, prompts[::-1], prompt_ids=ids[::-1], **kwargs))
  alone = by_key(generate_groups(single_slot_engine, prompts, prompt_ids=ids, **kwargs))
  assert sorted(forward) == sorted(backward) == sorted(alone)
  for key, c in forward.items():
    assert c.completion_ids == backward[key].completion_ids == alone[key].completion_ids
    np.testing.assert_allclose(c.logprobs, alone[key].logprobs, atol=1e-5)
    assert len(c.sampling_logprobs) == len(c.completion_ids)
  other_seed = by_key(generate_groups(engine, prompts, prompt_ids=ids, **{**kwargs, "seed": 4}))
  assert any(other_seed[k].completion_ids != c.completion_ids for k, c in forward.items())


def test_stop_string_cuts_after_the_completing_token(model, engine):
  reference = full_forward_greedy(model, PROMPTS[2], 12)
  cut_at = 6  # the stop string is completed by token 6 (1-based) and spans tokens 5 and 6
  stop = f"{reference[cut_at - 2]}><{reference[cut_at - 1]}>"
  first = next(i for i in range(1, 13) if stop in AngleTokenizer().decode(reference[:i]))
  out = generate_groups(engine, [PROMPTS[2]], sampling=GREEDY, max_new_tokens=12,
                        stop_strings=[stop], tokenizer=AngleTokenizer())[0]
  assert out.completion_ids == reference[:first]
  assert len(out.logprobs) == first
  assert (out.finish_reason, out.truncated) == ("stop_string", False)
  assert find_stop_string(AngleTokenizer(), [1, 2, 3], ["<9>"]) is None


def test_logprobs_equal_the_training_forward(model, engine):
  out = generate_groups(engine, PROMPTS[:4], num_samples=2, max_new_tokens=10, seed=1,
                        sampling=SamplingParams(temperature=0.8, top_p=0.9))
  prompt_len = max(len(c.prompt_tokens) for c in out)
  length = max(len(c.completion_ids) for c in out)
  tokens = np.zeros((len(out), prompt_len + length), np.int32)
  mask = np.zeros_like(tokens)
  for row, c in enumerate(out):
    tokens[row, prompt_len - len(c.prompt_tokens):prompt_len] = c.prompt_tokens
    tokens[row, prompt_len:prompt_len + len(c.completion_ids)] = c.completion_ids
    mask[row, prompt_len - len(c.prompt_tokens):prompt_len + len(c.completion_ids)] = 1
  trainer, _ = completion_logprobs(model, jnp.asarray(tokens), jnp.asarray(mask), length)
  for row, c in enumerate(out):
    np.testing.assert_allclose(c.logprobs, trainer[row, :len(c.logprobs)], atol=1e-4)
    # The sampling distribution (T=0.8, top-p 0.9) is sharper: log-probs differ from the model's.
    assert not np.allclose(c.sampling_logprobs, c.logprobs, atol=1e-3)


@pytest.mark.parametrize("prompts, kwargs, field", [
    ([[]], {}, "empty"),
    ([list(range(1, 40))], {}, "max_prefill_length"),
    ([[1, 2]], dict(max_new_tokens=17), "max_new_tokens"),
    ([[1, 2]], dict(num_samples=0), "num_samples"),
    ([[1, 200]], {}, "token ids"),
    ([[1, 2]], dict(stop_strings=["</answer>"]), "tokenizer"),
])
def test_bad_requests_raise_before_decoding(engine, prompts, kwargs, field):
  kwargs = {"max_new_tokens": 4, **kwargs}
  calls = engine.num_generate_calls
  with pytest.raises(SamplingError, match=field):
    generate_groups(engine, prompts, **kwargs)
  assert engine.num_generate_calls == calls


def test_left_truncation_keeps_the_tail(model):
  engine = Engine(model, max_concurrent_decodes=1, max_prefill_length=16, max_decode_length=4,
                  steps_per_call=4, truncation="left")
  long_prompt = list(range(1, 40))
  out = generate_groups(engine, [long_prompt], sampling=GREEDY, max_new_tokens=4)[0]
  assert out.prompt_tokens == long_prompt[-16:]
  assert out.completion_ids == full_forward_greedy(model, long_prompt[-16:], 4)


def test_update_params_moves_trainer_weights_onto_the_sampler_slice(model):
  trainer_devices, sampler_devices = sharding.split_devices(4)
  assert len(jax.devices()) == 8
  trainer_mesh = sharding.make_mesh((1, 2, 2), trainer_devices)
  sampler_mesh = sharding.make_mesh((1, 2, 2), sampler_devices)
  trainer_state = nnx.state(model)
  trainer_state = sharding.reshard(trainer_state,
                                   sharding.param_shardings(trainer_state, trainer_mesh))
  engine = Engine(tiny_model(2), mesh=sampler_mesh, max_concurrent_decodes=4,
                  max_prefill_length=32, max_decode_length=8, steps_per_call=4)
  assert engine.policy_version == 0
  engine.update_params(trainer_state)
  assert engine.policy_version == 1
  for before, after in zip(jax.tree.leaves(trainer_state), jax.tree.leaves(engine.params)):
    assert set(after.sharding.device_set) <= set(sampler_devices)
    np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
  out = generate_groups(engine, PROMPTS[:5], sampling=GREEDY, max_new_tokens=8)
  for c, prompt in zip(out, PROMPTS):
    assert c.completion_ids == full_forward_greedy(model, prompt, 8)
    assert c.policy_version == 1


def test_a_stop_request_abandons_the_call_before_the_next_decode_call(single_slot_engine):
  """`should_stop` is asked before every decode call: with one slot and 3 prompts there are
  several calls; a request after the first ends the call there, with nothing yielded after."""
  from reasoning_rl.errors import PhaseInterrupted

  asked = []

  def should_stop():
    asked.append(True)
    return len(asked) > 1

  with pytest.raises(PhaseInterrupted, match="after 1 decode calls"):
    generate_groups(single_slot_engine, PROMPTS[:3], sampling=GREEDY, max_new_tokens=4,
                    should_stop=should_stop)
  assert len(asked) == 2
  # asked before every call but never stopping: the call runs to the end
  assert len(generate_groups(single_slot_engine, PROMPTS[:3], sampling=GREEDY, max_new_tokens=4,
                             should_stop=lambda: False)) == 3
