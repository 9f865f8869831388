"""Reading a judge model's reply as a verdict, so that no wording turns a "no" into a reward.

A reply is read sentence by sentence (a question asks, it does not answer). `parse_yes_no`:

* verdict words are affirmations (yes, correct, right, equivalent, matches, …) and denials (no,
  incorrect, wrong, different, …); "the correct answer …" names the reference, it is no verdict;
* a negator before a verdict word in its sentence turns it ("not correct", "cannot say yes",
  "doesn't match" deny); a denial negated ("not wrong") is no verdict, so ambiguous;
* a hedge anywhere ("maybe", "partially", "probably", …) makes the reply no verdict;
* the reply's verdict is the one all its verdict words agree on; words that disagree ("Yes and
  no", an echoed "Yes or No") or none at all (a refusal: "I cannot judge this") give None, which
  the judge part scores 0.0 and counts as unparseable.

`parse_score` reads an integer 0-10: scale phrases ("out of 10", "/10", "from 0 to 10") are no
scores; a number after a negator ("not a 10") is not given; when several different numbers remain,
those in hypothetical or reference clauses ("10 would be perfect", "a perfect answer gets 10")
drop out, then those marked as the score ("gets 2", "Score: 2", "I give it 2") win; a hedge in the
chosen number's sentence, or any ambiguity left, gives None.

`KNOWN_REPLIES` is the table of replies (tests, red team) with their right verdicts.
"""

from __future__ import annotations

import re

_SENTENCE = re.compile(r"[^.!?;\n]+[.!?;\n]*")
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?|\d+")
_AFFIRM = frozenset({"yes", "yeah", "yep", "correct", "right", "true", "equivalent", "equal",
                     "match", "matches", "same", "identical", "accurate", "valid"})
_DENY = frozenset({"no", "nope", "nah", "incorrect", "wrong", "false", "inequivalent",
                   "different", "differs", "mismatch", "inaccurate", "invalid", "unequal"})
_NEGATORS = frozenset({"not", "never", "cannot", "neither", "nor", "hardly", "barely", "unable",
                       "refuse", "without"})
_HEDGES = frozenset({"maybe", "perhaps", "probably", "possibly", "likely", "unlikely", "unsure",
                     "uncertain", "unclear", "partially", "partly", "mostly", "almost", "nearly",
                     "somewhat", "arguably", "might", "roughly", "approximately", "sort", "kind"})
# "the correct answer is 42": the reference, not a verdict on the student's answer
_REFERENCE_NOUNS = frozenset({"answer", "answers", "value", "result", "solution", "response"})


def _words(sentence: str) -> list[str]:
  return _WORD.findall(sentence.lower().replace("\u2019", "'"))


def _negator(word: str) -> bool:
  return word in _NEGATORS or word.endswith("n't")


_INTERJECTIONS = frozenset({"no", "nope", "nah"})  # a denial whatever negator came before


def _sentence_verdicts(words: list[str]) -> list[float | None]:
  """The verdict of each verdict word of one sentence (None: a negated denial)."""
  verdicts, negated = [], False
  for index, word in enumerate(words):
    if _negator(word):
      negated = True
      continue
    if word not in _AFFIRM and word not in _DENY:
      continue
    if (word in _AFFIRM and index > 0 and words[index - 1] == "the"
        and index + 1 < len(words) and words[index + 1] in _REFERENCE_NOUNS):
      continue
    if word in _INTERJECTIONS:
      verdicts.append(0.0)
    elif word in _AFFIRM:
      verdicts.append(0.0 if negated else 1.0)
    else:
      verdicts.append(None if negated else 0.0)
  return verdicts


def parse_yes_no(text: str) -> float | None:
  """1.0 / 0.0 when every verdict word of the reply agrees (module docstring); None otherwise."""
  verdicts = []
  for sentence in _SENTENCE.findall(text):
    words = _words(sentence)
    if any(word in _HEDGES for word in words):
      return None
    if "?" not in sentence:  # questions ask; they state nothing
      verdicts += _sentence_verdicts(words)
  if not verdicts or None in verdicts or len(set(verdicts)) != 1:
    return None
  return verdicts[0]


# "out of 10", "/10", "(from|on a scale of) 0 to 10", "0-10": the scale, not a score
_SCALE = re.compile(r"\bout\s+of\s+10\b|/\s*10\b|\b0\s*(?:-|\u2013|to)\s*10\b", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\d.])(-?)(\d+)(?![\d.]|\s*%)")
_SCORE_MARKERS = frozenset({"score", "scored", "scores", "rating", "rate", "rated", "grade",
                            "graded", "gets", "get", "give", "gives", "giving", "gave", "award",
                            "awarded", "verdict", "final", "deserves", "earns", "is", "a", "an"})
_HYPOTHETICAL = frozenset({"if", "would", "could", "should", "perfect", "ideal", "maximum", "max",
                           "full", "best"})
_CLAUSE = re.compile(r"[.!?;,\n]+|\bbut\b|\bwhile\b|\bwhereas\b", re.IGNORECASE)


def _candidates(text: str) -> list[tuple[int, bool, bool, bool]]:
  """(value, marked as the score, in a hypothetical clause, hedged) of each number given."""
  found = []
  for clause in _CLAUSE.split(_SCALE.sub(" ", text)):
    lowered = clause.lower()
    words = _words(lowered)
    hypothetical = any(word in _HYPOTHETICAL for word in words) or "'d be" in lowered
    hedged = any(word in _HEDGES for word in words)
    for match in _NUMBER.finditer(lowered):
      before = _words(lowered[:match.start()])
      if any(_negator(word) or word == "no" for word in before):
        continue  # "not a 10", "cannot give it a 10": not given
      value = -int(match.group(2)) if match.group(1) else int(match.group(2))
      marked = bool(before) and before[-1] in _SCORE_MARKERS or lowered[:match.start()].rstrip(
          ).endswith((":", "="))
      found.append((value, marked, hypothetical, hedged))
  return found


def parse_score(text: str) -> float | None:
  """The score 0-10 the reply gives, divided by 10 (module docstring); None when it gives none,
  several, one out of range, or a hedged one."""
  candidates = _candidates(text)
  for keep in (lambda c: True, lambda c: not c[2], lambda c: not c[2] and c[1]):
    chosen = [c for c in candidates if keep(c)]
    if len({c[0] for c in chosen}) == 1:
      value, _, _, hedged = chosen[0]
      if hedged or not 0 <= value <= 10:
        return None
      return value / 10
    if not chosen:
      return None
  return None


# (template, reply, the right verdict): replies a small judge model writes, honest and tricky. A
# parser must return exactly the verdict; None is read as 0.0 by the judge part.
KNOWN_REPLIES: tuple[tuple[str, str, float | None], ...] = (
    ("yes_no", "Yes", 1.0),
    ("yes_no", "yes.", 1.0),
    ("yes_no", "YES!", 1.0),
    ("yes_no", "**Yes**", 1.0),
    ("yes_no", "Answer: Yes", 1.0),
    ("yes_no", "Correct.", 1.0),
    ("yes_no", "Yes, the student's answer is correct.", 1.0),
    ("yes_no", "Yes. The answers are equivalent.", 1.0),
    ("yes_no", "They match.", 1.0),
    ("yes_no", "Correct! The correct answer is indeed 42.", 1.0),
    ("yes_no", "Is it correct? Yes.", 1.0),
    ("yes_no", "No", 0.0),
    ("yes_no", "No.", 0.0),
    ("yes_no", "Nope", 0.0),
    ("yes_no", "Incorrect.", 0.0),
    ("yes_no", "Not correct.", 0.0),
    ("yes_no", "The student's answer is not correct.", 0.0),
    ("yes_no", "I cannot say yes to this.", 0.0),
    ("yes_no", "No, they are not equivalent.", 0.0),
    ("yes_no", "The answers don't match.", 0.0),
    ("yes_no", "That is wrong.", 0.0),
    ("yes_no", "Incorrect. The correct answer is 42.", 0.0),
    ("yes_no", "It isn't correct, so no.", 0.0),
    ("yes_no", "False", 0.0),
    ("yes_no", "Yes and no.", None),
    ("yes_no", "Reply with one word: Yes or No", None),
    ("yes_no", "Yes/No", None),
    ("yes_no", "No, it is correct.", None),
    ("yes_no", "Yes. Wait, no, it's wrong.", None),
    ("yes_no", "Probably yes.", None),
    ("yes_no", "Partially correct.", None),
    ("yes_no", "It's not wrong.", None),
    ("yes_no", "I cannot judge this.", None),
    ("yes_no", "I'm not sure.", None),
    ("yes_no", "Is it correct?", None),
    ("yes_no", "", None),
    ("score", "7", 0.7),
    ("score", "Score: 7", 0.7),
    ("score", "7/10", 0.7),
    ("score", "10/10", 1.0),
    ("score", "0", 0.0),
    ("score", "5 out of 10", 0.5),
    ("score", "On a scale from 0 to 10, I rate this 8.", 0.8),
    ("score", "I'd give it a 7.", 0.7),
    ("score", "This would be a 3.", 0.3),
    ("score", "10/10 would be a perfect answer; this gets 2", 0.2),
    ("score", "A perfect answer gets 10, this one gets 4.", 0.4),
    ("score", "This does not deserve a 10; it gets 5.", 0.5),
    ("score", "I cannot give it a 10.", None),
    ("score", "Between 6 and 8.", None),
    ("score", "7-8", None),
    ("score", "Not a 10, maybe a 6.", None),
    ("score", "Score: 11", None),
    ("score", "Score: -3", None),
    ("score", "I cannot give a score.", None),
    ("score", "3.5", None),
)
