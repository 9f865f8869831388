"""The Scorer interface: inline and pool scoring agree; errors and timeouts are counted apart, get
zero rewards and never reach the caller as exceptions; a dead pool dispatcher raises."""

import time

import pytest

from reasoning_rl.errors import VerifierError
from reasoning_rl.verifiers.rewards import CompletionRecord, RewardFunction
from reasoning_rl.workers.scorer import InlineScorer, PoolScorer, make_scorer

REWARDS = {"correct": {"weight": 1.0, "verifier": "math", "extract": "answer"},
           "length": {"weight": 0.5, "method": "lcpo", "alpha": 0.05, "target_tokens": 5}}


def _group(answer, responses):
  return [CompletionRecord(response=r, ground_truth=answer, num_tokens=3 + i, max_new_tokens=16)
          for i, r in enumerate(responses)]


GROUPS = {
    "a": _group("7", ["<answer>7</answer>", "<answer>8</answer>"]),
    "b": _group("12", ["<answer>12</answer>", "no answer"]),
    "c": _group("3", ["<answer>3</answer>", "<answer>3</answer>"]),
}


class ExplodesOn:
  """A reward function with a bug (raises) or a hang (sleeps) for one ground truth; picklable."""

  def __init__(self, answer, action):
    self.inner = RewardFunction(REWARDS)
    self.answer, self.action = answer, action
    self.parts, self.verifier_version = self.inner.parts, self.inner.verifier_version
    self.needs_group = self.inner.needs_group

  def score_group(self, records):
    if records[0].ground_truth == self.answer:
      if self.action == "raise":
        raise ZeroDivisionError("verifier bug")
      time.sleep(30)
    return self.inner.score_group(records)


def test_make_scorer_picks_inline_or_pool():
  reward_fn = RewardFunction(REWARDS)
  assert isinstance(make_scorer(reward_fn, num_workers=0, item_timeout_s=1.0), InlineScorer)
  with make_scorer(reward_fn, num_workers=1, item_timeout_s=5.0) as pool:
    assert isinstance(pool, PoolScorer)


def test_inline_and_pool_give_the_reward_functions_own_rewards():
  reward_fn = RewardFunction(REWARDS)
  expected = {key: reward_fn.score_group(records) for key, records in GROUPS.items()}
  inline = InlineScorer(reward_fn).score(GROUPS.items())
  with PoolScorer(reward_fn, num_workers=2, item_timeout_s=30.0) as pool:
    pooled = pool.score(GROUPS.items())
    assert pool.counts() == {"ok": 3, "timeout": 0, "error": 0}
    assert pool.metrics()["completed"] == 3
  for scored in (inline, pooled):
    assert set(scored) == set(GROUPS)
    for key, item in scored.items():
      assert item.status == "ok" and item.key == key
      assert [r.total for r in item.rewards] == [r.total for r in expected[key]]
      assert [r.parts for r in item.rewards] == [r.parts for r in expected[key]]
  assert expected["a"][0].parts["correct"] == 1.0 and expected["a"][1].parts["correct"] == 0.0


@pytest.mark.parametrize("where", ["inline", "pool"])
def test_a_verifier_that_raises_is_an_error_with_zero_rewards(where):
  reward_fn = ExplodesOn("12", "raise")
  scorer = (InlineScorer(reward_fn) if where == "inline"
            else PoolScorer(reward_fn, num_workers=1, item_timeout_s=30.0))
  with scorer:
    scored = scorer.score(GROUPS.items())
    assert scorer.counts() == {"ok": 2, "timeout": 0, "error": 1}
  bad = scored["b"]
  assert bad.status == "error" and "ZeroDivisionError" in bad.error
  assert [r.total for r in bad.rewards] == [0.0, 0.0]
  assert all(v == 0.0 for r in bad.rewards for v in r.parts.values())
  assert set(bad.rewards[0].parts) == {"correct", "length"}
  assert scored["a"].status == scored["c"].status == "ok"


def test_a_verifier_that_hangs_times_out_apart_from_errors():
  # 10 s, not less: the two honest groups must score in time on a 2-core machine running other
  # tests' processes beside this one (2 s timed out all three at a load average of 8).
  with PoolScorer(ExplodesOn("3", "sleep"), num_workers=2, item_timeout_s=10.0) as scorer:
    scored = scorer.score(GROUPS.items())
    assert scorer.counts() == {"ok": 2, "timeout": 1, "error": 0}
  assert scored["c"].status == "timeout" and [r.total for r in scored["c"].rewards] == [0.0, 0.0]


def test_get_with_nothing_outstanding_and_a_repeated_key_are_refused():
  scorer = InlineScorer(RewardFunction(REWARDS))
  with pytest.raises(VerifierError, match="nothing is outstanding"):
    scorer.get()
  scorer.submit("a", GROUPS["a"])
  with pytest.raises(ValueError, match="already outstanding"):
    scorer.submit("a", GROUPS["a"])
  assert scorer.get().key == "a"


def test_a_dead_dispatcher_raises_in_the_caller_instead_of_blocking():
  with PoolScorer(RewardFunction(REWARDS), num_workers=1, item_timeout_s=30.0) as scorer:
    pool = scorer._pool  # pylint: disable=protected-access
    pool._closed.set()  # pylint: disable=protected-access  # makes the dispatcher thread exit
    pool._wake()  # pylint: disable=protected-access
    pool._dispatcher.join(timeout=10)  # pylint: disable=protected-access
    assert not pool._dispatcher.is_alive()  # pylint: disable=protected-access
    pool._closed.clear()  # pylint: disable=protected-access  # submit still accepts items
    scorer.submit("a", GROUPS["a"])
    start = time.monotonic()
    with pytest.raises(VerifierError, match="dispatcher thread has died"):
      scorer.get()
    assert time.monotonic() - start < 5
