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
comparison (`math_judge`, the only module that imports math-verify and sympy) run in a reusable
helper process that is killed when the deadline passes (`deadline`), which works from any thread
or process and cannot be dodged. Answers whose numeric magnitude is
absurd are still refused before evaluation, so they cost no helper restart.
"""

from __future__ import annotations

import dataclasses
import decimal
import importlib.metadata
import logging
import re

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

log = logging.getLogger(__name__)


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
  candidates = [c for r in readings for c in (strip_wrappers(c) for c in r.candidates) if c]
  return tuple(candidates), refusal


def strip_wrappers(candidate: str) -> str:
  """The candidate without math delimiters ($…$, $$…$$, \\(…\\), \\[…\\]) and a final period."""
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
# Scientific notation as programs print it ("5.619080000000000e+02", "1e-3"), which math-verify
# reads as a product with Euler's number e.
_E_NOTATION = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?[eE][+-]?\d{1,3}(?![\w.])")


def clean_for_parsing(candidate: str) -> str:
  """Before parsing: thousands written with (LaTeX) spaces as plain digits ("1\\,000", "1 000" →
  "1000"), upright single letters as letters ("\\mathrm{x}" → "x") and scientific notation
  written out ("5.6e+02" → "560"). Not a canonical form (that is `evaluation.normalise_answer`,
  for voting): only what math-verify would misread."""
  candidate = _UPRIGHT_LETTER.sub(r"\1", _THOUSANDS_SPACE.sub("", candidate))
  candidate = _E_NOTATION.sub(lambda m: format(decimal.Decimal(m.group()), "f"), candidate)
  return _THOUSANDS_PLAIN_SPACE.sub(lambda m: m.group().replace(" ", ""), candidate)


# ------------------------------------------------------------------------------------------- timeouts


# One pool of killable helper processes per process (see `deadline`); each has `math_judge`
# (sympy and math-verify) imported once, so a check costs a socket round trip on top of the
# parsing itself. The judge is sent by name: this process never imports it.
_JUDGE_MODULE = "reasoning_rl.verifiers.math_judge"
_RUNNER = deadline.DeadlineRunner(preload=_JUDGE_MODULE)
_JUDGE = deadline.FunctionByName(_JUDGE_MODULE, "judge")


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
  shown = tuple(dict.fromkeys(clean_for_parsing(c) for c in raw[:MAX_CANDIDATES]))
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
    status = _RUNNER.run(_JUDGE, distinct, ground_truth, timeout_s=float(timeout_s))
  except deadline.DeadlineExceeded:
    status = "timeout"
  if status == "timeout":
    log.warning("math check timed out after %.1fs on answer %r", timeout_s, distinct[-1][:80])
  return MathResult(status == "correct", status, distinct)


# the top-level separators of a chain of equalities / approximations (`chain_links`)
_CHAIN_TOKEN = re.compile(r"\\approx(?![A-Za-z])|\u2248|(?<![<>!=:\\])=(?!=)|[{}]")


def answer_value(candidate: str) -> str:
  """The value a candidate states: the last link of a chain (`17 + 25 = 42` -> `42`), else itself
  (for comparing or voting on answers outside `check`)."""
  return chain_links(candidate)[-1][1]


def chain_links(text: str) -> list[tuple[str, str]]:
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
