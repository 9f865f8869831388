"""Math answer checking: extract the final answer, decide equivalence with math-verify.

The answer is the content of the `<answer>…</answer>` span(s) or of the `\\boxed{…}` command(s) of a
response (which one is configurable). Equivalence (fractions vs decimals, LaTeX forms, percentages,
sets and intervals, units, thousands separators) is decided by Hugging Face's math-verify.

Hedging earns nothing: a response that commits to several *different* candidates (two answer spans
or boxes that disagree, `3 or 4`, a list of guesses when the truth is one number, numbers separated
only by whitespace) is wrong even if one of them is right.

Timeouts: math-verify's own timeout uses `signal.alarm`, which only works in the main thread and
whose exception can be swallowed mid-computation. It is disabled here; instead the parsing and
comparison run in a reusable helper process that is killed when the deadline passes (`deadline`),
which works from any thread or process and cannot be dodged. Answers whose numeric magnitude is
absurd are still refused before evaluation, so they cost no helper restart.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import math as _pymath
import re

import math_verify
import sympy

from reasoning_rl.errors import ConfigError
from reasoning_rl.verifiers import deadline
from reasoning_rl.verifiers.format import tag_contents

MATH_VERIFIER_VERSION = "math-1+math_verify-" + importlib.metadata.version("math-verify")

EXTRACT_MODES = ("answer_or_boxed", "answer", "boxed", "last_number")
# A signed integer or decimal, with optional thousands separators: the final number of free-form
# text ("… so 6 - 2 = 4."). For chat models that write no answer tags, on numeric tasks.
_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.])-?\d+(?:\.\d+)?(?![\w])")
MAX_ANSWER_CHARS = 1000  # longer "answers" are spam, and slow to parse
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
  unparseable, too_large, timeout."""

  correct: bool
  status: str
  candidates: tuple[str, ...] = ()


# ----------------------------------------------------------------------------------------- extraction


def boxed_contents(text: str) -> list[str]:
  """Contents of every complete `\\boxed{…}` / `\\fbox{…}` in `text`, nested braces respected.

  Escaped braces (`\\{`, `\\}`) do not count towards nesting. An unclosed box (a truncated response)
  is ignored. One linear pass, so spam of unclosed boxes cannot make it quadratic; contents longer
  than MAX_ANSWER_CHARS are cut just past that bound (they are refused as too large anyway).
  """
  box_braces = {m.end() - 1 for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)}
  if not box_braces:
    return []
  found, open_braces, i = [], [], 0
  while i < len(text):
    ch = text[i]
    if ch == "\\":
      i += 2
      continue
    if ch == "{":
      open_braces.append(i)
    elif ch == "}" and open_braces:
      start = open_braces.pop()
      if start in box_braces:
        found.append((start, text[start + 1:min(i, start + 2 + MAX_ANSWER_CHARS)]))
    i += 1
  return [content for _, content in sorted(found)]


def extract_candidates(response: str, extract: str = "answer_or_boxed",
                       answer_tag: str = "answer") -> list[str]:
  """Every final-answer candidate of `response`, in order (the last one is "the" answer).

  - `answer`: the contents of each `<answer>` span (a span holding `\\boxed{}`s yields the boxes).
  - `boxed`: every `\\boxed{…}` in the response.
  - `answer_or_boxed`: the answer spans when there is at least one, else every box.
  - `last_number`: the last number written anywhere in the response (one candidate), for models
    that answer in free text; only meaningful for numeric ground truths.
  """
  if extract not in EXTRACT_MODES:
    raise ConfigError(f"math.extract={extract!r} is unknown; choose one of {EXTRACT_MODES}")
  if extract == "last_number":
    numbers = _NUMBER.findall(response)
    return [numbers[-1].replace(",", "")] if numbers else []
  candidates: list[str] = []
  spans = tag_contents(response, answer_tag) if extract != "boxed" else []
  if spans:
    for span in spans:
      boxes = boxed_contents(span)
      candidates.extend(boxes if boxes else [span])
  elif extract != "answer":
    candidates = boxed_contents(response)
  return [c for c in (_strip_wrappers(c) for c in candidates) if c]


def _strip_wrappers(candidate: str) -> str:
  text = candidate.strip().rstrip(".").strip()
  for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
    if text.startswith(left) and text.endswith(right) and len(text) >= len(left) + len(right):
      text = text[len(left):len(text) - len(right)].strip()
  return text.rstrip(".").strip()


# Thin spaces used as thousands separators in LaTeX and typography: 1\,000, 1\ 000, 1 000.
_THOUSANDS_SPACE = re.compile(r"(?<=\d)(?:\\,|\\ |\\;|~|\u2009|\u202f)(?=\d{3}(?!\d))")
# Two numbers separated only by (LaTeX) whitespace: "1 2 3", "41 \; 42" (parsed as a sum).
_WHITESPACE_SEPARATED_NUMBERS = re.compile(r"\d\s+[\d.]")
_LATEX_SPACE = re.compile(r"\\(?:quad|qquad|[,;:! ])|~")
# Logical "or" that math-verify does not turn into a set: "x = 41 \lor x = 42" parses as 42.
_DISJUNCTION = re.compile(r"\\(?:lor|vee|parallel)(?![A-Za-z])|\|\|")
_NUMERIC_LITERAL = re.compile(r"\d+(?:[.,]\d+)*")


def _normalise(candidate: str) -> str:
  return _THOUSANDS_SPACE.sub("", candidate)


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
  boxes = boxed_contents(ground_truth)
  text = _normalise(_strip_wrappers(boxes[-1] if boxes else ground_truth))
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
    return _parse_lenient(candidate)
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
    return _pymath.inf if exponent > 15 else base * 10 ** exponent
  if isinstance(expr, sympy.Mul):
    return sum(bounds)
  if isinstance(expr, sympy.factorial) or type(expr).__name__ in ("factorial", "gamma", "factorial2"):
    n = 10 ** bounds[0]
    return _pymath.inf if n > 1e7 else n * max(_pymath.log10(n), 1.0)
  return max(bounds) + _pymath.log10(len(bounds))


def _too_large(parsed: list) -> bool:
  try:
    return any(_log10_bound(p) > MAX_NUMBER_DIGITS for p in parsed
               if isinstance(p, (sympy.Basic, sympy.MatrixBase)))
  except (OverflowError, ValueError, TypeError):
    return True


def _has_false_equation(parsed: list) -> bool:
  """True when the answer asserts a false numeric equation, e.g. `41 = 42` or `x = 41 = 42`.

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
          timeout_s: float = 5.0, answer_tag: str = "answer") -> MathResult:
  """Like `is_correct`, but says why (see `MathResult.status`)."""
  if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
    raise ConfigError(f"math.timeout_s={timeout_s!r} must be a positive number of seconds")
  candidates = extract_candidates(response, extract, answer_tag)
  if not candidates:
    return MathResult(False, "no_answer")
  distinct = tuple(dict.fromkeys(_normalise(c) for c in candidates))
  if len(distinct) > MAX_CANDIDATES:
    return MathResult(False, "multiple_answers", distinct[:MAX_CANDIDATES])
  if any(len(c) > MAX_ANSWER_CHARS for c in distinct):
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
  truth_has_symbols = _free_symbols(truth)
  statuses = []
  for candidate in candidates:
    parsed = _parse_candidate(candidate, truth_has_symbols)
    if not parsed:
      statuses.append("unparseable")
    elif _too_large(parsed):
      statuses.append("too_large")
    elif _has_false_equation(parsed):
      statuses.append("wrong")
    elif math_verify.verify(truth, parsed, timeout_seconds=None):
      statuses.append("correct")
    else:
      statuses.append("wrong")
  if all(s == "correct" for s in statuses):
    return "correct"
  if len(candidates) > 1 and "correct" in statuses:
    return "multiple_answers"  # disagreeing candidates, one of them right: a hedge
  return next(s for s in statuses if s != "correct")


def is_correct(response: str, ground_truth: str, *, extract: str = "answer_or_boxed",
               timeout_s: float = 5.0, answer_tag: str = "answer") -> bool:
  """True iff the response's final answer is equivalent to `ground_truth` (DESIGN.md §3).

  Args:
    response: the model's completion.
    ground_truth: the reference answer (plain, LaTeX, or a solution whose last `\\boxed{}` is it).
    extract: where the answer is read: `answer_or_boxed` (the `<answer>` spans, else the
      `\\boxed{}`s), `answer`, `boxed`, or `last_number` (the last number in the text).
    timeout_s: wall-clock budget of the whole check; on timeout the answer is judged wrong.
    answer_tag: name of the answer tag.
  All candidates found must be equivalent to the truth; several different ones earn nothing.
  """
  return check(response, ground_truth, extract=extract, timeout_s=timeout_s,
               answer_tag=answer_tag).correct
