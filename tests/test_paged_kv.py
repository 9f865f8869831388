"""The paged KV cache (reasoning_rl/sampler/paged.py): the same tokens and log-probs as the
contiguous engine, a group's prompt pages shared, pages returned and reused, a full pool refused
with the field to raise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.errors import SamplingError
from reasoning_rl.models.transformer import stack_layers
from reasoning_rl.sampler import Engine, SamplingParams, generate_groups
from reasoning_rl.models.kv_pages import PagedKVCache
from reasoning_rl.sampler.paged import PagedEngine, PageTable, gather_pages, scatter_pages
from tests.support.sampler import (
    CONFIG, GREEDY, IDS, KWARGS, PROMPTS, by_key, run_rounds, tiny_model)


SIZES = dict(max_concurrent_decodes=3, max_prefill_length=32, max_decode_length=16,
             steps_per_call=4)


@pytest.fixture(scope="module")
def model():
  return tiny_model(1)


@pytest.fixture(scope="module")
def contiguous(model):
  return Engine(model, **SIZES)


@pytest.fixture(scope="module")
def paged_engines(model):
  """Pages of 4 (prompts span several, most end in a partial page) and of 16."""
  return {size: PagedEngine(model, page_size=size, **SIZES) for size in (4, 16)}


def assert_same_completions(ours, reference, atol=2e-5):
  # Two compiled decode programs (pages gathered or a contiguous cache): not bit-identical on
  # every CPU (an AVX2 EPYC's paged π_old rounded unlike the contiguous one's, test_trainer).
  # A log-softmax over 97 logits of size ~1-6 rounds by up to ~97 · 6e-8 ≈ 6e-6, so 2e-6 was
  # below float32's own slack (0 here); 2e-5 is the bound of this file's other paged-vs-contiguous
  # checks. A stale page entry read (k_pos off by one) moves log-probs by > 1e-3.
  assert [c.completion_ids for c in ours] == [c.completion_ids for c in reference]
  assert [c.finish_reason for c in ours] == [c.finish_reason for c in reference]
  for a, b in zip(ours, reference):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=atol)


@pytest.mark.parametrize("page_size, sampling, num_samples", [
    (4, GREEDY, 1), (4, SamplingParams(temperature=1.0, top_p=0.9), 3), (16, GREEDY, 2)])
def test_the_paged_engine_decodes_as_the_contiguous_one(paged_engines, contiguous, page_size,
                                                        sampling, num_samples):
  """7 prompts x 1–3 samples through 3 slots: pages are freed and taken again many times (a
  page comes back holding its last owner's entries), and the tail decodes few live slots."""
  paged = paged_engines[page_size]
  kwargs = dict(num_samples=num_samples, sampling=sampling, max_new_tokens=14, seed=5)
  reference = generate_groups(contiguous, PROMPTS, **kwargs)
  ours = generate_groups(paged, PROMPTS, **kwargs)
  assert_same_completions(ours, reference)
  assert paged.pages.pages_in_use == 0  # every finished sample handed its pages back


def test_a_group_shares_its_prompt_pages(model):
  """A 13-token prompt in pages of 4 inserted into 4 slots: 3 full pages written once and
  shared, a partial page each (7 pages, not 16); they return as the slots are freed."""
  engine = PagedEngine(model, page_size=4, max_concurrent_decodes=4, max_prefill_length=32,
                       max_decode_length=16, steps_per_call=4)
  state = engine.init_decode_state()
  padded, length = engine.prepare_prompt(PROMPTS[5])
  assert length == 13
  request = engine.make_request(key=jax.random.key(3), sampling=GREEDY, max_new_tokens=8)
  prefix = engine.prefill_many(params=engine.params, padded_tokens=[padded],
                               true_lengths=[length], requests=[request])[0]
  for slot in range(4):
    state = engine.insert(prefix.with_request(request), state, slot)
  held = engine.pages.slot_pages
  assert engine.pages.pages_in_use == 3 + 4
  assert all(pages[:3] == held[0][:3] for pages in held)
  assert len({pages[3] for pages in held}) == 4
  state, _ = engine.generate(engine.params, state)
  state, result = engine.generate(engine.params, state)
  # the same request in four slots decodes the same tokens: the shared pages hold the prompt
  tokens = np.asarray(result.tokens)
  assert (tokens == tokens[0]).all()
  for slot in range(3):
    engine.free_resource(slot)
  assert engine.pages.users[held[3][0]] == 1  # the last slot still reads the shared pages
  engine.free_resource(3)
  assert engine.pages.pages_in_use == 0 and not engine.pages.prefix_pages


def test_continued_samples_decode_as_the_uninterrupted_contiguous_run(paged_engines,
                                                                       contiguous):
  """Partial rollouts' rounds (each unfinished sample re-prefilled and its tokens appended to
  pages taken for them, `append_to_slot`) give the uninterrupted contiguous run's tokens."""
  whole = by_key(generate_groups(contiguous, PROMPTS[:4], prompt_ids=IDS, **KWARGS))
  pieces, rounds = run_rounds(paged_engines[4], PROMPTS[:4], calls_per_round=1)
  assert rounds >= 3
  for key, c in whole.items():
    assert pieces[key].completion_ids == c.completion_ids, key
    np.testing.assert_allclose(pieces[key].logprobs, c.logprobs, atol=2e-5)


def test_a_scanned_model_decodes_from_a_stacked_pool(model):
  scanned = stack_layers(model)
  kwargs = dict(num_samples=2, sampling=GREEDY, max_new_tokens=8)
  reference = generate_groups(Engine(scanned, **SIZES), PROMPTS[:3], **kwargs)
  paged = PagedEngine(scanned, page_size=8, **SIZES)
  assert not isinstance(paged.init_decode_state().cache.k, tuple)
  assert_same_completions(generate_groups(paged, PROMPTS[:3], **kwargs), reference)


def test_a_full_pool_is_refused_naming_the_field(model):
  """Inserting past the free pages (a caller that does not preempt) names the field to raise;
  a pool smaller than one slot's length is refused when the engine is built."""
  engine = PagedEngine(model, page_size=4, num_pages=12, **SIZES)  # one slot's whole length
  state = engine.init_decode_state()
  prompts = [engine.prepare_prompt(list(range(start, start + 20))) for start in (10, 40, 70)]
  request = engine.make_request(key=jax.random.key(0), sampling=GREEDY, max_new_tokens=4)
  prefixes = engine.prefill_many(params=engine.params, padded_tokens=[p for p, _ in prompts],
                                 true_lengths=[n for _, n in prompts], requests=[request] * 3)
  state = engine.insert(prefixes[0], state, 0)  # 20 tokens: 5 pages
  state = engine.insert(prefixes[0], state, 1)  # shared: no new page
  state = engine.insert(prefixes[1], state, 2)  # 5 more
  assert engine.pages.pages_in_use == 10 and not engine.has_room_for(prefixes[2])
  with pytest.raises(SamplingError, match=r"paged KV cache is full: .* rollout\.kv_pages"):
    engine.insert(prefixes[2], state, 1)
  for kwargs, field in ((dict(page_size=0), "page_size"), (dict(num_pages=-1), "num_pages"),
                        (dict(num_pages=5, page_size=4), "num_pages=5")):
    with pytest.raises(SamplingError, match=field):
      PagedEngine(model, **{**dict(page_size=4), **kwargs}, **SIZES)


def test_pages_gather_into_rows_and_scatter_back():
  """gather_pages / scatter_pages against a loop over the page table (pools [K, P, page, D];
  the contiguous keys length-last, [rows, K, D, S])."""
  rng = np.random.default_rng(0)
  pool = PagedKVCache.init(CONFIG, 6, 4, jnp.float32, stacked=False)
  values = rng.normal(size=pool.k[0].shape).astype(np.float32)
  pool = pool.replace(k=(jnp.asarray(values),) * CONFIG.num_layers,
                      pos=jnp.arange(24, dtype=jnp.int32).reshape(6, 4))
  table = np.array([[2, 0, -1], [5, 4, 3]], np.int32)
  view = gather_pages(pool, table)
  for r, pages in enumerate(table):
    for j, page in enumerate(pages):
      got_k = np.asarray(view.k[0][r, :, :, 4 * j:4 * j + 4]).swapaxes(1, 2)
      got_pos = np.asarray(view.pos[r, 4 * j:4 * j + 4])
      if page < 0:
        assert (got_pos == -1).all()
      else:
        np.testing.assert_array_equal(got_k, values[:, page])
        np.testing.assert_array_equal(got_pos, np.arange(4 * page, 4 * page + 4))
  changed = view.replace(k=tuple(a + 1 for a in view.k), pos=view.pos + 100)
  write = np.where(table >= 0, table, 6)
  write[1, 0] = 6  # row 1's first page is read-only
  back = scatter_pages(pool, write, changed)
  for page in range(6):
    written = page in (2, 0, 4, 3)
    np.testing.assert_array_equal(np.asarray(back.k[0][:, page]), values[:, page] + written)
    assert (np.asarray(back.pos[page]) >= 100).all() == written


def test_the_page_table_counts_users_of_shared_pages():
  table = PageTable(num_pages=8, page_size=4, slots=3)
  assert table.place_prompt(0, 9, share_id=7) == [0, 1, 2]  # 2 full pages, 1 partial
  assert table.place_prompt(1, 9, share_id=7) == [3]  # shares 0, 1
  assert table.place_prompt(2, 8, share_id=-1) == [4, 5]  # unshared, no partial page
  assert table.slot_pages == [[0, 1, 2], [0, 1, 3], [4, 5]]
  table.grow(1, 13)
  assert table.slot_pages[1] == [0, 1, 3, 6] and table.fresh == [6]
  assert list(table.take_fresh(3)) == [6, 8, 8] and table.fresh == []
  # slot 1 live: it writes its own pages only; slot 2 is done: it writes nothing
  read, write = table.tables([1, 2], np.array([False, True, False]), 4)
  assert read.tolist() == [[0, 1, 3, 6], [4, 5, -1, -1]]
  assert write.tolist() == [[8, 8, 3, 6], [8, 8, 8, 8]]
  table.release_slot(0)
  assert table.pages_in_use == 6 and 7 in table.prefix_pages  # slot 1 still holds 0 and 1
  table.release_slot(1)
  assert table.pages_in_use == 2 and not table.prefix_pages
  with pytest.raises(SamplingError, match="needs 7 more pages, 6 of the 8 are free"):
    table.grow(2, 36)


def test_a_small_pool_preempts_the_newest_samples_and_continues_them(model, contiguous):
  """A pool of 14 pages of 4 (one slot's whole length takes 12) for 3 slots: live samples run out
  of pages, the newest go back to the queue and are continued later (prefill + append): the
  completions are still the contiguous engine's."""
  from reasoning_rl.sampler.rollout import DecodeUsage, stream_groups

  kwargs = dict(num_samples=3, sampling=SamplingParams(temperature=1.0), max_new_tokens=16,
                seed=9)
  reference = generate_groups(contiguous, PROMPTS, **kwargs)
  engine = PagedEngine(model, page_size=4, num_pages=14, **SIZES)
  usage = DecodeUsage()
  ours = sorted(stream_groups(engine, PROMPTS, usage=usage, **kwargs),
                key=lambda c: (c.prompt_id, c.sample_index))
  assert usage.preempted > 0
  for a, b in zip(ours, reference, strict=True):
    assert a.completion_ids == b.completion_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
  assert engine.pages.pages_in_use == 0


@pytest.mark.parametrize("overrides, field, message", [
    (dict(kv_pages=64), "rollout.kv_pages", "without a paged cache"),
    (dict(kv_page_size=4, kv_pages=3), "rollout.kv_pages", "cannot hold one slot"),
    (dict(kv_page_size=16, kv_pages=64, exact_logprobs=True), "rollout.kv_pages",
     "do not preempt"),
])
def test_paged_cache_settings_are_validated(overrides, field, message):
  import importlib

  from reasoning_rl import config as config_lib
  from reasoning_rl.errors import ConfigError

  config = importlib.import_module("configs.debug_cpu").get_config()
  config.workdir = "/unused"
  config.rollout.update(overrides)
  with pytest.raises(ConfigError, match=rf"^config\.{field}=.*{message}"):
    config_lib.validate(config)
  config.rollout.update(kv_pages=0, exact_logprobs=False)
  config.rollout.kv_page_size = 16
  config_lib.validate(config)  # a full pool goes with anything the engine backend runs


# ------------------------------------------------------------------- the TPU paged-attention kernel


def _random_pools(rng, heads, pages, page, dim, layers=None):
  """K, V pools of values bfloat16 holds exactly, so the kernel's bfloat16 cast is lossless and
  the two paths differ by summation order only."""
  shape = (heads, pages, page, dim) if layers is None else (heads, layers, pages, page, dim)
  return tuple(jnp.asarray(rng.normal(size=shape), jnp.bfloat16).astype(jnp.float32)
               for _ in range(2))


@pytest.mark.parametrize("softcap, stacked_layer, block_keys", [
    (None, None, 512), (20.0, None, 8), (None, 1, 8)])
def test_the_tpu_kernel_attends_as_the_gathered_pages(monkeypatch, softcap, stacked_layer,
                                                      block_keys):
  """pallas_tpu (Pallas TPU interpret mode) against the gather path on the same pool and tables:
  grouped heads, rows of 1 to 11 entries in scattered pages, an empty row, a soft-cap, several
  compute blocks (block_keys 8 = 2 pages of 4 per block), a stacked pool's layer view."""
  from reasoning_rl import kernels
  from reasoning_rl.kernels import paged as paged_kernels
  from reasoning_rl.models import kv_pages

  monkeypatch.setattr(paged_kernels, "BLOCK_KEYS", block_keys)
  rng = np.random.default_rng(3)
  heads, kv_heads, page, dim, pages = 4, 2, 4, 16, 9
  k_pool, v_pool = _random_pools(rng, kv_heads, pages, page, dim, layers=stacked_layer and 3)
  table = jnp.array([[4, 0, 7, -1], [2, -1, -1, -1], [8, 1, 3, 5], [-1, -1, -1, -1]], jnp.int32)
  lengths = jnp.array([9, 3, 14, 0], jnp.int32)  # entries after this call's token
  entries = jnp.arange(4 * page)[None, :]
  k_pos = jnp.where(entries < lengths[:, None], entries, -1)
  q_pos = (lengths - 1)[:, None]
  q = jnp.asarray(rng.normal(size=(4, 1, heads, dim)), jnp.float32)
  (k_view, offset), (v_view, _) = (kv_pages.layer_view(p, stacked_layer)
                                   for p in (k_pool, v_pool))
  options = dict(scale=0.3, softcap=softcap, window=None)

  def run(kernel):
    address = kv_pages.PageAddress(pages=None, offsets=None, read_table=table, lengths=lengths,
                                   kernel=kernel)
    return kernels.paged_decode_attention(q, k_view, v_view, offset, address, q_pos, k_pos,
                                          **options)

  gathered, kernel = run("gather"), run("pallas_tpu")
  np.testing.assert_allclose(np.asarray(kernel)[:3], np.asarray(gathered)[:3], atol=2e-5)
  assert np.isfinite(np.asarray(kernel)).all()  # the empty row too (never read, still finite)


def test_the_kernel_choice():
  from reasoning_rl.errors import ConfigError
  from reasoning_rl.kernels import paged as paged_kernels

  def choose(kernel, backend, dtype=jnp.bfloat16, head_dim=128):
    return paged_kernels.choose_paged_kernel(kernel, backend=backend, dtype=dtype,
                                             head_dim=head_dim)

  assert choose("auto", "tpu") == "pallas_tpu"
  assert choose("auto", "tpu", dtype=jnp.float32) == "gather"  # it computes in bf16
  assert choose("auto", "tpu", head_dim=64) == "gather"  # not a lane multiple
  assert choose("auto", "gpu") == "gather"
  assert choose("pallas_tpu", "cpu", dtype=jnp.float32, head_dim=16) == "pallas_tpu"
  with pytest.raises(ConfigError, match="rollout.kv_page_kernel"):
    choose("ragged", "tpu")
  one, two = jnp.zeros((2, 1, 4, 8)), jnp.zeros((2, 2, 4, 8))
  assert paged_kernels.runs_kernel("pallas_tpu", one, window=None)
  assert not paged_kernels.runs_kernel("pallas_tpu", one, window=4)  # Gemma's local layers
  assert not paged_kernels.runs_kernel("pallas_tpu", two, window=None)  # an append's tokens
  assert not paged_kernels.runs_kernel("gather", one, window=None)
  assert not paged_kernels.runs_kernel("pallas_tpu", one, window=None,
                                       sinks=jnp.zeros(4))  # GPT-OSS's layers
  assert paged_kernels._pages_per_block(12, 16) == 12
  assert paged_kernels._pages_per_block(64, 16) == 32  # 512 keys, a divisor of 64


def test_a_bfloat16_engine_decodes_the_same_tokens_through_the_tpu_kernel():
  """The whole engine with pallas_tpu (interpret mode) against the gather path, a bfloat16
  model (the kernel's own precision), on a 2-way tensor mesh where the kernel runs per device
  on its heads (shard_map): the same greedy tokens and log-probs."""
  from reasoning_rl import sharding

  model = tiny_model(1)
  model.dtype = jnp.dtype(jnp.bfloat16)
  mesh = sharding.make_mesh((1, 1, 2), jax.devices()[:2])
  kwargs = dict(num_samples=1, sampling=GREEDY, max_new_tokens=7, seed=5)
  out = {}
  for kernel in ("gather", "pallas_tpu"):
    engine = PagedEngine(model, page_size=4, kernel=kernel, mesh=mesh, **SIZES)
    assert engine.kernel == kernel
    out[kernel] = generate_groups(engine, PROMPTS[:4], **kwargs)
  assert_same_completions(out["pallas_tpu"], out["gather"], atol=1e-6)


def test_a_gpt_oss_model_decodes_through_pages_as_through_the_contiguous_cache():
  """Attention sinks and alternating sliding-window layers (window 3, shorter than the rows)
  over pages of 4: the contiguous cache's tokens and log-probs."""
  from reasoning_rl.models.config import ModelConfig
  from reasoning_rl.models.transformer import create_model
  from tests.hf_reference import FAMILIES
  from tests.support.sampler import perturbed

  config = ModelConfig.from_hf_config(FAMILIES["gpt_oss"]().to_dict())
  model = perturbed(create_model(config, seed=2), seed=2)
  kwargs = dict(num_samples=1, sampling=GREEDY, max_new_tokens=8, seed=5)
  reference = generate_groups(Engine(model, **SIZES), PROMPTS[:2], **kwargs)
  paged = PagedEngine(model, page_size=4, **SIZES)
  assert_same_completions(generate_groups(paged, PROMPTS[:2], **kwargs), reference)


def test_layers_with_sinks_gather_their_pages_even_when_the_tpu_kernel_is_asked_for():
  """paged_decode_attention with sinks: pallas_tpu named, the layer still takes the gather path
  (the kernel has no sinks), which equals the contiguous decode attention with the sinks."""
  from reasoning_rl import kernels
  from reasoning_rl.models import kv_pages

  rng = np.random.default_rng(4)
  k_pool, v_pool = _random_pools(rng, 2, 9, 4, 16)
  table = jnp.array([[4, 0, 7, -1], [2, -1, -1, -1]], jnp.int32)
  lengths = jnp.array([9, 3], jnp.int32)
  entries = jnp.arange(16)[None, :]
  k_pos = jnp.where(entries < lengths[:, None], entries, -1)
  q_pos = (lengths - 1)[:, None]
  q = jnp.asarray(rng.normal(size=(2, 1, 4, 16)), jnp.float32)
  sinks = jnp.asarray([1.5, -0.5, 0.0, 3.0], jnp.float32)
  options = dict(scale=0.3, softcap=None, window=None, sinks=sinks)
  contiguous = kernels.decode_attention(q, kv_pages.read_pages(k_pool, table),
                                        kv_pages.read_pages(v_pool, table), q_pos, k_pos,
                                        keys_length_last=False, **options)
  without = kernels.decode_attention(q, kv_pages.read_pages(k_pool, table),
                                     kv_pages.read_pages(v_pool, table), q_pos, k_pos,
                                     keys_length_last=False, **{**options, "sinks": None})
  assert np.abs(np.asarray(contiguous) - np.asarray(without)).max() > 0.01
  for kernel in ("gather", "pallas_tpu"):
    address = kv_pages.PageAddress(pages=None, offsets=None, read_table=table, lengths=lengths,
                                   kernel=kernel)
    paged = kernels.paged_decode_attention(q, k_pool, v_pool, jnp.int32(0), address, q_pos,
                                           k_pos, **options)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(contiguous), atol=1e-6,
                               err_msg=kernel)
