"""Math equivalence judged with math-verify and sympy: the helper-process half of `math_answers`.

`math_answers.check` extracts and cleans the candidates on the caller's side, then sends them and
the ground truth to `judge`, which runs in a killable helper process (`deadline`) that preloads
this module. Only the helper imports math-verify and sympy (about a second of start-up): a trainer
or verifier worker that checks math answers never loads them itself.
"""

from __future__ import annotations

import functools
import logging
import math as _pymath
import re

import math_verify
import sympy

from reasoning_rl.verifiers.final_answer import boxed_contents
from reasoning_rl.verifiers.math_answers import (chain_links, clean_for_parsing,
                                                 strip_wrappers)

MAX_NUMBER_DIGITS = 10_000  # bound on the decimal digits of any number an answer may denote
_NUMERIC_LITERAL = re.compile(r"\d+(?:[.,]\d+)*")


class _MathVerifyTimeoutNotice(logging.Filter):
  """Drops math-verify's one-time 'timeout is disabled' warning: we enforce our own deadline."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
  logging.getLogger(_name).addFilter(_MathVerifyTimeoutNotice())


# -------------------------------------------------------------------------------------------- parsing

_LATEX_ONLY = (math_verify.LatexExtractionConfig(boxed_match_priority=0),)


def _parse_strict(text: str) -> list:
  """Parse the whole of `text` as one LaTeX expression (math-verify's own timeout disabled)."""
  return math_verify.parse("\\boxed{" + text + "}", extraction_config=_LATEX_ONLY,
                           parsing_timeout=None)


def _parse_lenient(text: str) -> list:
  """math-verify's default extraction (finds the expression inside prose such as '5 cm')."""
  return math_verify.parse(text, parsing_timeout=None)


def _has_expression(parsed: list) -> bool:
  return any(isinstance(p, (sympy.Basic, sympy.MatrixBase)) for p in parsed)


def _free_symbols(parsed: list) -> bool:
  return any(getattr(p, "free_symbols", None) for p in parsed
             if isinstance(p, (sympy.Basic, sympy.MatrixBase)))


@functools.lru_cache(maxsize=4096)
def _parse_truth(ground_truth: str) -> tuple:
  """The reference answer: the ground truth, or its box, or the set of its distinct boxes."""
  boxes = list(dict.fromkeys(strip_wrappers(b) for b in boxed_contents(ground_truth)))
  text = clean_for_parsing(", ".join(boxes) if boxes else strip_wrappers(ground_truth))
  parsed = _parse_strict(text)
  if not _has_expression(parsed):
    parsed = _parse_lenient(text)
  return tuple(parsed)


def _parse_candidate(candidate: str, truth_has_symbols: bool) -> list:
  parsed = _parse_strict(candidate)
  if _has_expression(parsed) and (truth_has_symbols or not _free_symbols(parsed)):
    return parsed
  # Prose around a single number ("5 cm", "The answer is 5"): let math-verify find the number, but
  # only when there is exactly one, so it cannot pick one guess out of several.
  if len(_NUMERIC_LITERAL.findall(candidate)) == 1:
    lenient = _parse_lenient(candidate)
    if _has_expression(lenient):
      return lenient
  return parsed


def _log10_bound(expr) -> float:
  """An upper bound on log10 of the magnitude of numeric sub-expressions (symbols count as 1)."""
  if isinstance(expr, sympy.Integer):
    return _pymath.log10(abs(int(expr)) + 1)
  if isinstance(expr, sympy.Rational):
    return _pymath.log10(abs(int(expr.p)) + 1) + _pymath.log10(int(expr.q) + 1)
  if isinstance(expr, sympy.Float):
    return _pymath.log10(abs(float(expr)) + 1) if abs(float(expr)) < 1e300 else _pymath.inf
  args = getattr(expr, "args", ())
  bounds = [_log10_bound(a) for a in args if isinstance(a, (sympy.Basic, sympy.MatrixBase))]
  if not bounds:
    return 0.0
  if isinstance(expr, sympy.Pow):
    base, exponent = bounds[0], bounds[1]
    if base <= _pymath.log10(2) + 1e-12:  # |base| <= 1: 0**n, 1**n, (-1)**n stay small
      return 0.0
    if exponent > 15:
      return _pymath.inf
    return base * max(_magnitude(expr.exp, exponent), 1.0)
  if isinstance(expr, sympy.Mul):
    return sum(bounds)
  if isinstance(expr, sympy.factorial) or type(expr).__name__ in ("factorial", "gamma", "factorial2"):
    n = 10 ** bounds[0]
    return _pymath.inf if n > 1e7 else n * max(_pymath.log10(n), 1.0)
  return max(bounds) + _pymath.log10(len(bounds))


def _magnitude(expr, log10_bound: float) -> float:
  """|expr| when it is a number (safe to evaluate: its bound is small), else 10 ** its bound. A
  fractional exponent (10^{(\\sqrt{13} - 5)/6}) keeps a power small; its digit bound would not."""
  try:
    return abs(complex(expr.evalf(15))) if expr.is_number else 10 ** log10_bound
  except (TypeError, ValueError, ArithmeticError):
    return 10 ** log10_bound


def _too_large(parsed: list) -> bool:
  try:
    return any(_log10_bound(p) > MAX_NUMBER_DIGITS for p in parsed
               if isinstance(p, (sympy.Basic, sympy.MatrixBase)))
  except (OverflowError, ValueError, TypeError):
    return True


def _has_false_equation(parsed: list) -> bool:
  """True when the answer asserts a false numeric equation, e.g. `41 = 42` or `x = 41 = 42`
  (for answers to symbolic truths; `_judge_number` reads chains link by link).

  math-verify reads an equation as an assignment and compares only its right-hand side, so a chain
  `0 = 1 = … = 99` would otherwise match any of its numbers.
  """
  for expr in parsed:
    if not isinstance(expr, sympy.Basic):
      continue
    for node in sympy.preorder_traversal(expr):
      if isinstance(node, sympy.Eq) and not node.lhs.free_symbols and not node.rhs.free_symbols:
        if not math_verify.verify(node.rhs, node.lhs, timeout_seconds=None):
          return True
  return False


# ------------------------------------------------------------------------------------------- judging


def judge(candidates: tuple[str, ...], ground_truth: str) -> str:
  """The status of cleaned candidates against a ground truth (`math_answers.MathResult.status`:
  correct, wrong, multiple_answers, unevaluated, unparseable, too_large)."""
  truth = list(_parse_truth(ground_truth))
  if not truth:
    return "unparseable"
  if len(candidates) > 1 and _is_plural(truth):
    candidates = (", ".join(candidates),)  # "\boxed{1} and \boxed{2}" answer {1, 2}, as a set
  value = _assigned_number(truth[0])
  if value is not None:
    statuses = [_judge_number(c, [value]) for c in candidates]
  else:
    statuses = [_judge_expression(c, truth) for c in candidates]
  if all(s == "correct" for s in statuses):
    return "correct"
  if len(candidates) > 1 and "correct" in statuses:
    return "multiple_answers"  # disagreeing candidates, one of them right: a hedge
  return next(s for s in statuses if s != "correct")


def _assigned_number(truth) -> sympy.Number | None:
  """The number a truth states: itself, or the value a truth such as `x = 11` or `z = 1 + 1 = 2`
  assigns (math-verify compares an equation's right-hand side too); None for any other truth."""
  if isinstance(truth, sympy.Number):
    return truth
  equations = truth.args if isinstance(truth, sympy.And) else (truth,)
  if not equations or not all(isinstance(e, sympy.Eq) for e in equations):
    return None
  if not isinstance(equations[0].lhs, sympy.Symbol) or equations[-1].rhs.free_symbols:
    return None
  value = sympy.nsimplify(equations[-1].rhs) if equations[-1].rhs.is_number else None
  if not isinstance(value, sympy.Number):
    return None
  links = [e.rhs for e in equations]
  if any(link.free_symbols or sympy.simplify(link - value) != 0 for link in links):
    return None  # a chain whose links differ is no single value
  return value


def _is_plural(truth: list) -> bool:
  return isinstance(truth[0], sympy.FiniteSet) and len(truth[0]) > 1


def _judge_expression(candidate: str, truth: list) -> str:
  parsed = _parse_candidate(candidate, _free_symbols(truth) or _is_set_of_reals(truth))
  if not parsed:
    return "unparseable"
  if _too_large(parsed):
    return "too_large"
  if _has_false_equation(parsed):
    return "wrong"
  truth, parsed = _bounds_as_sets(truth, parsed)
  return "correct" if math_verify.verify(truth, parsed, timeout_seconds=None) else "wrong"


_INEQUALITY_SIGN = re.compile(
    r"[<>\u2264\u2265\u2260]|\\(?:le|ge|leq|geq|lt|gt|neq|ne|leqslant|geqslant)(?![A-Za-z])")
_BOUNDS = (sympy.StrictLessThan, sympy.LessThan, sympy.StrictGreaterThan, sympy.GreaterThan,
           sympy.Unequality)


def _is_set_of_reals(parsed: list) -> bool:
  return bool(parsed) and isinstance(parsed[0], (sympy.Interval, sympy.Union))


def _bounds_as_sets(truth: list, parsed: list) -> tuple[list, list]:
  """When one side is an interval (or a union of intervals) and the other bounds one variable
  (`x \\geq 3`, `-1 < x \\leq 2`, `x \\neq 2`), the bounds as the set they describe, so that
  `[3, \\infty)` and `x \\geq 3` compare as the same set; math-verify compares a relation with a
  set as unequal. Otherwise both unchanged."""
  if _is_set_of_reals(truth) and (described := _bound_as_set(parsed[0])) is not None:
    return truth, [described]
  if _is_set_of_reals(parsed) and (described := _bound_as_set(truth[0])) is not None:
    return [described], parsed
  return truth, parsed


def _bound_as_set(expr) -> sympy.Set | None:
  """The set of reals that bounds on one variable describe, or None. Only bounds, the variable
  alone on one side and a number on the other: `x^2 \\geq 4` (the question left unsolved) stays a
  relation, as `40 + 2` stays arithmetic left undone."""
  relations = expr.args if isinstance(expr, sympy.And) else (expr,)
  if not isinstance(expr, sympy.Basic) or not relations or \
      not all(isinstance(r, _BOUNDS) for r in relations) or len(expr.free_symbols) != 1:
    return None
  (variable,) = expr.free_symbols
  for relation in relations:
    bound = relation.rhs if relation.lhs == variable else relation.lhs if relation.rhs == variable \
        else None
    if bound is None or not bound.is_extended_real:
      return None
  try:
    return expr.as_set()
  except (TypeError, ValueError, NotImplementedError, AttributeError):
    return None


# Arithmetic left undone: "40 + 2", "6 \times 7" (an echo of the question), but not "3 \times 10^5".
_UNEVALUATED = re.compile(
    r"(?<![\d.^_{])\d+(?:\.\d+)?\s*(?:[-+*\u00d7\u00b7\u00f7\u2212]|\\times|\\cdot|\\div)\s*"
    r"[({]?\s*-?(?!10\s*\^)\d")
_DECIMAL_COMMA = re.compile(r"-?\d+,(?:\d{1,2}|\d{4,})")  # 1000,99; not 1,000 (thousands)
_SUBSCRIPTS_AND_ARGUMENTS = re.compile(r"_\{[^{}]*\}|_\w|(?<=[A-Za-z])\([^()]*\)")
MAX_CHAIN_LINKS = 16  # a longer chain of equalities is spam; refuse without parsing


def _judge_number(candidate: str, truth: list) -> str:
  """A numeric truth: the value the candidate states, read from a chain `a = b ≈ c` link by link.

  The first link may name the quantity (`x = …`, `P(A) = …`). Every other link must hold (an exact
  link equal, an approximate one equal after rounding to its decimals), with two exceptions that
  are slips in the working, not second answers:
  - a false exact link whose left side is arithmetic (`3+3 = 2`): the chain goes on, and its last
    link still answers;
  - a false approximation (`1/3 ≈ 1.3`): the exact value before it answers, the rounding is
    dropped.
  Either way the chain states one value, so a slip earns only on a truth equal to that value.
  A false link between two stated values (`41 = 42`, `x = 7 = 11`) commits to two answers and is
  wrong; so is arithmetic left undone as the answer.
  """
  links = chain_links(candidate)
  if len(links) > MAX_CHAIN_LINKS:
    return "wrong"
  if any("," in text for _, text in links[1:-1]):
    return _judge_expression(candidate, truth)  # "x = 1, x = 2": a list of equations, no chain
  texts = [text for _, text in links]
  if _DECIMAL_COMMA.fullmatch(texts[-1]):
    texts[-1] = texts[-1].replace(",", ".")
  refusal = _refuse_as_answer(texts[-1])
  if refusal:
    return refusal
  values = [_parse_candidate(text, False) for text in texts]
  if not values[-1]:
    return "unparseable"
  if any(_too_large(v) for v in values):
    return "too_large"
  answer = len(links) - 1
  for i in range(1, len(links)):
    left, right = values[i - 1], values[i]
    if i == 1 and _names_quantity(texts[0]):
      continue
    if _link_holds(left, right, links[i][0], texts[i]):
      continue
    if _has_expression(left) and not _free_symbols(left):
      if links[i][0] == "~":  # a rounding slip: the exact value it rounds answers
        answer = i - 1
        break
      if _is_arithmetic(texts[i - 1]):  # a slip in the working: the chain goes on
        continue
    return "wrong"
  if answer != len(links) - 1:
    refusal = _refuse_as_answer(texts[answer])
    if refusal:
      return refusal
  if _has_false_equation(values[answer]):
    return "wrong"
  return "correct" if math_verify.verify(truth, values[answer], timeout_seconds=None) else "wrong"


def _is_arithmetic(text: str) -> bool:
  """True for arithmetic written out (`5+5+1`, `2 \\cdot 21`), not for a stated value."""
  return bool(_UNEVALUATED.search(clean_for_parsing(text).replace("{,}", "")))


def _refuse_as_answer(text: str) -> str | None:
  """Why the link a chain answers with is no answer: arithmetic left undone, or a bound."""
  if _is_arithmetic(text):
    return "unevaluated"
  if _states_a_bound(text):
    return "wrong"
  return None


def _states_a_bound(text: str) -> bool:
  """True for an inequality (`x \\geq 42`, `42 \\leq x < 50`): it bounds the number, it does not
  state it, so it answers no numeric truth (math-verify's extraction would read 42 from it)."""
  if not _INEQUALITY_SIGN.search(text):
    return False  # no parse needed
  parsed = _parse_strict(text)
  return any(isinstance(p, _BOUNDS) or (isinstance(p, sympy.And) and any(
      isinstance(a, _BOUNDS) for a in p.args)) for p in parsed)


def _names_quantity(link: str) -> bool:
  """True for a first link that names what the chain computes: `x`, `P(A)`, `a_{37}`, `f(41)`, but
  not `\\text{41}`, `(41)` or `41x`."""
  return not re.search(r"\d", _SUBSCRIPTS_AND_ARGUMENTS.sub("", link))

def _link_holds(left: list, right: list, separator: str, right_text: str) -> bool:
  if not (_has_expression(left) and _has_expression(right)) or _free_symbols(right) \
      or _free_symbols(left):
    return False
  if separator == "=":
    return bool(math_verify.verify(left, right, timeout_seconds=None))
  decimals = re.fullmatch(r"-?[\d,]*\.(\d+)", right_text)
  tolerance = 0.5 * 10.0 ** -(len(decimals.group(1)) if decimals else 0)
  try:
    gap = abs(complex(sympy.N(left[0] - right[0], 30)))
  except (TypeError, ValueError, ArithmeticError):
    return False
  return gap <= tolerance * (1 + 1e-9)
