"""`Engine.insert_many` leaves the decode state `insert` one at a time leaves, in one program call
per cache bucket (one per prefix on a CPU, where `insert` writes its row in place and a batched
program did not pay for its compiling); rollouts place their slots with it; bad arguments fail
in one clear line."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.errors import SamplingError
from reasoning_rl.models.transformer import create_model
from reasoning_rl.sampler import Engine, SamplingParams, generate_groups, sample_key
from reasoning_rl.sampler.paged import PagedEngine
from tests.support.sampler import CONFIG, PROMPTS, by_key

SLOTS = 6


def make_engine(dtype=jnp.float32, scan_layers=False):
  model = create_model(CONFIG, seed=3, dtype=dtype, scan_layers=scan_layers)
  return Engine(model, max_concurrent_decodes=SLOTS, max_prefill_length=32, max_decode_length=8,
                steps_per_call=4)


def request(engine, index):
  return engine.make_request(key=sample_key(0, index, 0),
                             sampling=SamplingParams(temperature=0.7 + 0.05 * index),
                             max_new_tokens=2 + index % 6, stop_ids=(index,))


def placements(engine):
  """(prefix, slot) pairs: two prompts of one bucket (the first twice, as two samples), two of
  another (one twice); five entries, so one group is padded to a power of two."""
  def prefilled(prompts):
    prepared = [engine.prepare_prompt(p) for p in prompts]
    return engine.prefill_many(params=engine.params, padded_tokens=[p for p, _ in prepared],
                               true_lengths=[n for _, n in prepared],
                               requests=[request(engine, 0)] * len(prompts))

  short, other_short = prefilled([PROMPTS[0], PROMPTS[4]])  # 5 and 3 tokens
  long, other_long = prefilled([PROMPTS[2], PROMPTS[5]])  # 20 and 13 tokens
  assert short.cache.max_len != long.cache.max_len
  chosen = [short, long, short, other_short, other_long, long]
  return [prefix.with_request(request(engine, i)) for i, prefix in enumerate(chosen)], \
      [4, 0, 2, 5, 1, 3]


def used_state(engine, backend):
  """A decode state whose slots held longer prompts and decoded: an insert must leave their
  entries past its own bucket unread (positions -1), whatever they hold."""
  state = engine.init_decode_state()
  prompt = list(range(40, 70))
  padded, length = engine.prepare_prompt(prompt)
  prefix, _ = engine.prefill(params=engine.params, padded_tokens=padded, true_length=length,
                             request=request(engine, 9))
  with as_backend(backend):
    for slot in range(SLOTS):
      state = engine.insert(prefix, state, slot)
  state, _ = engine.generate(engine.params, state)
  return state


@contextlib.contextmanager
def as_backend(name):
  """The engine's writes traced as on backend `name` (run on this CPU): only around inserts,
  whose programs are compiled on their first call under it."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(jax, "default_backend", lambda: name)
    yield


def host(state):
  leaves = jax.tree.leaves(state)
  return [np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
                     else a) for a in leaves]


@pytest.mark.parametrize("dtype,scan_layers,backend", [
    (jnp.float32, False, "cpu"), (jnp.bfloat16, False, "cpu"), (jnp.float32, True, "cpu"),
    (jnp.bfloat16, True, "cpu"), (jnp.float32, False, "gpu"), (jnp.bfloat16, True, "gpu")])
def test_insert_many_leaves_the_state_inserts_one_at_a_time_leave(dtype, scan_layers, backend):
  """Against dynamic-update-slice inserts one at a time (what any backend's `insert` computed
  before, traced as on a GPU): insert_many's inserts one at a time on a CPU (rows written in
  place; selects over 16-bit words for a 2-byte cache), its scatter (elsewhere)."""
  reference = make_engine(dtype, scan_layers)
  prefixes, slots = placements(reference)
  want = used_state(reference, "gpu")
  with as_backend("gpu"):
    for prefix, slot in zip(prefixes, slots):
      want = reference.insert(prefix, want, slot)

  engine = make_engine(dtype, scan_layers)
  prefixes, slots = placements(engine)
  state = used_state(engine, backend)
  calls, inserts = engine.num_insert_calls, engine.num_inserts
  with as_backend(backend):
    got = engine.insert_many(prefixes, state, slots)
  one_at_a_time = backend == "cpu"
  assert engine.num_insert_calls - calls == (len(prefixes) if one_at_a_time else 2)
  assert engine.num_inserts - inserts == len(prefixes)
  for got_leaf, want_leaf in zip(host(got), host(want), strict=True):
    np.testing.assert_array_equal(got_leaf, want_leaf)
  # and the slots decode the same tokens
  _, got_tokens = engine.generate(engine.params, got)
  _, want_tokens = reference.generate(reference.params, want)
  np.testing.assert_array_equal(got_tokens.to_host().tokens, want_tokens.to_host().tokens)


def test_a_single_prefix_of_a_bucket_takes_the_single_insert():
  engine = make_engine()
  prefixes, slots = placements(engine)
  calls = engine.num_insert_calls
  with as_backend("gpu"):
    engine.insert_many(prefixes[:2], engine.init_decode_state(), slots[:2])  # one per bucket
  assert engine.num_insert_calls - calls == 2


@pytest.mark.parametrize("slots,message", [
    ([0, 0], "repeat one"), ([0, SLOTS], f"must be in \\[0, {SLOTS}\\)"),
    ([-1, 1], "must be in"), ([0], "2 prefixes and 1 slots")])
def test_bad_slots_fail_in_one_line(slots, message):
  engine = make_engine()
  prefixes, _ = placements(engine)
  with pytest.raises(SamplingError, match=message):
    engine.insert_many(prefixes[:2], engine.init_decode_state(), slots)


def test_rollouts_place_their_slots_in_few_calls_and_sample_as_before():
  """The rollout's first fill places every slot at once (traced as on a GPU); its samples are
  those of an engine that inserts one at a time (the paged engine's path, forced here on a
  plain engine)."""
  batched = make_engine()
  single = make_engine()
  single.inserts_many_at_once = False  # fill_free_slots then inserts one by one
  runs = {}
  for name, engine in (("batched", batched), ("single", single)):
    calls = engine.num_insert_calls
    with as_backend("gpu"):
      out = generate_groups(engine, PROMPTS[:3], num_samples=2, max_new_tokens=6, seed=5,
                            sampling=SamplingParams(temperature=1.0))
    runs[name] = (engine.num_insert_calls - calls, by_key(out))
  assert runs["single"][0] == 6
  assert runs["batched"][0] < 6
  assert {k: c.completion_ids for k, c in runs["batched"][1].items()} == \
      {k: c.completion_ids for k, c in runs["single"][1].items()}


def test_the_paged_engine_inserts_one_at_a_time():
  model = create_model(CONFIG, seed=3)
  engine = PagedEngine(model, max_concurrent_decodes=SLOTS, max_prefill_length=32,
                       max_decode_length=8, steps_per_call=4, page_size=8)
  assert engine.inserts_many_at_once is False
  prefixes, slots = placements(engine)
  calls = engine.num_insert_calls
  engine.insert_many(prefixes, engine.init_decode_state(), slots)
  assert engine.num_insert_calls - calls == len(prefixes)
