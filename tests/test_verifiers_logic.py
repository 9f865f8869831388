"""Countdown's safe parser (incl. property tests) and the reasoning-gym adapter."""

import fractions
import random

import pytest
import reasoning_gym

from reasoning_rl.errors import ConfigError, VerifierError
from reasoning_rl.verifiers import logic
from reasoning_rl.verifiers.logic import (InvalidExpression, countdown_correct,
                                          countdown_expression_ok, evaluate_arithmetic)

F = fractions.Fraction


def test_evaluate_arithmetic_exact():
  assert evaluate_arithmetic("(1 + 2) * 3 / 4") == (F(9, 4), [1, 2, 3, 4])
  assert evaluate_arithmetic("10 - 4 - 3") == (F(3), [10, 4, 3])  # left associative
  assert evaluate_arithmetic("7 / 3 * 3") == (F(7), [7, 3, 3])  # exact, no float rounding
  assert evaluate_arithmetic("6 × 7 ÷ 2 − 1") == (F(20), [6, 7, 2, 1])
  assert evaluate_arithmetic("-(3 - 5)", allow_unary_minus=True) == (F(2), [3, 5])


@pytest.mark.parametrize("expression", [
    "2 ** 3", "9**9**9**9", "abs(3)", "x + 1", "1.5 + 1", "True + 1", "1 if 1 else 2", "[1]",
    "7 // 2", "7 % 2", "-1 + 2", "1 / 0", "1 / (2 - 2)", "", "1 = 1", "1 == 1", "1 < 2",
    "__import__('os').getpid()", "(lambda: 1)()", "'1' + '2'", "1e3", "0x10", "1_000 + 1",
    "(" * 300 + "1" + ")" * 300, "1 +" * 400 + "1", "3 & 1", "~3", "+3",
])
def test_rejected_expressions(expression):
  with pytest.raises(InvalidExpression):
    evaluate_arithmetic(expression)


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, F]:
  """A random expression tree over `numbers` (each used once) and its exact value."""
  if len(numbers) == 1:
    return str(numbers[0]), F(numbers[0])
  split = rng.randint(1, len(numbers) - 1)
  left, lv = _random_expression(rng, numbers[:split])
  right, rv = _random_expression(rng, numbers[split:])
  ops = ["+", "-", "*"] + (["/"] if rv != 0 else [])
  op = rng.choice(ops)
  value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if rv else None}[op]
  return f"({left} {op} {right})", value


def test_property_random_valid_expressions_accepted_tampered_rejected():
  rng = random.Random(1234)
  for _ in range(300):
    numbers = [rng.randint(1, 100) for _ in range(rng.randint(2, 6))]
    order = numbers[:]
    rng.shuffle(order)
    expression, target = _random_expression(rng, order)
    assert countdown_expression_ok(expression, numbers, target)
    assert countdown_expression_ok(expression, numbers, target, use_each="at_most_once")
    # Off-by-one target.
    assert not countdown_expression_ok(expression, numbers, target + 1)
    # A number that was not given (value-preserving: the literal is swapped for 101 - 101 + n).
    assert not countdown_expression_ok(f"{expression} + 101 - 101", numbers, target,
                                       use_each="at_most_once")
    # A given number reused (value-preserving).
    n = numbers[0]
    assert not countdown_expression_ok(f"{expression} + {n} - {n}", numbers, target,
                                       use_each="at_most_once")
    # Disallowed operations with the same value.
    for tampered in (f"({expression}) ** 1", f"abs({expression})", f"+({expression})",
                     f"({expression}) * 9**9**9", f"({expression}) // 1"):
      assert not countdown_expression_ok(tampered, numbers, target, use_each="at_most_once")
    # Dropping a number: fails exactly-once, passes at-most-once.
    if len(numbers) > 2:
      sub_expression, sub_target = _random_expression(rng, order[:-1])
      assert not countdown_expression_ok(sub_expression, numbers, sub_target)
      assert countdown_expression_ok(sub_expression, numbers, sub_target, use_each="at_most_once")


def test_countdown_response_extraction():
  numbers, target = [6, 61, 94, 4], 309
  assert countdown_correct("<think>…</think><answer>94*4 - 61 - 6</answer>", numbers, target)
  assert countdown_correct("<answer>94*4 - 61 - 6 = 309</answer>", numbers, target)
  assert not countdown_correct("<answer>94*4 - 61 - 6 = 310</answer>", numbers, target)
  assert not countdown_correct("94*4 - 61 - 6", numbers, target)  # no answer tag
  assert countdown_correct("94*4 - 61 - 6", numbers, target, extract="none")
  assert not countdown_correct("<answer>1+2</answer><answer>94*4 - 61 - 6</answer>", numbers,
                               target)  # two different answers
  assert countdown_correct("<answer>94*4-61-6</answer><answer> 94*4-61-6 </answer>", numbers,
                           target)  # the same answer twice is one answer
  with pytest.raises(ConfigError, match="use_each"):
    countdown_expression_ok("1", [1], 1, use_each="twice")


# ------------------------------------------------------------------------------------ reasoning-gym


def test_reasoning_gym_basic_arithmetic_matches_its_own_scorer():
  entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=8, seed=7))
  score = reasoning_gym.get_score_answer_fn("basic_arithmetic")
  for entry in entries:
    right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
    assert logic.reasoning_gym_score(f"<answer>{right}</answer>", entry) == 1.0
    assert logic.reasoning_gym_score(f"<answer>{wrong}</answer>", entry) == 0.0
    hedge = f"{right} or {wrong}"
    raw = logic.reasoning_gym_score(f"<answer>{hedge}</answer>", entry, success_threshold=None)
    assert 0.0 < raw < 1.0 and raw == score(hedge, entry)  # rg's partial credit, passed through
    assert logic.reasoning_gym_score(f"<answer>{hedge}</answer>", entry) == 0.0  # thresholded
    assert logic.reasoning_gym_score("no tags", entry) == 0.0


def test_reasoning_gym_countdown_agrees_with_safe_verifier():
  for entry in reasoning_gym.create_dataset("countdown", size=6, seed=3):
    numbers, target = entry["metadata"]["numbers"], entry["metadata"]["target"]
    honest = f"<answer>{entry['answer']}</answer>"
    assert logic.reasoning_gym_score(honest, entry) == 1.0
    assert countdown_correct(honest, numbers, target)
    tampered = f"<answer>{entry['answer']} + 1</answer>"
    assert logic.reasoning_gym_score(tampered, entry) == 0.0
    assert not countdown_correct(tampered, numbers, target)


def test_reasoning_gym_scorer_never_sees_code(tmp_path):
  entry = reasoning_gym.create_dataset("countdown", size=1, seed=1)[0]
  marker = tmp_path / "pwned"
  for payload in (f"open({str(marker)!r}, 'w')", f"__import__('os').makedirs({str(marker)!r})",
                  "().__class__", f"print({str(marker)!r})"):
    assert logic.unsafe_for_eval(payload)
    assert logic.reasoning_gym_score(f"<answer>{payload}</answer>", entry) == 0.0
  assert not marker.exists()
  assert logic.unsafe_for_eval("sin(x)**2 + C") is None
  assert logic.unsafe_for_eval("[[1, 0], [0, 1]]") is None
  assert logic.unsafe_for_eval("3.75") is None


def test_reasoning_gym_bad_entries():
  with pytest.raises(VerifierError, match="source_dataset"):
    logic.reasoning_gym_score("<answer>1</answer>", {"answer": "1", "metadata": {}})
  with pytest.raises(VerifierError, match="no_such_task"):
    logic.reasoning_gym_score("<answer>1</answer>",
                              {"answer": "1", "metadata": {"source_dataset": "no_such_task"}})
