"""Format and language-consistency checks for R1-Zero style responses.

The R1-Zero template (DeepSeek-AI 2025, "DeepSeek-R1", §2.2.1) asks the model to answer as
`<think> reasoning </think><answer> answer </answer>`. The format reward is only worth its weight when
the check is strict: a lenient regex teaches the model to emit tags, not to reason.

Language consistency follows the idea of the R1 language-consistency reward (ibid., §2.3.2: the share
of target-language words in the chain of thought), measured here as the share of *letters* written in
a target script, using `unicodedata` character names instead of a language-identification model.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import unicodedata

from reasoning_rl.errors import ConfigError

FORMAT_VERIFIER_VERSION = "format-1"
LANGUAGE_VERIFIER_VERSION = "language-1"

_TAG_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_\-]*")


def check_tag(field: str, tag: str) -> str:
  if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
    raise ConfigError(
        f"{field}={tag!r} is not a valid tag name; use letters, digits, '_' or '-' (e.g. 'think')"
    )
  return tag


def tag_contents(text: str, tag: str = "answer") -> list[str]:
  """The contents of every complete `<tag>…</tag>` span in `text`, in order (non-greedy)."""
  check_tag("tag", tag)
  # One linear pass over the tag tokens (a non-greedy regex rescans to the end from every unclosed
  # opening tag: quadratic on spam). Same pairing: an opening tag, then the first closing one.
  contents, start = [], None
  for token in re.finditer(f"<{tag}>|</{tag}>", text):
    if token.group(0)[1] != "/":
      if start is None:
        start = token.end()
    elif start is not None:
      contents.append(text[start:token.start()])
      start = None
  return contents


def outside_tag(text: str, tag: str = "think") -> str:
  """`text` without what is inside `<tag>` spans: each complete span is removed, an unclosed
  `<tag>` hides the rest of the text (a truncated chain of thought), and a `</tag>` with no
  opening before it hides everything before it (a prompt that opened the tag, or a span nested in
  another). One linear pass, like `tag_contents`."""
  check_tag("tag", tag)
  pieces, position, inside = [], 0, False
  for token in re.finditer(f"<{tag}>|</{tag}>", text):
    if token.group(0)[1] != "/":
      if not inside:
        pieces.append(text[position:token.start()])
        inside = True
    elif inside:
      inside, position = False, token.end()
    else:
      pieces, position = [], token.end()
  if not inside:
    pieces.append(text[position:])
  return "".join(pieces)


def last_tag_content(text: str, tag: str = "answer") -> str | None:
  """The contents of the last complete `<tag>…</tag>` span, or None when there is none."""
  contents = tag_contents(text, tag)
  return contents[-1] if contents else None


@dataclasses.dataclass(frozen=True)
class FormatSpec:
  """What a well-formed response looks like.

  Attributes:
    think_tag: name of the reasoning tag.
    answer_tag: name of the answer tag.
    require_nonempty_think: the reasoning must contain a non-whitespace character.
    require_nonempty_answer: the answer must contain a non-whitespace character.
    think_open_in_prompt: the prompt already ends with `<think>` (common R1-Zero prompt), so the
      response starts inside the reasoning and must not open the tag again.
    pattern: optional regular expression replacing the tag template; the whole response (with
      surrounding whitespace stripped) must `fullmatch` it (DOTALL). Its named groups `think` and
      `answer`, when present, are subject to the non-empty requirements.
  """

  think_tag: str = "think"
  answer_tag: str = "answer"
  require_nonempty_think: bool = True
  require_nonempty_answer: bool = True
  think_open_in_prompt: bool = False
  pattern: str | None = None

  def __post_init__(self):
    check_tag("format.think_tag", self.think_tag)
    check_tag("format.answer_tag", self.answer_tag)
    if self.think_tag == self.answer_tag:
      raise ConfigError("format.think_tag and format.answer_tag must differ")
    if self.pattern is not None:
      try:
        re.compile(self.pattern)
      except re.error as e:
        raise ConfigError(f"format.pattern={self.pattern!r} is not a valid regex: {e}") from e


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
  return re.compile(pattern, re.DOTALL)


def format_ok(response: str, spec: FormatSpec = FormatSpec()) -> bool:
  """True iff `response` follows the template strictly.

  Default template: optional whitespace, `<think>`, reasoning, `</think>`, optional whitespace,
  `<answer>`, answer, `</answer>`, optional whitespace, end. Exactly one of each of the four tags,
  in that order; nothing but whitespace after the closing answer tag.
  """
  if spec.pattern is not None:
    match = _compiled(spec.pattern).fullmatch(response.strip())
    if match is None:
      return False
    groups = match.groupdict()
    if spec.require_nonempty_think and "think" in groups and not (groups["think"] or "").strip():
      return False
    if spec.require_nonempty_answer and "answer" in groups and not (groups["answer"] or "").strip():
      return False
    return True

  text = f"<{spec.think_tag}>" + response if spec.think_open_in_prompt else response
  tags = (f"<{spec.think_tag}>", f"</{spec.think_tag}>", f"<{spec.answer_tag}>",
          f"</{spec.answer_tag}>")
  if any(text.count(tag) != 1 for tag in tags):
    return False
  t, a = re.escape(spec.think_tag), re.escape(spec.answer_tag)
  match = re.fullmatch(f"\\s*<{t}>(.*)</{t}>\\s*<{a}>(.*)</{a}>\\s*", text, re.DOTALL)
  if match is None:
    return False
  think, answer = match.group(1), match.group(2)
  if spec.require_nonempty_think and not think.strip():
    return False
  if spec.require_nonempty_answer and not answer.strip():
    return False
  return True


# Unicode character-name prefixes of each supported script. Names are stable across Unicode versions.
SCRIPT_NAME_PREFIXES: dict[str, tuple[str, ...]] = {
    "latin": ("LATIN",),
    "cjk": ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "IDEOGRAPHIC", "BOPOMOFO"),
    "han": ("CJK UNIFIED IDEOGRAPH", "CJK COMPATIBILITY IDEOGRAPH"),
    "kana": ("HIRAGANA", "KATAKANA"),
    "hangul": ("HANGUL",),
    "cyrillic": ("CYRILLIC",),
    "greek": ("GREEK",),
    "arabic": ("ARABIC",),
    "hebrew": ("HEBREW",),
    "devanagari": ("DEVANAGARI",),
    "thai": ("THAI",),
}


def script_share(text: str, script: str = "latin") -> float:
  """Share of the letters in `text` (Unicode category L*) that belong to `script`.

  Digits, punctuation, spaces and symbols are neutral. Text without letters scores 0.0, so an empty
  chain of thought never earns a language reward.
  """
  prefixes = SCRIPT_NAME_PREFIXES.get(script)
  if prefixes is None:
    raise ConfigError(
        f"language.script={script!r} is unknown; choose one of {sorted(SCRIPT_NAME_PREFIXES)}"
    )
  letters = in_script = 0
  for ch in text:
    if not unicodedata.category(ch).startswith("L"):
      continue
    letters += 1
    if unicodedata.name(ch, "").startswith(prefixes):
      in_script += 1
  return in_script / letters if letters else 0.0


def reasoning_text(response: str, think_tag: str = "think", think_open_in_prompt: bool = False) -> str:
  """The chain of thought: the last `<think>` span, or the text before `</think>` when the prompt
  opened the tag, or "" when the response has no reasoning span."""
  if think_open_in_prompt:
    closing = f"</{think_tag}>"
    return response.split(closing, 1)[0] if closing in response else ""
  content = last_tag_content(response, think_tag)
  return content if content is not None else ""


def language_consistency(response: str, script: str = "latin", *, think_tag: str = "think",
                         think_open_in_prompt: bool = False) -> float:
  """Share of the reasoning's letters written in `script` (0.0 when there is no reasoning)."""
  return script_share(reasoning_text(response, think_tag, think_open_in_prompt), script)
