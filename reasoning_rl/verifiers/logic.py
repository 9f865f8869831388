"""Logic-task verifiers: countdown with a safe arithmetic parser, and any reasoning-gym task.

Countdown (as in TinyZero and reasoning-gym): combine the given numbers with + - * / and parentheses
to reach a target. The expression is parsed with `ast` and evaluated by walking a whitelist of node
types over exact `fractions.Fraction`s; nothing is ever passed to `eval`.

The reasoning-gym adapter calls the task's own `score_answer`. Several of those scorers run the
model's answer through `eval` or `sympy.parse_expr` (countdown, puzzle24, spiral_matrix, n_queens,
binary_matrix, string_insertion, simple_integration in reasoning-gym 0.1.25): an answer such as
`open('/x', 'w')` would run on the host. Answers that could call or reach anything (dunder names,
attribute access on a name, calls to names that are not plain math functions) are therefore refused
before any scorer sees them.
"""

from __future__ import annotations

import ast
import collections
import fractions
import functools
import importlib.metadata
import re
from collections.abc import Mapping, Sequence
from typing import Any

from reasoning_rl import config_groups
from reasoning_rl.errors import ConfigError, VerifierError
from reasoning_rl.verifiers.format import tag_contents

COUNTDOWN_VERIFIER_VERSION = "countdown-1"
REASONING_GYM_VERIFIER_VERSION = "reasoning_gym-1+rg-" + importlib.metadata.version("reasoning-gym")

USE_EACH_MODES = config_groups.USE_EACH_MODES  # declared with the setting that names them
MAX_EXPRESSION_CHARS = 500
MAX_EXPRESSION_NODES = 200

_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
_SYMBOL_ALIASES = str.maketrans({"×": "*", "·": "*", "÷": "/", "−": "-", "–": "-"})


class InvalidExpression(ValueError):
  """The text is not an arithmetic expression of the allowed form."""


def evaluate_arithmetic(expression: str, *, allow_unary_minus: bool = False
                        ) -> tuple[fractions.Fraction, list[int]]:
  """Exact value of `expression` and the integer literals it uses, in order of appearance.

  Allowed: integer literals in plain decimal digits, binary + - * /, parentheses, and (optionally) unary minus.
  Anything else (powers, calls, names, floats, comparisons, `=`) raises InvalidExpression, as does
  division by zero.
  """
  text = expression.translate(_SYMBOL_ALIASES).strip()
  if not text:
    raise InvalidExpression("empty expression")
  if len(text) > MAX_EXPRESSION_CHARS:
    raise InvalidExpression(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
  try:
    tree = ast.parse(text, mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise InvalidExpression(f"not an expression: {e}") from e
  if sum(1 for _ in ast.walk(tree)) > MAX_EXPRESSION_NODES:
    raise InvalidExpression(f"more than {MAX_EXPRESSION_NODES} syntax nodes")
  numbers: list[int] = []

  def walk(node: ast.AST) -> fractions.Fraction:
    if isinstance(node, ast.Expression):
      return walk(node.body)
    if isinstance(node, ast.Constant):
      if type(node.value) is not int:  # bool is an int subclass: excluded
        raise InvalidExpression(f"only integer literals are allowed, got {node.value!r}")
      if not re.fullmatch(r"[0-9]+", ast.get_source_segment(text, node) or ""):
        raise InvalidExpression("integers must be written in plain decimal digits (no 0x, 1_000)")
      numbers.append(node.value)
      return fractions.Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
      left, right = walk(node.left), walk(node.right)
      if isinstance(node.op, ast.Div) and right == 0:
        raise InvalidExpression("division by zero")
      return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and allow_unary_minus:
      return -walk(node.operand)
    raise InvalidExpression(f"{type(node).__name__} is not allowed (only + - * / and parentheses)")

  try:
    value = walk(tree)
  except RecursionError as e:
    raise InvalidExpression("expression nested too deeply") from e
  return value, numbers


def countdown_expression_ok(expression: str, numbers: Sequence[int], target: int | fractions.Fraction,
                            *, use_each: str = "exactly_once", allow_unary_minus: bool = False
                            ) -> bool:
  """True iff `expression` evaluates exactly to `target` using the given numbers as allowed.

  `use_each="exactly_once"`: the literals are the given numbers as a multiset (every number used,
  none reused). `"at_most_once"`: the literals form a sub-multiset of the given numbers.
  """
  if use_each not in USE_EACH_MODES:
    raise ConfigError(f"countdown.use_each={use_each!r} is unknown; choose one of {USE_EACH_MODES}")
  try:
    value, used = evaluate_arithmetic(expression, allow_unary_minus=allow_unary_minus)
  except InvalidExpression:
    return False
  available = collections.Counter(int(n) for n in numbers)
  used_counts = collections.Counter(used)
  if use_each == "exactly_once" and used_counts != available:
    return False
  if any(count > available[n] for n, count in used_counts.items()):
    return False
  return value == fractions.Fraction(target)


def _single_answer(response: str, extract: str, answer_tag: str) -> str | None:
  """The final answer text, or None when missing or when several different answers are given."""
  if extract == "none":
    return response.strip() or None
  if extract != "answer":
    raise ConfigError(f"logic.extract={extract!r} is unknown; choose 'answer' or 'none'")
  spans = {s.strip() for s in tag_contents(response, answer_tag)}
  spans.discard("")
  return spans.pop() if len(spans) == 1 else None


def countdown_correct(response: str, numbers: Sequence[int], target: int, *,
                      extract: str = "answer", use_each: str = "exactly_once",
                      allow_unary_minus: bool = False, answer_tag: str = "answer") -> bool:
  """Countdown verifier: the response's answer (last `<answer>` span; several different spans earn
  nothing; `extract="none"` takes the whole response) reaches `target` (see countdown_expression_ok)."""
  answer = _single_answer(response, extract, answer_tag)
  if answer is None:
    return False
  if answer.count("=") == 1:
    left, right = answer.split("=")
    if _is_target(right, target):
      answer = left
  return countdown_expression_ok(answer, numbers, target, use_each=use_each,
                                 allow_unary_minus=allow_unary_minus)


def _is_target(text: str, target) -> bool:
  """`… = 309` with the true target on the right is accepted as the expression on the left."""
  try:
    return fractions.Fraction(text.strip()) == fractions.Fraction(target)
  except (ValueError, ZeroDivisionError):
    return False


# ------------------------------------------------------------------------------------- reasoning-gym

_SAFE_CALLS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh", "tanh",
    "exp", "log", "ln", "sqrt", "abs", "Abs", "sign", "floor", "ceiling",
})
_CALL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_ATTRIBUTE = re.compile(r"[A-Za-z_)\]}'\"]\s*\.\s*[A-Za-z_]")


def unsafe_for_eval(answer: str) -> str | None:
  """Why `answer` must not reach a scorer that may `eval` it, or None when it looks harmless."""
  if "__" in answer:
    return "dunder name"
  if _ATTRIBUTE.search(answer):
    return "attribute access"
  for name in _CALL.findall(answer):
    if name not in _SAFE_CALLS:
      return f"call to {name!r}"
  if re.search(r"\b(lambda|import|exec|eval|open|globals|locals|getattr|setattr)\b", answer):
    return "code keyword"
  return None


@functools.lru_cache(maxsize=None)
def _score_fn(dataset_name: str):
  import reasoning_gym  # heavy import: only when a reasoning-gym task is scored

  try:
    return reasoning_gym.get_score_answer_fn(dataset_name)
  except ValueError as e:
    raise VerifierError(
        f"reasoning-gym has no dataset {dataset_name!r} (entry metadata.source_dataset); "
        "check the task name or the installed reasoning-gym version"
    ) from e


def reasoning_gym_score(response: str, entry: Mapping[str, Any], *, extract: str = "answer",
                        success_threshold: float | None = 1.0, answer_tag: str = "answer") -> float:
  """Score a response to a reasoning-gym entry with that task's own `score_answer`.

  Args:
    response: the model's completion.
    entry: the reasoning-gym entry (`question`, `answer`, `metadata` with `source_dataset`).
    extract: `answer` (the `<answer>` span; several different spans earn nothing) or `none`.
    success_threshold: scores >= it become 1.0 and lower ones 0.0 (reasoning-gym gives consolation
      points such as 0.01 for any attempt, which an RL policy learns to farm); None keeps raw scores.
  """
  metadata = entry.get("metadata") if isinstance(entry, Mapping) else None
  if not isinstance(metadata, Mapping) or "source_dataset" not in metadata:
    raise VerifierError(
        "reasoning-gym entry has no metadata.source_dataset; pass the entry as generated by "
        "reasoning_gym.create_dataset (question, answer, metadata)"
    )
  answer = _single_answer(response, extract, answer_tag)
  if answer is None or unsafe_for_eval(answer):
    return 0.0
  score = float(_score_fn(metadata["source_dataset"])(answer, dict(entry)))
  if success_threshold is None:
    return score
  return 1.0 if score >= success_threshold else 0.0
