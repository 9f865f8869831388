"""Math answer checking: extract the final answer, decide equivalence with math-verify.

The answer is read from the `<answer>…</answer>` span(s), the `\\boxed{…}` command(s), or the free
text of a response (`extract`), always outside the chain of thought: whatever a `<think>` span holds
(`think_tag`; an unclosed one runs to the end, a `</think>` without an opening ends one the prompt
opened) never answers, in any mode. A span or free text written as prose states its answer in words
("So the total cost is 3*4 = 12 dollars."): `final_answer.read_final_answer` finds it. In a span or
free text, boxes followed by a statement naming the answer ("= \\boxed{200} … The final answer is
10,455.") were steps of the working: that statement answers.
Equivalence (fractions vs decimals, LaTeX forms, percentages, sets and intervals, units, thousands separators) is decided by
Hugging Face's math-verify (Kydlíček et al., https://github.com/huggingface/Math-Verify).

Hedging earns nothing: a response that commits to several *different* candidates (two answer spans
or boxes that disagree, `3 or 4`, a list of guesses when the truth is one number, numbers separated
only by whitespace, a second answer after "the answer is …") is wrong even if one of them is right,
and so is a stated answer that hedges, negates or bounds itself ("maybe 42", "not 42", "at least
42"). Several candidates are read as one set only when the truth is a set of several elements. For
a numeric truth a chain `3*4 = 12` states one value, its last link: a link equating two stated
values makes it wrong (`41 = 42`, `x = 41 = 42`), while a slip in the working does not (`3+3 = 2`
answers 2; `1/3 ≈ 1.3` answers 1/3, the rounding dropped). Arithmetic left undone (`40 + 2`, an
echo of the question) is no answer, nor is a bound (`x \\geq 42`); bounds on one variable answer an
interval truth (`x \\geq 3` is `[3, \\infty)`). Whatever the phrasing, a response states at most
one answer: it earns only on truths equivalent to that answer.

Timeouts: math-verify's own timeout uses `signal.alarm`, which only works in the main thread and
whose exception can be swallowed mid-computation. It is disabled here; instead the parsing and
comparison run in a reusable helper process that is killed when the deadline passes (`deadline`),
which works from any thread or process and cannot be dodged. Answers whose numeric magnitude is
absurd are still refused before evaluation, so they cost no helper restart.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import importlib.metadata
import logging
import math as _pymath
import re

import math_verify
import sympy

from reasoning_rl import config_groups
from reasoning_rl.errors import ConfigError
from reasoning_rl.verifiers import deadline
from reasoning_rl.verifiers.final_answer import (  # noqa: F401  (published here too)
    MAX_ANSWER_CHARS, FinalAnswer, boxed_contents, read_final_answer)
from reasoning_rl.verifiers.format import outside_tag, tag_contents

MATH_VERIFIER_VERSION = "math-5+math_verify-" + importlib.metadata.version("math-verify")

EXTRACT_MODES = config_groups.EXTRACT_MODES  # declared with the setting that names them
# A signed integer or decimal, with optional thousands separators: the final number of free-form
# text ("… so 6 - 2 = 4."). For chat models that write no answer tags, on numeric tasks.
_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.])-?\d+(?:\.\d+)?(?![\w])")
# free text is read after the last closing tag
_CLOSING_TAG = re.compile(r"</[A-Za-z_][\w-]*>")
MAX_CANDIDATES = 8  # more distinct candidates than this is spam; refuse without parsing
MAX_NUMBER_DIGITS = 10_000  # bound on the decimal digits of any number an answer may denote

log = logging.getLogger(__name__)


class _MathVerifyTimeoutNotice(logging.Filter):
  """Drops math-verify's one-time 'timeout is disabled' warning: we enforce our own deadline."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
  logging.getLogger(_name).addFilter(_MathVerifyTimeoutNotice())


@dataclasses.dataclass(frozen=True)
class MathResult:
  """Outcome of one check. `status` is one of: correct, wrong, no_answer, multiple_answers,
  hedged (the stated answer hedges, negates or bounds: "maybe 42", "not 42", "at least 42"),
  unevaluated (arithmetic left undone, "40 + 2", for a numeric truth), unparseable, too_large,
  timeout."""

  correct: bool
  status: str
  candidates: tuple[str, ...] = ()


# ----------------------------------------------------------------------------------------- extraction


def extract_candidates(response: str, extract: str = "answer_or_boxed",
                       answer_tag: str = "answer", think_tag: str = "think") -> list[str]:
  """Every final-answer candidate of `response`, in order (the last one is "the" answer).

  Read outside the `think_tag` spans (`format.outside_tag`) in every mode:

  - `answer`: the final answer of each `<answer>` span (`read_final_answer`: its `\\boxed{}`s, the
    span itself when it is plain math, else the answer its prose states).
  - `boxed`: every `\\boxed{…}` in the response.
  - `answer_or_boxed`: the answer spans when there is at least one, else every box.
  - `final_answer`: the answer spans when there is at least one, else the final answer of the free
    text after the last closing tag (`</think>`): its boxes, else what its prose states. For chat
    models that answer in sentences ("So the total cost is 3*4 = 12 dollars.").
  - `last_number`: the last number written anywhere in the response (one candidate), for models
    that answer in free text; only meaningful for numeric ground truths. Credits hedges whose last
    number is right ("3 or 4"); `final_answer` does not.
  A response that hedges in words ("maybe 42", "not 42") has no candidates; `check` says why.
  """
  return list(_extract(response, extract, answer_tag, think_tag)[0])


def _extract(response: str, extract: str, answer_tag: str,
             think_tag: str = "think") -> tuple[tuple[str, ...], str | None]:
  """(candidates, refusal): refusal is "hedged" when the stated answer hedges or negates."""
  if extract not in EXTRACT_MODES:
    raise ConfigError(f"math.extract={extract!r} is unknown; choose one of {EXTRACT_MODES}")
  if think_tag == answer_tag:
    raise ConfigError(f"math: think_tag and answer_tag are both {think_tag!r}; they must differ")
  response = outside_tag(response, think_tag)
  if extract == "last_number":
    numbers = _NUMBER.findall(response)
    return ((numbers[-1].replace(",", ""),) if numbers else ()), None
  spans = tag_contents(response, answer_tag) if extract != "boxed" else []
  if spans:
    readings = [read_final_answer(span) for span in spans]
  elif extract == "final_answer":
    readings = [read_final_answer(_CLOSING_TAG.split(response)[-1])]
  elif extract != "answer":
    readings = [FinalAnswer(tuple(boxed_contents(response)))]
  else:
    readings = []
  refusal = next((r.refusal for r in readings if r.refusal), None)
  candidates = [c for r in readings for c in (_strip_wrappers(c) for c in r.candidates) if c]
  return tuple(candidates), refusal


def _strip_wrappers(candidate: str) -> str:
  text = candidate.strip().rstrip(".").strip()
  for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
    if text.startswith(left) and text.endswith(right) and len(text) >= len(left) + len(right):
      text = text[len(left):len(text) - len(right)].strip()
  return text.rstrip(".").strip()


# Thin spaces used as thousands separators in LaTeX and typography: 1\,000, 1\ 000, 1 000.
_THOUSANDS_SPACE = re.compile(r"(?<=\d)(?:\\,|\\ |\\;|~|\u2009|\u202f)(?=\d{3}(?!\d))")
# A plain space separates thousands only in a whole number written so: "1 000", "12 345 678".
_THOUSANDS_PLAIN_SPACE = re.compile(r"(?<![\d.,])(?<!\d )\d{1,3}(?: \d{3})+(?!\d| \d)")
# Two numbers separated only by (LaTeX) whitespace: "1 2 3", "41 \; 42" (parsed as a sum).
_WHITESPACE_SEPARATED_NUMBERS = re.compile(r"\d\s+[\d.]")
# An upright single letter (`\\mathrm{e}`), which math-verify cannot parse, is the letter itself.
_UPRIGHT_LETTER = re.compile(r"\\(?:mathrm|rm)\s*\{([A-Za-z])\}")
_LATEX_SPACE = re.compile(r"\\(?:quad|qquad|[,;:! ])|~")
# Logical "or" that math-verify does not turn into a set: "x = 41 \lor x = 42" parses as 42.
_DISJUNCTION = re.compile(r"\\(?:lor|vee|parallel)(?![A-Za-z])|\|\|")
_NUMERIC_LITERAL = re.compile(r"\d+(?:[.,]\d+)*")
# Scientific notation as programs print it ("5.619080000000000e+02", "1e-3"), which math-verify
# reads as a product with Euler's number e.
_E_NOTATION = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?[eE][+-]?\d{1,3}(?![\w.])")


def _clean_for_parsing(candidate: str) -> str:
  """Before parsing: thousands written with (LaTeX) spaces as plain digits ("1\\,000", "1 000" →
  "1000"), upright single letters as letters ("\\mathrm{x}" → "x") and scientific notation
  written out ("5.6e+02" → "560"). Not a canonical form (that is `evaluation.normalise_answer`,
  for voting): only what math-verify would misread."""
  candidate = _UPRIGHT_LETTER.sub(r"\1", _THOUSANDS_SPACE.sub("", candidate))
  candidate = _E_NOTATION.sub(lambda m: format(decimal.Decimal(m.group()), "f"), candidate)
  return _THOUSANDS_PLAIN_SPACE.sub(lambda m: m.group().replace(" ", ""), candidate)


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
  boxes = list(dict.fromkeys(_strip_wrappers(b) for b in boxed_contents(ground_truth)))
  text = _clean_for_parsing(", ".join(boxes) if boxes else _strip_wrappers(ground_truth))
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


# ------------------------------------------------------------------------------------------- timeouts


# One pool of killable helper processes per process (see `deadline`); each has sympy and
# math-verify imported once, so a check costs a socket round trip on top of the parsing itself.
_RUNNER = deadline.DeadlineRunner(preload=__name__)


# ------------------------------------------------------------------------------------------ checking


def check(response: str, ground_truth: str, *, extract: str = "answer_or_boxed",
          timeout_s: float = 5.0, answer_tag: str = "answer",
          think_tag: str = "think") -> MathResult:
  """Like `is_correct`, but says why (see `MathResult.status`)."""
  if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
    raise ConfigError(f"math.timeout_s={timeout_s!r} must be a positive number of seconds")
  candidates, refusal = _extract(response, extract, answer_tag, think_tag)
  # The caps apply to the raw candidates, before any is cleaned: cleaning costs time linear in a
  # candidate's length, and spam brings thousands of them (50k nested boxes took 12.6 s).
  raw = tuple(dict.fromkeys(candidates))
  shown = tuple(dict.fromkeys(_clean_for_parsing(c) for c in raw[:MAX_CANDIDATES]))
  if refusal:
    return MathResult(False, refusal, shown)
  if not raw:
    return MathResult(False, "no_answer")
  if len(raw) > MAX_CANDIDATES:
    return MathResult(False, "multiple_answers", shown)
  if any(len(c) > MAX_ANSWER_CHARS for c in raw):
    return MathResult(False, "too_large", shown)
  distinct = shown
  if any(len(c) > MAX_ANSWER_CHARS for c in distinct):  # cleaning writes out 1e999
    return MathResult(False, "too_large", distinct)
  if any(_WHITESPACE_SEPARATED_NUMBERS.search(_LATEX_SPACE.sub(" ", c)) for c in distinct):
    return MathResult(False, "multiple_answers", distinct)
  if not _DISJUNCTION.search(ground_truth) and any(_DISJUNCTION.search(c) for c in distinct):
    return MathResult(False, "multiple_answers", distinct)
  try:
    status = _RUNNER.run(_judge, distinct, ground_truth, timeout_s=float(timeout_s))
  except deadline.DeadlineExceeded:
    status = "timeout"
  if status == "timeout":
    log.warning("math check timed out after %.1fs on answer %r", timeout_s, distinct[-1][:80])
  return MathResult(status == "correct", status, distinct)


def _judge(candidates: tuple[str, ...], ground_truth: str) -> str:
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
_CHAIN_TOKEN = re.compile(r"\\approx(?![A-Za-z])|\u2248|(?<![<>!=:\\])=(?!=)|[{}]")
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
  links = _chain_links(candidate)
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
  return bool(_UNEVALUATED.search(_clean_for_parsing(text).replace("{,}", "")))


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


def answer_value(candidate: str) -> str:
  """The value a candidate states: the last link of a chain (`17 + 25 = 42` -> `42`), else itself
  (for comparing or voting on answers outside `check`)."""
  return _chain_links(candidate)[-1][1]


def _chain_links(text: str) -> list[tuple[str, str]]:
  """[(separator, link)] of a chain split at its top-level `=` / `\\approx` (the first separator is
  "")."""
  links, separator, start, depth = [], "", 0, 0
  for token in _CHAIN_TOKEN.finditer(text):
    if token.group() in "{}":
      depth = depth + 1 if token.group() == "{" else max(depth - 1, 0)
    elif depth == 0:
      links.append((separator, text[start:token.start()].strip()))
      separator, start = ("=" if token.group() == "=" else "~"), token.end()
  return links + [(separator, text[start:].strip())]


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


def is_correct(response: str, ground_truth: str, *, extract: str = "answer_or_boxed",
               timeout_s: float = 5.0, answer_tag: str = "answer",
               think_tag: str = "think") -> bool:
  """True iff the response's final answer is equivalent to `ground_truth`.

  Args:
    response: the model's completion.
    ground_truth: the reference answer (plain, LaTeX, or a solution whose `\\boxed{}` is it; the
      distinct boxes of a truth with several make a set).
    extract: where the answer is read: `answer_or_boxed` (the `<answer>` spans, else the
      `\\boxed{}`s), `answer`, `boxed`, `final_answer` (the spans, else the answer the free text
      states) or `last_number` (the last number in the text); see `extract_candidates`.
    timeout_s: wall-clock budget of the whole check; on timeout the answer is judged wrong.
    answer_tag: name of the answer tag.
    think_tag: name of the reasoning tag, whose content never answers.
  All candidates found must be equivalent to the truth; several different ones earn nothing.
  """
  return check(response, ground_truth, extract=extract, timeout_s=timeout_s,
               answer_tag=answer_tag, think_tag=think_tag).correct
