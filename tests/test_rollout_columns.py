"""The columnar rollout record: built from completions, reordered, joined, serialised, summarised,
each against values written out by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from reasoning_rl.rl import batching
from reasoning_rl.rl.rollout_columns import ROLLOUT_COLUMNS_FORMAT_VERSION, Ragged, RolloutColumns
from reasoning_rl.sampler.api import Completion
from reasoning_rl.verifiers.rewards import Reward
from tests.support import rollouts


def _completion(s, ids, *, logprobs, sampling_logprobs=None, versions=None, version=4,
                truncated=False, mask=None, experts=None, turns=None):
  return Completion(prompt_id=9, sample_index=s, prompt_tokens=[5, 6], completion_ids=ids,
                    logprobs=logprobs, sampling_logprobs=sampling_logprobs,
                    finish_reason="length" if truncated else "stop_id", truncated=truncated,
                    policy_version=version, token_versions=versions, loss_mask=mask,
                    experts=experts, turns=turns, episode_end="done" if turns else None,
                    reward_parts={"correct": 1.0} if turns else None)


def _rewards(*totals):
  return [Reward(total=t, parts={"correct": float(t > 0), "format": 0.5},
                 verifier_version="v") for t in totals]


def test_a_group_becomes_columns_of_three_extents():
  record = RolloutColumns.of_group(
      9, [_completion(0, [1, 2, 3], logprobs=[-0.5, -0.25, -1.0],
                      sampling_logprobs=[-0.1, -0.2, -0.3], versions=[2, 3, 3]),
          _completion(1, [7], logprobs=[-2.0], sampling_logprobs=[-0.4], truncated=True)],
      ["three", "one"], status="ok", rewards=_rewards(1.0, 0.0),
      sampling=rollouts.sampling_settings(temperature=0.7, top_k=20))
  assert (record.num_groups, record.group_size, record.num_samples) == (1, 2, 2)
  assert record.data_position.tolist() == [9] and record.status == ("ok",)
  assert record.prompt_tokens[0].tolist() == [5, 6]
  assert {k: v.tolist() for k, v in record.sampling.items()} == {
      "temperature": [0.7], "top_p": [1.0], "top_k": [20], "min_p": [0.0]}
  assert record.rewards.tolist() == [1.0, 0.0] and record.rewards.dtype == np.float64
  assert {k: v.tolist() for k, v in record.parts.items()} == {"correct": [1.0, 0.0],
                                                              "format": [0.5, 0.5]}
  assert record.truncated.tolist() == [False, True] and record.responses == ("three", "one")
  assert [r.tolist() for r in record.completion_ids.rows()] == [[1, 2, 3], [7]]
  assert record.completion_ids.lengths.tolist() == [3, 1]
  assert [r.tolist() for r in record.logprobs.rows()] == [[-0.5, -0.25, -1.0], [-2.0]]
  assert record.logprobs.values.dtype == np.float32
  np.testing.assert_allclose(record.sampling_logprobs.values, [-0.1, -0.2, -0.3, -0.4],
                             rtol=1e-7)
  # one version drew sample 1: its tokens carry the completion's policy version
  assert [r.tolist() for r in record.token_versions.rows()] == [[2, 3, 3], [4]]
  assert record.loss_mask is None and record.experts is None and record.episodes is None
  assert record.advantages is None and record.token_advantages is None


def test_untruncated_sampling_logprobs_are_the_models_and_episodes_keep_their_masks():
  turns = [{"text": "x"}]
  record = RolloutColumns.of_group(
      9, [_completion(0, [1, 2, 3], logprobs=[-0.5, 0.0, -1.0], mask=[1, 0, 1], turns=turns),
          _completion(1, [4], logprobs=[-2.0], mask=[1], turns=turns)],
      ["a", "b"], status="ok", rewards=_rewards(1.0, 1.0))
  assert record.sampling_logprobs == record.logprobs
  assert record.model_token_counts().tolist() == [2, 1]
  assert record.episodes == ({"turns": turns, "episode_end": "done",
                              "environment_parts": {"correct": 1.0}},) * 2


def _three_groups():
  rng = np.random.RandomState(0)
  groups = []
  for g, lengths in enumerate([(2, 3), (1, 4), (3, 1)]):
    experts = [rng.randint(0, 8, (2 + n, 2, 2)).astype(np.uint8) for n in lengths]
    groups.append(rollouts.group(
        [float(g), float(g) + 0.5], [[10 * g + t for t in range(n)] for n in lengths],
        position=100 + g, prompt=[5, 6], responses=(f"g{g}s0", f"g{g}s1"),
        logprobs=[list(-0.1 * (g + 1) * np.arange(1, n + 1)) for n in lengths],
        experts=experts, status=("ok", "timeout", "ok")[g],
        sampling=rollouts.sampling_settings(temperature=0.5 + g)))
  return groups


def test_taking_groups_moves_every_column_of_their_samples_with_them():
  a, b, c = _three_groups()
  record = rollouts.record(a, b, c)
  taken = record.take_groups([2, 0])
  assert taken == rollouts.record(c, a)
  assert taken.data_position.tolist() == [102, 100] and taken.status == ("ok", "ok")
  assert taken.responses == ("g2s0", "g2s1", "g0s0", "g0s1")
  assert [r.tolist() for r in taken.completion_ids.rows()] == [[20, 21, 22], [20], [0, 1],
                                                               [0, 1, 2]]
  np.testing.assert_array_equal(taken.experts[3], a.experts[1])
  assert taken.sampling["temperature"].tolist() == [2.5, 0.5]
  assert record.take_groups([1]).rewards.tolist() == [1.0, 1.5]


def test_joining_keeps_columns_a_part_without_groups_lacks():
  a, b, _ = _three_groups()
  joined = RolloutColumns.concat([RolloutColumns.empty(2), a, RolloutColumns.empty(2), b],
                                 group_size=2)
  assert joined == rollouts.record(a, b)
  assert joined.experts is not None and joined.sampling is not None
  assert RolloutColumns.concat([], group_size=3) == RolloutColumns.empty(3)


def test_the_json_form_reads_back_exactly_and_names_its_version():
  record = rollouts.record(*_three_groups()).with_advantages(
      np.array([0.25, -0.25, 1.0, -1.0, 0.0, 0.0]))
  record = record.with_token_advantages(Ragged.from_rows(
      [np.full(n, 0.1 * i) for i, n in enumerate(record.completion_ids.lengths)], np.float32))
  text = json.dumps(record.to_json())
  back = RolloutColumns.from_json(json.loads(text))
  assert back == record
  for column in ("logprobs", "token_advantages", "experts", "completion_ids"):
    assert getattr(back, column).values.dtype == getattr(record, column).values.dtype
    np.testing.assert_array_equal(getattr(back, column).values, getattr(record, column).values)
  np.testing.assert_array_equal(back.advantages, record.advantages)
  assert json.loads(text)["format_version"] == ROLLOUT_COLUMNS_FORMAT_VERSION
  with pytest.raises(ValueError, match="format_version 99"):
    RolloutColumns.from_json({**json.loads(text), "format_version": 99})


def test_signal_outcomes_and_the_summary_follow_the_rewards_and_the_correct_part():
  record = rollouts.record(
      rollouts.group([1.0, 1.0], [2, 2], position=1),
      rollouts.group([0.0, 1.0], [1, 3], position=2),
      rollouts.group([0.5, 0.5], [1, 1], position=3, parts={"correct": [0.0, 0.0]}))
  assert record.has_signal().tolist() == [False, True, False]
  # all pass: group 1 (correct 1, 1); all fail: group 3 (correct 0, 0), whatever its total
  assert record.outcome_fractions() == {"groups/all_pass_frac": 1 / 3,
                                        "groups/all_fail_frac": 1 / 3}
  assert record.outcome_fractions(part=None) == {"groups/all_pass_frac": 2 / 3,
                                                 "groups/all_fail_frac": 0.0}
  summary = record.summary()
  assert summary.rewards.tolist() == record.rewards.tolist()
  assert summary.has_signal().tolist() == [False, True, False]
  assert summary.outcome_fractions() == record.outcome_fractions()
  assert summary.completion_ids is None and summary.prompt_tokens is None
  assert summary.responses is None and set(summary.parts) == {"correct"}
  # small enough for the exchange's control messages: a few hundred bytes for three groups
  assert len(json.dumps(summary.to_json())) < 800
  assert RolloutColumns.from_json(json.loads(json.dumps(summary.to_json()))) == summary


def test_the_batchs_rows_are_the_records_samples_in_order():
  record = rollouts.record(*_three_groups()).with_advantages(np.arange(6) / 10)
  batch = batching.build_batch(record, num_groups=4, group_size=2, prompt_length=3,
                               completion_length=4, pad_id=0, with_rewards=True,
                               with_behavior_logprobs=True, with_routing=True)
  for row in range(6):
    completion = record.completion_ids[row].tolist()
    n = len(completion)
    assert batch["tokens"][row].tolist() == [0, 5, 6] + completion + [0] * (4 - n)
    np.testing.assert_array_equal(batch["behavior_logprobs"][row, :n], record.logprobs[row])
    np.testing.assert_array_equal(batch["recorded_experts"][row, 1:3 + n], record.experts[row])
  np.testing.assert_allclose(batch["advantages"], [0, 0.1, 0.2, 0.3, 0.4, 0.5, 0, 0])
  np.testing.assert_array_equal(batch["rewards"], [0, 0.5, 1, 1.5, 2, 2.5, 0, 0])
  assert not batch["attention_mask"][6:].any()  # the fourth group is missing: masked rows
