"""Sampler throughput changes keep what is sampled: early return and refill, batched prefill,
live-length attention and live-slot decoding, on a tiny random model.

References: the uncached training forward (greedy), an engine with every change turned off and one
slot (so nothing is shared, compacted or cut short), and prompts prefilled one at a time.
"""

import heapq

import jax
import numpy as np
import pytest

from reasoning_rl.errors import SamplingError
from reasoning_rl.models.transformer import KVCache
from reasoning_rl.sampler import Engine, SamplingParams, generate_groups, sample_key
from reasoning_rl.sampler.engine import prompt_bucket
from tests.support.sampler import GREEDY, PROMPTS, full_forward_greedy, tiny_model


SIZES = dict(max_prefill_length=32, max_decode_length=16)
PLAIN = dict(live_length_attention=False, compact_live_slots=False, max_prefill_batch=1)


@pytest.fixture(scope="module")
def model():
  return tiny_model(1)


@pytest.fixture(scope="module")
def reference(model):
  """One slot, every throughput change off."""
  return Engine(model, max_concurrent_decodes=1, steps_per_call=16, **PLAIN, **SIZES)


@pytest.fixture(scope="module")
def engine(model):
  return Engine(model, max_concurrent_decodes=4, steps_per_call=16, max_prefill_batch=4, **SIZES)


@pytest.fixture(scope="module")
def stop_ids(reference):
  """Tokens that end the greedy completions of PROMPTS at different lengths."""
  out = generate_groups(reference, PROMPTS, sampling=GREEDY, max_new_tokens=12)
  return list(dict.fromkeys(out[i].completion_ids[at] for i, at in enumerate((1, 4, 7, 10))))


def count_steps(engine):
  """Wraps engine.generate to record each call's decode steps; returns the list."""
  steps, generate = [], engine.generate

  def counted(params, state, **kwargs):
    state, result = generate(params, state, **kwargs)
    steps.append(int(result.num_steps))
    return state, result

  engine.generate = counted
  return steps


def list_schedule_makespan(lengths, slots):
  """Steps to run requests in order on `slots` slots when a freed slot takes the next at once."""
  free_at = [0] * slots
  for length in lengths:
    heapq.heappush(free_at, heapq.heappop(free_at) + length)
  return max(free_at)


def test_mixed_length_greedy_groups_are_token_identical(model, engine, reference, stop_ids):
  kwargs = dict(sampling=GREEDY, max_new_tokens=12, stop_ids=stop_ids)
  alone = generate_groups(reference, PROMPTS, **kwargs)
  lengths = [len(c.completion_ids) for c in alone]
  assert len(set(lengths)) > 2, "the stop id should end completions at several lengths"
  batched = generate_groups(engine, PROMPTS, num_samples=2, **kwargs)
  assert len(batched) == 2 * len(PROMPTS)
  for c in batched:
    one = alone[c.prompt_id]
    assert c.completion_ids == one.completion_ids
    assert c.completion_ids == full_forward_greedy(model, PROMPTS[c.prompt_id], 12)[:len(
        c.completion_ids)]
    np.testing.assert_allclose(c.logprobs, one.logprobs, atol=1e-5)
    assert (c.finish_reason, c.truncated) == (one.finish_reason, one.truncated)


def test_sampled_groups_match_the_reference_engine(engine, reference, stop_ids):
  kwargs = dict(num_samples=3, sampling=SamplingParams(temperature=1.0), max_new_tokens=14,
                stop_ids=stop_ids, seed=5)
  alone = generate_groups(reference, PROMPTS, **kwargs)
  batched = generate_groups(engine, PROMPTS, **kwargs)
  assert len({len(c.completion_ids) for c in alone}) > 3
  for one, many in zip(alone, batched):
    assert (many.prompt_id, many.sample_index) == (one.prompt_id, one.sample_index)
    assert many.completion_ids == one.completion_ids
    np.testing.assert_allclose(many.logprobs, one.logprobs, atol=1e-5)


def test_a_finished_slot_takes_the_next_request_at_once(model, reference, stop_ids):
  kwargs = dict(sampling=GREEDY, max_new_tokens=12, stop_ids=stop_ids)
  lengths = [len(c.completion_ids) for c in generate_groups(reference, PROMPTS, **kwargs)]
  engine = Engine(model, max_concurrent_decodes=3, steps_per_call=16, **SIZES)
  steps = count_steps(engine)
  generate_groups(engine, PROMPTS, **kwargs)
  # Chunks of 16 steps exceed every completion: a slot freed mid-chunk would idle until the chunk
  # ends (or every slot is done) unless the call returns at once so the host refills it.
  assert sum(steps) == list_schedule_makespan(lengths, 3)
  refill_when_all_done = sum(max(lengths[i:i + 3]) for i in range(0, len(lengths), 3))
  assert sum(steps) < refill_when_all_done  # the old schedule, with these chunks, would fail


def test_generate_stops_when_every_slot_is_done_or_one_finishes(model):
  engine = Engine(model, max_concurrent_decodes=4, steps_per_call=16, **SIZES)

  def filled_state():
    state = engine.init_decode_state()
    for slot, (prompt, budget) in enumerate([(PROMPTS[0], 3), (PROMPTS[1], 5)]):
      request = engine.make_request(key=sample_key(0, slot, 0), sampling=GREEDY,
                                    max_new_tokens=budget)
      padded, length = engine.prepare_prompt(prompt)
      prefix, _ = engine.prefill(params=engine.params, padded_tokens=padded, true_length=length,
                                 request=request)
      state = engine.insert(prefix, state, slot)
    return state

  state, whole = engine.generate(engine.params, filled_state())
  whole = whole.to_host()
  assert int(whole.num_steps) == 5  # not 16: the loop ends once both slots are done
  assert whole.valid[:, 5:].sum() == 0 and whole.valid[:2].sum(1).tolist() == [3, 5]
  assert whole.done.all()

  state, first = engine.generate(engine.params, filled_state(), return_on_finish=True)
  first = first.to_host()
  assert int(first.num_steps) == 3 and first.done.tolist() == [True, False, True, True]
  state, rest = engine.generate(engine.params, state, return_on_finish=True)
  rest = rest.to_host()
  assert int(rest.num_steps) == 2
  resumed = np.concatenate([first.tokens[1, :3], rest.tokens[1, :2]])
  np.testing.assert_array_equal(resumed, whole.tokens[1, :5])


def test_batched_prefill_equals_one_by_one(model):
  engine = Engine(model, max_concurrent_decodes=2, steps_per_call=4, max_prefill_batch=4, **SIZES)
  prompts = PROMPTS[:5]
  prepared = [engine.prepare_prompt(p) for p in prompts]
  requests = [engine.make_request(key=sample_key(0, i, 0), sampling=GREEDY, max_new_tokens=4)
              for i in range(len(prompts))]
  calls, counted = engine.num_prefill_calls, engine.num_prefills
  batched = engine.prefill_many(params=engine.params, padded_tokens=[p for p, _ in prepared],
                                true_lengths=[n for _, n in prepared], requests=requests)
  assert engine.num_prefill_calls - calls == 2  # 4 prompts, then 1
  assert engine.num_prefills - counted == 5
  assert engine.prefill_rows(3) == 4 and engine.prefill_rows(9) == 4
  for (padded, length), request, prefix in zip(prepared, requests, batched):
    alone, _ = engine.prefill(params=engine.params, padded_tokens=padded, true_length=length,
                              request=request)
    assert int(prefix.length) == int(alone.length) == length
    np.testing.assert_allclose(prefix.logits, alone.logits, atol=1e-5)
    assert int(np.argmax(prefix.logits)) == int(np.argmax(alone.logits))
    np.testing.assert_array_equal(prefix.cache.pos[0, :length], alone.cache.pos[0, :length])
    assert (np.asarray(prefix.cache.pos[0, length:]) == -1).all()
    many, one = prefix.cache.first_entries(length), alone.cache.first_entries(length)
    for k_many, k_one in zip(many.k + many.v, one.k + one.v):
      np.testing.assert_allclose(k_many, k_one, atol=1e-5)
  with pytest.raises(SamplingError, match="true_lengths"):
    engine.prefill_many(params=engine.params, padded_tokens=[prepared[0][0]], true_lengths=[],
                        requests=requests[:1])
  with pytest.raises(SamplingError, match="max_prefill_batch"):
    Engine(model, max_prefill_batch=0)


def test_prompt_buckets_are_two_per_octave():
  buckets = {n: prompt_bucket(n, 1 << 20) for n in (1, 16, 17, 24, 25, 33, 48, 49, 96, 97, 700)}
  assert buckets == {1: 16, 16: 16, 17: 24, 24: 24, 25: 32, 33: 48, 48: 48, 49: 64, 96: 96,
                     97: 128, 700: 768}
  assert prompt_bucket(70, 64) == 64 and prompt_bucket(3, 64, min_bucket=1) == 3
  engine = Engine(tiny_model(1), max_concurrent_decodes=1, **SIZES)
  padded, length = engine.prepare_prompt(list(range(1, 18)))
  assert (padded.size, length) == (24, 17) and not padded[17:].any()


def test_waiting_prompts_join_a_prefill_call(model, reference, stop_ids):
  """Each prompt is still prefilled once, but the prompts later refills need join the call of
  the ones needed now (up to max_prefill_batch): fewer calls, the same completions."""
  engine = Engine(model, max_concurrent_decodes=2, steps_per_call=16, max_prefill_batch=4,
                  **SIZES)
  kwargs = {"num_samples": 2, "sampling": SamplingParams(temperature=1.0), "max_new_tokens": 10,
            "stop_ids": stop_ids, "seed": 3}
  calls, prefills = engine.num_prefill_calls, engine.num_prefills
  batched = generate_groups(engine, PROMPTS, **kwargs)
  assert engine.num_prefills - prefills == len(PROMPTS)
  assert engine.num_prefill_calls - calls == -(-len(PROMPTS) // 4)  # not one per prompt
  for one, many in zip(generate_groups(reference, PROMPTS, **kwargs), batched):
    assert (many.prompt_id, many.sample_index) == (one.prompt_id, one.sample_index)
    assert many.completion_ids == one.completion_ids
    np.testing.assert_allclose(many.logprobs, one.logprobs, atol=1e-5)


def test_decode_plan_reads_only_the_live_part(model):
  engine = Engine(model, max_concurrent_decodes=8, steps_per_call=4, **SIZES)
  assert engine.cache_length == 48
  state = engine.init_decode_state()
  request = engine.make_request(key=sample_key(0, 0, 0), sampling=GREEDY, max_new_tokens=16)
  for slot, prompt in ((1, PROMPTS[0]), (6, PROMPTS[1]), (3, PROMPTS[5])):
    padded, length = engine.prepare_prompt(prompt)
    prefix, _ = engine.prefill(params=engine.params, padded_tokens=padded, true_length=length,
                               request=request)
    state = engine.insert(prefix, state, slot)
  rows, key_length = engine.decode_plan(state)
  assert key_length == 32  # longest live prompt 13 tokens + 4 steps -> 17 -> 32 of 48
  np.testing.assert_array_equal(rows, [1, 3, 6, 0])  # the live slots, padded with a done one
  state = engine.release(engine.release(state, 1), 3)
  rows, key_length = engine.decode_plan(state)
  assert rows.tolist() == [6] and key_length == 16  # 2 + 4 -> 8, raised to the smallest bucket
  full = Engine(model, max_concurrent_decodes=8, steps_per_call=4, **PLAIN, **SIZES)
  assert full.decode_plan(state) == (None, 48)


def test_live_slots_get_every_step_of_a_call(model):
  def first_slot_tokens(engine):
    request = engine.make_request(key=sample_key(0, 0, 0), sampling=GREEDY, max_new_tokens=16)
    padded, length = engine.prepare_prompt(PROMPTS[5])  # 13 tokens
    prefix, _ = engine.prefill(params=engine.params, padded_tokens=padded, true_length=length,
                               request=request)
    state = engine.insert(prefix, engine.init_decode_state(), 0)
    steps, tokens, logprobs, done = [], [], [], False
    while not done:
      state, result = engine.generate(engine.params, state)
      result = result.to_host()
      steps.append(int(result.num_steps))
      tokens += result.tokens[0, :steps[-1]].tolist()
      logprobs += result.logprobs[0, :steps[-1]].tolist()
      done = bool(result.done[0])
    return steps, tokens, logprobs

  live_steps, live_tokens, live_logprobs = first_slot_tokens(
      Engine(model, max_concurrent_decodes=2, steps_per_call=16, **SIZES))
  full_steps, full_tokens, full_logprobs = first_slot_tokens(
      Engine(model, max_concurrent_decodes=2, steps_per_call=16, **PLAIN, **SIZES))
  # JetStream's Driver reads an invalid token as the end of a request: a live slot must get all
  # steps_per_call tokens of a call (here from cache slots below 32 of 48).
  assert live_steps == full_steps == [16]
  assert live_tokens == full_tokens
  np.testing.assert_allclose(live_logprobs, full_logprobs, atol=1e-5)


@pytest.mark.parametrize("changes", [dict(live_length_attention=True),
                                     dict(compact_live_slots=True)])
def test_each_change_alone_keeps_tokens_and_logprobs(model, reference, stop_ids, changes):
  engine = Engine(model, max_concurrent_decodes=4, steps_per_call=5,
                  **{**PLAIN, **changes}, **SIZES)
  kwargs = dict(num_samples=2, sampling=SamplingParams(temperature=1.0, top_k=30),
                max_new_tokens=16, stop_ids=stop_ids, seed=2)
  alone = generate_groups(reference, PROMPTS, **kwargs)
  many = generate_groups(engine, PROMPTS, **kwargs)
  for one, c in zip(alone, many):
    assert c.completion_ids == one.completion_ids
    np.testing.assert_allclose(c.logprobs, one.logprobs, atol=1e-5)
    np.testing.assert_allclose(c.sampling_logprobs, one.sampling_logprobs, atol=1e-5)


def test_decode_with_key_length_equals_the_whole_cache(model):
  prompt = np.array([PROMPTS[2][:12]], np.int32)
  cache = KVCache.init(model.config, 1, 40)
  _, cache = model.decode(prompt, np.arange(12)[None], cache, np.zeros(1, np.int32))
  token, position = np.array([[7]], np.int32), np.array([[12]], np.int32)
  full, _ = model.decode(token, position, cache, np.array([12], np.int32))
  short, _ = model.decode(token, position, cache, np.array([12], np.int32), key_length=16)
  log_softmax = jax.nn.log_softmax
  np.testing.assert_allclose(log_softmax(short), log_softmax(full), atol=1e-5)
  cut, _ = model.decode(token, position, cache, np.array([12], np.int32), key_length=8)
  assert not np.allclose(log_softmax(cut), log_softmax(full), atol=1e-3)  # keys 8..12 matter
