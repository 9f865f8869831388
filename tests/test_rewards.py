"""Reward composition: weighted parts, group parts, routing, versions, pickling, config errors."""

import pickle

import ml_collections
import pytest

from reasoning_rl.errors import ConfigError, VerifierError
from reasoning_rl.verifiers.rewards import CompletionRecord, RewardFunction

GOOD = "<think>six sevens are forty-two</think><answer>42</answer>"
WRONG = "<think>six sevens are forty-one</think><answer>41</answer>"


def _config(**overrides):
  base = {
      "correct": {"weight": 1.0, "verifier": "math"},
      "format": {"weight": 0.1},
      "language": {"weight": 0.05},
      "length": {"weight": 0.5, "method": "dapo", "cache_len": 20},
  }
  base.update(overrides)
  return ml_collections.ConfigDict(base)


def test_weighted_sum_of_parts_hand_computed():
  fn = RewardFunction(_config())
  reward = fn(CompletionRecord(GOOD, "42", num_tokens=90, max_new_tokens=100))
  # correct 1, format 1, language 1 (all Latin letters), dapo (80 - 90) / 20 = -0.5
  assert reward.parts == pytest.approx({"correct": 1.0, "format": 1.0, "language": 1.0,
                                        "length": -0.5})
  assert reward.total == pytest.approx(1.0 + 0.1 + 0.05 - 0.25)
  wrong = fn(CompletionRecord(WRONG, "42", num_tokens=10, truncated=True, max_new_tokens=100))
  assert wrong.parts == pytest.approx({"correct": 0.0, "format": 1.0, "language": 1.0,
                                       "length": -1.0})
  assert wrong.total == pytest.approx(0.1 + 0.05 - 0.5)
  assert reward.verifier_version == wrong.verifier_version == fn.verifier_version


def test_mapping_records_and_aliases():
  fn = RewardFunction({"correct": {"weight": 2.0}})
  assert fn({"completion": GOOD, "answer": "42", "extra_field": 1}).total == 2.0
  assert fn({"response": WRONG, "ground_truth": "42"}).total == 0.0


def test_kimi_group_part_hand_computed():
  fn = RewardFunction(_config(length={"weight": 1.0, "method": "kimi"}, language={"weight": 0.0}))
  records = [CompletionRecord(GOOD, "42", num_tokens=n) for n in (10, 30)] + \
      [CompletionRecord(WRONG, "42", num_tokens=n) for n in (20, 15)]
  rewards = fn.score_group(records)
  # min 10, max 30 -> λ = [0.5, -0.5, 0.0, 0.25]; wrong ones get min(0, λ) = [0.0, 0.0]
  assert [r.parts["length"] for r in rewards] == pytest.approx([0.5, -0.5, 0.0, 0.0])
  assert [r.total for r in rewards] == pytest.approx([1.6, 0.6, 0.1, 0.1])
  with pytest.raises(VerifierError, match="score_group"):
    fn(records[0])


def test_lcpo_parts():
  exact = RewardFunction({"correct": {"weight": 1.0},
                          "length": {"weight": 1.0, "method": "lcpo", "alpha": 0.001}})
  record = CompletionRecord(GOOD, "42", num_tokens=300, metadata={"target_tokens": 100})
  assert exact(record).total == pytest.approx(1.0 - 0.001 * 200)  # L1-Exact
  fixed = RewardFunction({"correct": {"weight": 1.0},
                          "length": {"weight": 1.0, "method": "lcpo", "target_tokens": 250}})
  assert fixed(record).parts["length"] == pytest.approx(-0.0003 * 50)
  capped = RewardFunction({"correct": {"weight": 0.0},
                           "length": {"weight": 1.0, "method": "lcpo_max", "alpha": 0.001}})
  assert capped(record).total == pytest.approx(0.3)  # clip(0.001 * (100 - 300) + 0.5, 0, 1)
  with pytest.raises(VerifierError, match="target_tokens"):
    exact(CompletionRecord(GOOD, "42", num_tokens=3))


def test_auto_routing():
  fn = RewardFunction({"correct": {"weight": 1.0, "verifier": "auto"}})
  countdown = {"task": "countdown", "metadata": {"numbers": [6, 61, 94, 4], "target": 309}}
  assert fn(dict(countdown, response="<answer>94*4 - 61 - 6</answer>")).total == 1.0
  assert fn(dict(countdown, response="<answer>309</answer>")).total == 0.0
  rg_record = {"task": "basic_arithmetic", "ground_truth": "-4",
               "metadata": {"source_dataset": "basic_arithmetic", "expression": "5 - 3 - 6"}}
  assert fn(dict(rg_record, response="<answer>-4</answer>")).total == 1.0
  assert fn(dict(rg_record, response="<answer>-4 or 3</answer>")).total == 0.0
  assert fn({"response": r"so \boxed{\frac{1}{2}}", "ground_truth": "0.5"}).total == 1.0
  with pytest.raises(VerifierError, match="numbers"):
    fn({"task": "countdown", "response": "<answer>1</answer>", "metadata": {}})


def test_verifier_version_is_stable_and_tracks_every_setting():
  base = RewardFunction(_config()).verifier_version
  assert RewardFunction(_config().to_dict()).verifier_version == base  # dict or ConfigDict
  assert RewardFunction(_config()).verifier_version == base
  assert "correct=math-5" in base and "format=format-1" in base
  variants = [
      _config(format={"weight": 0.2}),
      _config(format={"weight": 0.1, "require_nonempty_think": False}),
      _config(correct={"weight": 1.0, "verifier": "math", "timeout_s": 2.0}),
      _config(correct={"weight": 1.0, "verifier": "math", "extract": "boxed"}),
      _config(length={"weight": 0.5, "method": "dapo", "cache_len": 21}),
      _config(language={"weight": 0.05, "script": "cjk"}),
  ]
  versions = {RewardFunction(v).verifier_version for v in variants}
  assert base not in versions and len(versions) == len(variants)


def test_picklable_for_worker_processes():
  fn = RewardFunction(_config())
  clone = pickle.loads(pickle.dumps(fn))
  record = CompletionRecord(GOOD, "42", num_tokens=85, max_new_tokens=100)
  assert clone(record) == fn(record)
  assert clone.verifier_version == fn.verifier_version


@pytest.mark.parametrize("config,field", [
    ({"corect": {"weight": 1.0}}, "rewards.corect"),
    ({"correct": {"weight": 1.0, "verifier": "maths"}}, "rewards.correct.verifier"),
    ({"format": {"weight": 1.0, "think_tagg": "t"}}, "rewards.format.think_tagg"),
    ({"format": {}}, "rewards.format.weight"),
    ({"format": {"weight": "high"}}, "rewards.format.weight"),
    ({"length": {"weight": 1.0, "method": "dapo"}}, "rewards.length.cache_len"),
    ({"length": {"weight": 1.0, "method": "longer"}}, "rewards.length.method"),
    ({"length": {"weight": 1.0, "method": "kimi"}}, "needs a 'correct' part"),
    ({"language": {"weight": 1.0, "script": "elvish"}}, "rewards.language.script"),
    ({"correct": {"weight": 1.0, "extract": "none"}}, "rewards.correct.extract"),
    ({"correct": {"weight": 1.0, "timeout_s": -1}}, "rewards.correct.timeout_s"),
    ({"format": {"weight": 1.0, "pattern": "("}}, "format.pattern"),
    ({}, "non-empty"),
])
def test_config_errors_name_the_field(config, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    RewardFunction(config)


def test_custom_part_names_need_a_kind():
  fn = RewardFunction({"correct": {"weight": 1.0},
                       "overlong": {"kind": "length", "weight": 1.0, "method": "dapo",
                                    "cache_len": 10},
                       "budget": {"kind": "length", "weight": 1.0, "method": "lcpo",
                                  "target_tokens": 50}})
  reward = fn(CompletionRecord(GOOD, "42", num_tokens=95, max_new_tokens=100))
  assert reward.parts == pytest.approx({"correct": 1.0, "overlong": -0.5, "budget": -0.0135})


def test_code_part_uses_the_sandbox():
  fn = RewardFunction({"correct": {"weight": 1.0, "verifier": "code", "partial_credit": True}})
  tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
  honest = "<answer>```python\ndef add(a, b):\n  return a + b\n```</answer>"
  half = "<answer>```python\ndef add(a, b):\n  return 3\n```</answer>"
  assert fn({"task": "code", "response": honest, "tests": tests}).total == 1.0
  assert fn({"task": "code", "response": half, "tests": tests}).total == 0.5
