"""Evaluation: pass@k against the closed form, majority vote on constructed votes, aggregation on
hand-scored completions, and run_evaluation against the sampler called directly."""

import dataclasses
import fractions
import math

import pytest

from reasoning_rl import evaluation
from reasoning_rl.evaluation import GeneratedText
from reasoning_rl.verifiers.rewards import RewardFunction


def closed_form(n, c, k):
  return 1 - fractions.Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_equals_closed_form_for_all_n_up_to_64():
  worst = 0.0
  for n in range(1, 65):
    for c in range(n + 1):
      for k in range(1, n + 1):
        worst = max(worst, abs(evaluation.pass_at_k(n, c, k) - float(closed_form(n, c, k))))
  assert worst < 1e-12


def test_pass_at_k_hand_values_and_errors():
  assert evaluation.pass_at_k(4, 1, 1) == pytest.approx(0.25)
  assert evaluation.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
  assert evaluation.pass_at_k(5, 0, 3) == 0.0
  assert evaluation.pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k
  for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
    with pytest.raises(ValueError):
      evaluation.pass_at_k(*bad)


def test_default_ks():
  assert evaluation.default_ks(1) == [1]
  assert evaluation.default_ks(8) == [1, 2, 4, 8]
  assert evaluation.default_ks(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("raw, canonical", [
    (" 42 ", "42"), ("1,234", "1234"), ("3.50", "7/2"), ("4.0", "4"), ("-0", "0"),
    ("\\frac{6}{4}", "3/2"), ("6/4", "3/2"), ("$12$", "12"), ("12.", "12"), ("1\\,000", "1000"),
    ("x + 1", "x+1"), ("Paris", "Paris"), ("1,234.50", "2469/2"),
])
def test_normalise_answer(raw, canonical):
  assert evaluation.normalise_answer(raw) == canonical


def test_majority_vote_counts_normalised_answers():
  assert evaluation.majority_vote(["3", "4", "3.0", "4", " 3 "]) == "3"  # 3 votes vs 2
  assert evaluation.majority_vote([None, "5", None, None]) == "5"  # non-answers do not vote
  assert evaluation.majority_vote([None, None]) is None
  assert evaluation.majority_vote([]) is None


def test_majority_vote_tie_goes_to_the_earliest_first_vote():
  assert evaluation.majority_vote(["7", "9", "9", "7"]) == "7"
  assert evaluation.majority_vote(["9", "7", "7", "9"]) == "9"
  assert evaluation.majority_vote([None, "b", "a", "a", "b"]) == "b"


def test_maj_at_k_uses_the_first_k_votes_and_the_winner_verdict():
  answers = ["5", "6", "6", "5", "5"]
  correct = [True, False, False, True, True]
  assert evaluation.maj_at_k(answers, correct, 1) == 1.0  # only "5" votes
  assert evaluation.maj_at_k(answers, correct, 3) == 0.0  # "6" wins 2:1
  assert evaluation.maj_at_k(answers, correct, 4) == 1.0  # 2:2 tie, "5" voted first
  assert evaluation.maj_at_k(answers, correct, 5) == 1.0
  assert evaluation.maj_at_k([None, None], [False, False], 2) == 0.0
  with pytest.raises(ValueError):
    evaluation.maj_at_k(answers, correct, 6)


@dataclasses.dataclass
class Example:
  prompt: str
  answer: str
  uid: str
  task: str = "math"
  metadata: dict = dataclasses.field(default_factory=dict)
  tests: tuple = ()


REWARDS = {"correct": {"weight": 1.0, "verifier": "math", "extract": "answer"},
           "format": {"weight": 0.5}}


def good(answer, tokens=10):
  return GeneratedText(f"<think>ok</think><answer>{answer}</answer>", tokens)


def test_evaluate_completions_hand_scored():
  examples = [Example("1+1", "2", "a"), Example("2+3", "5", "b")]
  completions = [
      # a: correct, correct-but-unformatted, wrong, wrong (same wrong answer twice): c = 2
      [good("2", 10), GeneratedText("<answer>2.0</answer>", 20), good("3", 30), good("3", 40, )],
      # b: all wrong, one truncated without answer: c = 0
      [good("4", 10), good("6", 10), GeneratedText("I think", 50, truncated=True), good("4", 10)],
  ]
  result = evaluation.evaluate_completions(
      examples, completions, RewardFunction(REWARDS), max_new_tokens=50, temperature=1.0,
      canaries=[Example("hello", "", "c0")], canary_completions=[[GeneratedText("hi!", 2)]])
  assert result["num_examples"] == 2 and result["num_samples"] == 4
  assert result["accuracy"] == pytest.approx((2 / 4 + 0) / 2)
  assert result["pass@1"] == pytest.approx(0.25)
  assert result["pass@2"] == pytest.approx((1 - 1 / 6) / 2)  # C(2,2)/C(4,2) = 1/6
  assert result["pass@4"] == pytest.approx(0.5)
  # a: "2" (2 votes, first) vs "3" (2 votes) -> "2", correct; b: "4" wins -> wrong.
  assert result["maj@4"] == pytest.approx(0.5)
  assert result["maj@2"] == pytest.approx(0.5)  # a: "2" twice; b: tie 4/6 -> "4"
  assert result["reward/correct"] == pytest.approx(2 / 8)
  assert result["reward/format"] == pytest.approx(6 / 8)
  assert result["format_rate"] == pytest.approx(6 / 8)
  assert result["reward/mean"] == pytest.approx((2 + 0.5 * 6) / 8)
  assert result["response_length/mean"] == pytest.approx((10 + 20 + 30 + 40 + 10 + 10 + 50 + 10) / 8)
  assert result["truncated_frac"] == pytest.approx(1 / 8)
  assert result["answer_rate"] == pytest.approx(7 / 8)
  assert result["examples"][0] == {"uid": "a", "task": "math", "answer": "2", "num_correct": 2,
                                   "majority_answer": "2"}
  assert result["per_task"] == {"math": {"num_examples": 2, "accuracy": 0.25}}
  assert result["canaries"] == [{"uid": "c0", "prompt": "hello", "completions": [
      {"text": "hi!", "num_tokens": 2, "truncated": False}]}]
  assert result["verifier_version"] == RewardFunction(REWARDS).verifier_version


def test_evaluate_completions_errors():
  reward_fn = RewardFunction(REWARDS)
  with pytest.raises(ValueError, match="same number"):
    evaluation.evaluate_completions([Example("q", "1", "a"), Example("q", "1", "b")],
                                    [[good("1")], [good("1"), good("1")]], reward_fn)
  with pytest.raises(ValueError, match="ks"):
    evaluation.evaluate_completions([Example("q", "1", "a")], [[good("1")]], reward_fn, ks=[2])
  from reasoning_rl.errors import VerifierError
  with pytest.raises(VerifierError, match="correct"):
    evaluation.evaluate_completions([Example("q", "1", "a")], [[good("1")]],
                                    RewardFunction({"format": {"weight": 1.0}}))


def test_eval_results_round_trip(tmp_path):
  evaluation.write_eval_result(tmp_path, 10, {"accuracy": 0.5, "kl": math.nan})
  evaluation.write_eval_result(tmp_path, 0, {"accuracy": 0.25})
  results = evaluation.read_eval_results(tmp_path)
  assert [r["step"] for r in results] == [0, 10]
  assert results[1]["accuracy"] == 0.5 and math.isnan(results[1]["kl"])
  assert (tmp_path / "eval" / "step_00000010.json").exists()


class CharTokenizer:
  """Ids 0..96 <-> printable characters; no special tokens."""

  eos_ids = ()

  def decode(self, ids, *, skip_special_tokens=False):
    del skip_special_tokens
    return "".join(chr(33 + int(i) % 90) for i in ids)


class CharTemplate:

  def encode(self, example):
    return [ord(ch) % 97 for ch in example.prompt]


def test_run_evaluation_matches_the_sampler_called_directly():
  from reasoning_rl.models.config import ModelConfig
  from reasoning_rl.models.transformer import create_model
  from reasoning_rl.sampler import Engine, EngineBackend, SamplingParams, generate_groups

  config = ModelConfig(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=32,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
  engine = Engine(create_model(config, seed=1), max_concurrent_decodes=8, max_prefill_length=16,
                  max_decode_length=8, steps_per_call=6)
  examples = [Example("12+30", "42", "a"), Example("7*6", "42", "b"), Example("1+1", "2", "c")]
  reward_fn = RewardFunction(REWARDS)
  result = evaluation.run_evaluation(EngineBackend(engine), CharTokenizer(), CharTemplate(),
                                     examples, reward_fn, num_samples=2, temperature=1.0,
                                     max_new_tokens=6, seed=3, canaries=["hi there"])
  prompts = [CharTemplate().encode(e) for e in examples] + [CharTemplate().encode(
      Example("hi there", "", "x"))]
  direct = generate_groups(engine, prompts, num_samples=2, sampling=SamplingParams(temperature=1.0),
                           max_new_tokens=6, seed=3)
  texts = [[GeneratedText(CharTokenizer().decode(c.completion_ids), len(c.completion_ids),
                          c.truncated) for c in direct if c.prompt_id == p] for p in range(4)]
  expected = evaluation.evaluate_completions(
      examples, texts[:3], reward_fn, max_new_tokens=6, temperature=1.0,
      canaries=[evaluation.CanaryPrompt("hi there", "canary-0")], canary_completions=texts[3:])
  assert result == expected
  assert result["response_length/mean"] == 6 and result["truncated_frac"] == 1.0
  assert result["canaries"][0]["uid"] == "canary-0"
  assert [c["text"] for c in result["canaries"][0]["completions"]] == [t.text for t in texts[3]]
