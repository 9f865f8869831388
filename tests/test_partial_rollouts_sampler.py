"""Rounds of `stream_groups` (partial rollouts): a round ended early hands back its unfinished
samples, and continuing them gives the completions an uninterrupted call gives under the same
weights; under new weights each token keeps the version that drew it."""

import jax
import numpy as np
import pytest

from reasoning_rl.errors import SamplingError
from reasoning_rl.sampler import Engine, generate_groups
from reasoning_rl.sampler.rollout import Completion, DecodeUsage, Unfinished, stream_groups
from tests.support.sampler import IDS, KWARGS, PROMPTS, by_key, run_rounds, tiny_model


@pytest.fixture(scope="module")
def engine():
  return Engine(tiny_model(1), max_concurrent_decodes=3, max_prefill_length=32,
                max_decode_length=16, steps_per_call=4)


def test_a_sample_continued_over_rounds_equals_the_uninterrupted_one(engine):
  whole = by_key(generate_groups(engine, PROMPTS[:4], prompt_ids=IDS, **KWARGS))
  pieces, rounds = run_rounds(engine, PROMPTS[:4], calls_per_round=1)
  assert rounds >= 3  # most samples crossed at least one round boundary
  assert sorted(pieces) == sorted(whole)
  for key, c in whole.items():
    assert pieces[key].completion_ids == c.completion_ids, key
    # the continued sample's cache was recomputed by a prefill and one append: same values up to
    # float summation order
    np.testing.assert_allclose(pieces[key].logprobs, c.logprobs, atol=2e-5)
    np.testing.assert_allclose(pieces[key].sampling_logprobs, c.sampling_logprobs, atol=2e-5)
    assert (pieces[key].finish_reason, pieces[key].truncated) == (c.finish_reason, c.truncated)
    assert pieces[key].token_versions is None  # one version drew everything


def test_tokens_drawn_under_new_weights_carry_their_version(engine):
  old = engine.params
  other = jax.tree.map(lambda x: x * 1.05, old)
  try:
    pieces, rounds = run_rounds(
        engine, PROMPTS[:4], calls_per_round=1,
        update=lambda r: engine.update_params(other if r % 2 else old, version=r))
  finally:
    engine.update_params(old, version=0)
  assert rounds >= 3
  mixed = [c for c in pieces.values() if c.token_versions is not None]
  assert mixed, "no sample spanned a weight update"
  for c in pieces.values():
    versions = c.token_versions or [c.policy_version] * len(c.completion_ids)
    assert len(versions) == len(c.completion_ids) == len(c.logprobs) <= KWARGS["max_new_tokens"]
    assert versions == sorted(versions) and c.policy_version == versions[0]
    assert c.truncated == (c.finish_reason == "length")


def test_a_round_hands_back_every_sample_it_did_not_finish(engine):
  usage = DecodeUsage()
  out = list(stream_groups(engine, PROMPTS[:4], prompt_ids=IDS, round_over=lambda: True,
                           usage=usage, **KWARGS))
  assert sorted((c.prompt_id, c.sample_index) for c in out) == [
      (p, g) for p in IDS for g in range(2)]
  started = [u for u in out if isinstance(u, Unfinished) and u.completion_ids]
  never = [u for u in out if isinstance(u, Unfinished) and not u.completion_ids]
  assert len(started) + sum(isinstance(c, Completion) for c in out) == 3  # the slots it had
  assert len(never) == 8 - 3
  assert all(set(u.token_versions) == {0} for u in started)
  assert usage.calls == 1 and usage.slot_steps == 3 * usage.steps
  assert usage.live_slot_steps == sum(len(u.completion_ids) for u in started) + sum(
      len(c.completion_ids) for c in out if isinstance(c, Completion))


def test_bad_resume_is_refused_before_decoding(engine):
  common = dict(prompt_ids=IDS, **KWARGS)
  with pytest.raises(SamplingError, match="samples"):
    stream_groups(engine, PROMPTS[:4], samples=[(99, 0)], **common)
  with pytest.raises(SamplingError, match="resume"):
    stream_groups(engine, PROMPTS[:4], samples=[(40, 0)],
                  resume=[Unfinished(40, 1, [1], [0.0], [0.0], [0])], **common)
  with pytest.raises(SamplingError, match="must agree"):
    stream_groups(engine, PROMPTS[:4], samples=[(40, 0)],
                  resume=[Unfinished(40, 0, [1, 2], [0.0], [0.0], [0])], **common)
