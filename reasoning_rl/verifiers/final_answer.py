r"""How a text states its final answer, read without a model so that no phrasing can hedge.

The math verifier (`math_answers`) reads an answer span or a free-text response with
`read_final_answer`. A text states its answer by
1. its `\boxed{}`s, when it has any (all of them: disagreeing boxes are a hedge), unless a
   statement after the last box names the answer ("= \boxed{200} … The final answer is 10,455."):
   then the boxes marked steps of the working, and the text is read by rule 3, each box as its
   contents (so a box in a statement naming the answer is still an answer);
2. the whole text, when it is plain math (no words outside LaTeX commands);
3. else its statements (sentences and lines; math between `$…$`, `\(…\)`, `\[…\]` is never cut;
   a `$…$` holding prose was two dollar signs: "He spends $5. The answer is $8$.").
   Within a statement the answer is the math after the last verb ("is", "equals", "gives",
   ":", …) that math follows, else all of its math: "The sum of 17 and 25 is 42." states 42,
   not 17. Words split math apart, so "41 or 42" is two candidates (a hedge), and
   "3*4 = 12 dollars" the chain 3*4 = 12; a word run into digits ("AZYUK2A") is a name, not
   math, and a choice letter "(B)" is math. The text's answer is stated by the first statement
   that names it before its verb ("the answer is …", "Result: …") together with every later
   statement that states a value (math right after its verb, or math with no verb: a different
   number there is a second answer; numbers merely mentioned further on, "divisible by 3 and 4",
   are not); without one, by the last statement holding math. Questions state nothing. Hedging
   words ("maybe", "perhaps", …) anywhere in the statement, or a negation or a bound after its
   verb ("is not 42", "has at least 42", "42 or more"), refuse the answer.

Every step is linear in the text (a longer text is read from its last MAX_READ_CHARS), so no
response can make reading slow.
"""

from __future__ import annotations

import dataclasses
import re

MAX_ANSWER_CHARS = 1000  # longer "answers" are spam, and slow to parse


def boxed_contents(text: str) -> list[str]:
  """Contents of every complete `\\boxed{…}` / `\\fbox{…}` in `text`, nested braces respected.

  Escaped braces (`\\{`, `\\}`) do not count towards nesting. An unclosed box (a truncated response)
  is ignored. One linear pass, so spam of unclosed boxes cannot make it quadratic; contents longer
  than MAX_ANSWER_CHARS are cut just past that bound (they are refused as too large anyway).
  """
  return _box_contents(text, _box_spans(text))


def _box_contents(text: str, spans: list[tuple[int, int, int]]) -> list[str]:
  return [text[brace + 1:min(close, brace + 2 + MAX_ANSWER_CHARS)] for _, brace, close in spans]


def _box_spans(text: str) -> list[tuple[int, int, int]]:
  """(command start, opening brace, closing brace) of every complete box, in order of start."""
  box_braces = {m.end() - 1: m.start() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)}
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
        found.append((box_braces[start], start, i))
    i += 1
  return sorted(found)


def _unboxed(text: str, spans: list[tuple[int, int, int]]) -> str:
  """`text` with each (non-nested) box replaced by its contents."""
  parts, position = [], 0
  for command, brace, close in spans:
    parts += [text[position:command], text[brace + 1:close]]
    position = close + 1
  return "".join(parts) + text[position:]


# A longer text is read from its tail (which also keeps its math segments fewer than the
# placeholder characters).
MAX_READ_CHARS = 100_000
_PLACEHOLDER = 0xF0000  # math segment i is masked as chr(_PLACEHOLDER + i): one char, no digit
_PLACEHOLDERS = re.compile("[\U000F0000-\U000FFFFD]")
_MATH_DELIMITER = re.compile(r"\$\$|\\\[|\\\]|\\\(|\\\)|\\\$|\$|\n")
_CLOSER = {"$$": "$$", "\\[": "\\]", "\\(": "\\)", "$": "$"}
_TEXT_COMMAND = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname|begin|end)\s*\{[^{}]*\}")
# Two words in a row (a capital allowed on the first): prose, inside what looked like `$…$` math.
_PROSE_RUN = re.compile(r"(?<![\\A-Za-z])[A-Za-z][a-z]+ +[a-z]{2,}(?![A-Za-z])")
_COMMAND_ARGUMENT = re.compile(r"\\[A-Za-z]+\s*\{[^{}]*\}")
# A word, or an identifier: a word of two or more letters run into digits ("AZYUK2A", "cm2") is a
# name, not a word followed by the number 2 (single letters run into digits, "x2", stay math).
_WORD = re.compile(
    r"(?<![\\A-Za-z])(?:[A-Za-z]{2,}\d[A-Za-z\d]*|[A-Za-z]+(?:['\u2019][A-Za-z]+)*)")
_STATEMENT_END = re.compile(r"(?<=[.!?])\s+|\s*\n\s*")
# A multiple-choice letter, "(B)": the only math without digits or commands a run may hold (a bare
# capital is as often the pronoun "I" or a label).
_CHOICE = re.compile(r"\([A-Z]\)")
_RUN_BREAK = re.compile(r":(?=\s)")  # "Step 2: 17 + 25 = 42" holds two runs; "7:32" one
_PIECE_STRIP = " \t\r\n.,;:!?\"'`*$\u20ac\u00a3\u00a5"
_MARKERS = frozenset({
    "is", "are", "was", "were", "be", "equals", "equal", "gives", "give", "get", "gets", "got",
    "makes", "make", "yields", "becomes", "has", "have", "had", "so", "thus", "therefore", "hence",
    "it's", "that's", "here's", "there's", "what's", "answer's"})
_HEDGES = frozenset({"maybe", "perhaps", "possibly", "probably", "might",
                     "guess", "unsure", "either"})
_NEGATIONS = frozenset({"not", "never", "neither", "nor", "cannot"})
_ANSWER_WORDS = frozenset({"answer", "answers", "result"})
# A bound or an estimate after the verb ("has at least 42", "is 42 or more", "42 or so") states
# no value: a range holding the truth is a hedge. Before the verb it qualifies something else
# ("3 more than Tom, so 42").
_BOUND_PHRASES = frozenset({("at", "least"), ("at", "most"), ("or", "more"), ("or", "less"),
                            ("or", "fewer"), ("or", "so"), ("more", "than"), ("less", "than"),
                            ("fewer", "than")})


@dataclasses.dataclass(frozen=True)
class FinalAnswer:
  """What a text states as its final answer: candidates (several = a hedge unless they agree), and
  `refusal` ("hedged") when the statement hedges or negates its answer."""

  candidates: tuple[str, ...]
  refusal: str | None = None


@dataclasses.dataclass(frozen=True)
class _Statement:
  pieces: tuple[str, ...]
  refusal: str | None
  names_answer: bool
  states_value: bool  # its math follows its verb ("it is 42") or it has no verb ("Or 42.")


def read_final_answer(text: str) -> FinalAnswer:
  """The final answer `text` states (see the comment above for the reading rules)."""
  spans = _box_spans(text)
  if not spans:
    return _read_prose(text)
  if _boxes_are_working(text, spans):
    return _read_prose(_unboxed(text, spans))
  return FinalAnswer(tuple(_box_contents(text, spans)))


def _boxes_are_working(text: str, spans: list[tuple[int, int, int]]) -> bool:
  """True when a statement after the last box names the answer ("= \\boxed{200} … So she has
  $10,455. The final answer is $10,455$."): the boxes marked steps of the working, and the text
  is read as prose (a box counting as its contents), so a box in a statement naming the answer
  still counts and one that disagrees with it is still a hedge. Nested boxes are never unboxed.
  """
  if _nested(spans):
    return False
  tail_masked, tail_segments = _mask_math(text[spans[-1][2] + 1:][-MAX_READ_CHARS:])
  return any(statement.names_answer and statement.pieces
             for statement in (_read_statement(s, tail_segments)
                               for s in _STATEMENT_END.split(tail_masked)))


def _nested(spans: list[tuple[int, int, int]]) -> bool:
  """True when a box lies inside another (then it lies inside the box just before it)."""
  return any(command < close for (_, _, close), (command, _, _) in zip(spans, spans[1:]))


def _read_prose(text: str) -> FinalAnswer:
  """The answer of a text without boxes (rules 2 and 3 above)."""
  masked, segments = _mask_math(text[-MAX_READ_CHARS:])
  if not any(_is_prose_word(w.group()) for w in _WORD.finditer(masked)):
    return FinalAnswer((_unmask(masked, segments).strip(),) if masked.strip() else ())
  statements = [_read_statement(s, segments) for s in _STATEMENT_END.split(masked)]
  statements = [s for s in statements if s.pieces or s.refusal]
  if not statements:
    return FinalAnswer(())
  named = [i for i, s in enumerate(statements) if s.names_answer]
  stated = _after_named_answer(statements, named[0]) if named else statements[-1:]
  return FinalAnswer(tuple(p for s in stated for p in s.pieces),
                     next((s.refusal for s in stated if s.refusal), None))


def _after_named_answer(statements: list[_Statement], named: int) -> list[_Statement]:
  """The statement naming the answer and every later one that states a value or refuses.

  A later statement that states a value ("Actually, it is 42.", "42", "Or 42.") is a second
  answer, so it makes a hedge. One that only mentions numbers among words after its verb ("it
  checks divisibility by 3 and 4", the notes a model rambles on with after "The final answer is
  14,916.") states none: its numbers are no answers, and dropping them can never credit a wrong
  one. Hedging words anywhere still refuse.
  """
  later = [s for s in statements[named + 1:] if s.states_value or s.refusal]
  return [statements[named]] + later


def _mask_math(text: str) -> tuple[str, list[str]]:
  """`text` with each math segment and each `\\text{…}`-like command replaced by one placeholder
  character, and the replaced texts (segment contents without their delimiters)."""
  segments: list[str] = []

  def keep(content: str) -> str:
    segments.append(content)
    return chr(_PLACEHOLDER + len(segments) - 1)

  parts, position = [], 0
  for start, end, content_start, content_end in _math_segments(text):
    parts += [text[position:start], keep(text[content_start:content_end])]
    position = end
  masked = "".join(parts) + text[position:]
  return _TEXT_COMMAND.sub(lambda m: keep(m.group()), masked), segments


def _math_segments(text: str) -> list[tuple[int, int, int, int]]:
  """(start, end, content start, content end) of each `$…$`, `$$…$$`, `\\(…\\)`, `\\[…\\]` in one
  linear pass (no rescanning from unclosed openers); `\\$` is a dollar sign, and a `$…$` that
  meets the end of its line or holds prose (`_holds_prose`) was a dollar sign too: its closing
  `$` may open math instead ("He spends $5. The answer is $8$." holds the math `8`)."""
  found, opener = [], None
  for token in _MATH_DELIMITER.finditer(text):
    if token.group() == "\\$":
      continue
    if opener is None:
      opener = token if token.group() in _CLOSER else None
    elif token.group() == _CLOSER[opener.group()]:
      if opener.group() == "$" and _holds_prose(text[opener.end():token.start()]):
        opener = token
        continue
      found.append((opener.start(), token.end(), opener.end(), token.start()))
      opener = None
    elif token.group() == "\n" and opener.group() == "$":
      opener = None
  return found


def _holds_prose(content: str) -> bool:
  """True when `content`, read as `$…$` math, holds two words in a row outside command arguments
  ("5. The answer is", "8 in all, and"): math does not, so its `$`s were dollar signs.

  A `$` is both TeX's inline-math delimiter and the currency sign; Pandoc's `tex_math_dollars`
  extension tells them apart by spacing (https://pandoc.org/MANUAL.html#extension-tex_math_dollars),
  which models do not follow reliably ("is $10,455$"), so the content decides here. Variables
  ("$AB + BC$", "$ax + by$") are not words in a row; `\\text{ and }` is a command argument.
  """
  return bool(_PROSE_RUN.search(_COMMAND_ARGUMENT.sub(" ", content)))


def _unmask(masked: str, segments: list[str]) -> str:
  return _PLACEHOLDERS.sub(lambda m: segments[ord(m.group()) - _PLACEHOLDER], masked)


def _is_prose_word(word: str) -> bool:
  return len(word) > 1  # single letters are variables ("x = 5"), not prose


def _read_statement(masked: str, segments: list[str]) -> _Statement:
  if masked.rstrip().endswith("?"):
    return _Statement((), None, False, False)
  words = [w for w in _WORD.finditer(masked) if _is_prose_word(w.group())]
  lowered = [w.group().lower() for w in words]
  breaks = [(w.start(), w.end()) for w in words] + \
      [(m.start(), m.end()) for m in _RUN_BREAK.finditer(masked)]
  pieces = []  # (start, text) of each run of math between words
  position = 0
  for start, end in sorted(breaks) + [(len(masked), len(masked))]:
    piece = _piece(masked[position:start], segments)
    if piece:
      pieces.append((position, piece))
    position = max(position, end)
  verbs = [w.end() for w, low in zip(words, lowered) if low in _MARKERS]
  verbs += [m.end() for m in _RUN_BREAK.finditer(masked)]
  last_piece = pieces[-1][0] if pieces else -1
  clause = max((v for v in verbs if v <= last_piece), default=0)
  clause_sequence = [low for w, low in zip(words, lowered) if w.start() >= clause]
  clause_words = set(clause_sequence)
  hedged = bool(_HEDGES & set(lowered)) or bool(_NEGATIONS & clause_words) or \
      any(low.endswith("n't") or low.endswith("n\u2019t") for low in clause_words) or \
      bool(_BOUND_PHRASES & set(zip(clause_sequence, clause_sequence[1:])))
  names_answer = any(low in _ANSWER_WORDS for w, low in zip(words, lowered) if w.end() <= clause)
  stated = [(start, text) for start, text in pieces if start >= clause]
  states_value = clause == 0 or bool(stated and stated[0][0] == clause)
  return _Statement(tuple(text for _, text in stated),
                    "hedged" if hedged and pieces else None, names_answer, states_value)


def _piece(run: str, segments: list[str]) -> str | None:
  """The math of one run between words, or None when it holds none ("^2" of "cm^2" is a unit)."""
  # `\"` is a quote escaped once too often (`is \"$12$\".`), not TeX's umlaut accent.
  text = run.replace("**", "").replace('\\"', '"').strip(_PIECE_STRIP)
  text = text.lstrip("=)]}").rstrip("=([{").strip()
  if _CHOICE.fullmatch(text):
    return text
  if not text or text[0] in "^_" or not (_PLACEHOLDERS.search(text) or re.search(r"[\d\\]", text)):
    return None
  return _unmask(text, segments).strip()
