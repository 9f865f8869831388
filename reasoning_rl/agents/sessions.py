"""Sessions: an agent's episode as the exact tokens the model saw and produced.

Every request of a session renders its whole conversation again (that is what an OpenAI client
sends). The session keeps the token history of its current segment — the first prompt, then each
turn's new context tokens and sampled tokens — and checks that the new request's rendered prompt
extends that history:

- Tokens (`extension`), the fast path: the rendered prompt's tokens start with the history.
- Text (`text_extension`), when they do not: the rendered prompt's text starts with the history
  decoded (special tokens kept, as the server decodes what it returns and as the template writes
  its markers). A model sampling at temperature 1 often draws a tokenization of its text that
  the tokenizer would not produce ("hel" + "lo" where encoding gives "hello"); the client sends
  that text back unchanged, yet its re-encoding differs. The history's tokens then stay as they
  are and only the text after it is encoded and appended. A history that ends inside a UTF-8
  character (decoded to U+FFFD) extends only a text that still reads the same.

Either way the tokens after the history are context the model did not write (a user message, a
tool result, the template's turn markers): they join the segment with loss mask 0 and log-prob 0,
and the engine decodes from the segment's tokens (`begin_turn` returns them), never from a
re-encoding. The tokens the engine samples next join it with loss mask 1, their log-probs and the
policy version that drew each. The segment is then exactly the sequence the model decoded.

Only a real rewrite is a mismatch: the text differs (the template rewrote the history: Qwen3's
drops earlier <think> blocks; a client edited a message or dropped a stop string).
`agent.history_mismatch` decides. `split` closes the segment and starts a new one whose prompt is
the new rendered prompt, so each segment is trained separately on what the model saw when it
wrote it (a row of its own, `agent.segment_rows`: `agents.collector`); `refuse` raises `HistoryMismatch` (the server answers HTTP 400 with its reason).
Nothing is ever trained on a sequence the model did not see.

Pure bookkeeping on lists: the server calls `begin_turn` / `end_turn` around each decode.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from reasoning_rl.sampler.api import Completion

MISMATCH_POLICIES = ("split", "refuse")


class HistoryMismatch(ValueError):
  """A request's rendered prompt does not extend its session's tokens (under `refuse`)."""


class SessionBusy(ValueError):
  """A second request of a session arrived while its first was decoding."""


@dataclasses.dataclass
class Segment:
  """One separately trained sequence of a session: its prompt, then context and model tokens."""

  prompt_tokens: list[int]
  tokens: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  sampling_logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  turns: list[dict] = dataclasses.field(default_factory=list)

  @property
  def history(self) -> list[int]:
    """Every token of the segment so far: what the next request's prompt must start with."""
    return self.prompt_tokens + self.tokens

  def completion(self, *, prompt_id: int, sample_index: int, keep_sampling_logprobs: bool
                 ) -> Completion:
    """The segment as a multi-turn `Completion` (context tokens: loss mask 0, log-prob 0). Its
    `scored_response` is the whole segment after the prompt as the agent saw it: each model
    turn's text as served, then the context the agent sent after it (`observation`, where a
    session with a tokenizer recorded it) — the agent, not a verifier, scored the episode."""
    last = self.turns[-1]
    scored = "".join(turn["model_text"] + turn.get("observation", "") for turn in self.turns)
    versions = [v for v, m in zip(self.versions, self.loss_mask) if m]
    return Completion(
        prompt_id=prompt_id, sample_index=sample_index, prompt_tokens=list(self.prompt_tokens),
        completion_ids=list(self.tokens), logprobs=list(self.logprobs),
        sampling_logprobs=list(self.sampling_logprobs) if keep_sampling_logprobs else None,
        finish_reason=last["finish_reason"], truncated=last["finish_reason"] == "length",
        policy_version=min(versions), loss_mask=list(self.loss_mask), turns=list(self.turns),
        token_versions=([v if m else min(versions) for v, m in zip(self.versions, self.loss_mask)]
                        if len(set(versions)) > 1 else None),
        episode_end="agent", scored_response=scored)


def extension(history: Sequence[int], rendered: Sequence[int]) -> list[int] | None:
  """The tokens `rendered` adds after `history`, or None when it does not start with it."""
  n = len(history)
  if len(rendered) < n or list(rendered[:n]) != list(history):
    return None
  return list(rendered[n:])


def text_extension(tokenizer, history: Sequence[int], rendered_text: str) -> list[int] | None:
  """The tokens to append to `history` so that the whole decodes to `rendered_text`, or None when
  `rendered_text` does not start with the decoded history (a real rewrite).

  The rest of the text is encoded on its own (no special tokens added; the special tokens it
  writes become their ids). The result is checked by decoding the whole: a tokenizer whose
  pieces do not decode independently (a SentencePiece dummy-prefix space, a history ending inside
  a UTF-8 character that the rest completes) is a mismatch rather than a guess.
  """
  history_text = tokenizer.decode(list(history), skip_special_tokens=False)
  if not rendered_text.startswith(history_text):
    return None
  added = tokenizer.encode(rendered_text[len(history_text):], add_special_tokens=False)
  if tokenizer.decode(list(history) + added, skip_special_tokens=False) != rendered_text:
    return None
  return added


def first_difference(history: Sequence, rendered: Sequence) -> int:
  """The first index where the two (token lists or texts) disagree (the shorter's length if one prefixes the other)."""
  for index, (a, b) in enumerate(zip(history, rendered)):
    if a != b:
      return index
  return min(len(history), len(rendered))


class Session:
  """One episode's segments. `begin_turn` before a decode, `end_turn` with what it drew.

  tokenizer: decodes the history and encodes the rest of a prompt for the text-level match
  (module docstring); None compares tokens only.
  """

  def __init__(self, session_id: str, *, on_mismatch: str, tokenizer=None):
    if on_mismatch not in MISMATCH_POLICIES:
      raise ValueError(f"on_mismatch={on_mismatch!r}: must be one of {MISMATCH_POLICIES}")
    self.id = session_id
    self.on_mismatch = on_mismatch
    self.tokenizer = tokenizer
    self.segments: list[Segment] = []
    self.turns = 0  # requests decoded: the turn number seeds the next one
    self.splits = 0
    # tool calls the model attempted that could not be used (`tool_calls.parse_completion`),
    # over the session's turns (what a metric of malformed calls reads)
    self.malformed_tool_calls = 0
    self._busy = threading.Lock()
    # where the open turn's context began in the current segment (`abandon_turn` cuts back to
    # it); None when the turn started a segment of its own
    self._turn_start: int | None = None

  def begin_turn(self, rendered: Sequence[int], *, text: str | None = None) -> list[int]:
    """Matches the request's rendered prompt (its tokens; `text`, the text they encode, when
    there is one) against the current segment (module docstring): extends it with the new
    context tokens, or splits / refuses. Returns the tokens to decode from: the segment's."""
    if not self._busy.acquire(blocking=False):
      raise SessionBusy(f"session {self.id!r} is already decoding a request; an episode's "
                        "requests must come one after the other")
    try:
      rendered = list(rendered)
      self._turn_start = None
      if not self.segments:
        self.segments.append(Segment(prompt_tokens=rendered))
        return list(rendered)
      current = self.segments[-1]
      added = extension(current.history, rendered)
      if added is None and text is not None and self.tokenizer is not None:
        added = text_extension(self.tokenizer, current.history, text)
      if added is None:
        if self.on_mismatch == "refuse":
          raise HistoryMismatch(self._mismatch_reason(current.history, rendered, text))
        self.splits += 1
        self.segments.append(Segment(prompt_tokens=rendered))
        return list(rendered)
      self._turn_start = len(current.tokens)
      if added and current.turns and self.tokenizer is not None:
        # what answered the previous model turn (a tool's result, the agent's continuation), for
        # the rollout records and report; `abandon_turn` takes it back with the tokens
        current.turns[-1]["observation"] = self.tokenizer.decode(added, skip_special_tokens=True)
      current.tokens += added
      current.loss_mask += [0] * len(added)
      current.logprobs += [0.0] * len(added)
      current.sampling_logprobs += [0.0] * len(added)
      current.versions += [-1] * len(added)
      return current.history
    except BaseException:
      self._busy.release()
      raise

  def _mismatch_reason(self, history: list[int], rendered: list[int], text: str | None) -> str:
    where = (f"they differ from token {first_difference(history, rendered)} on")
    if text is not None and self.tokenizer is not None:
      history_text = self.tokenizer.decode(history, skip_special_tokens=False)
      at = first_difference(history_text, text)
      where += (f", and the texts from character {at} on (the session's "
                f"{history_text[max(0, at - 20):at + 20]!r} against "
                f"{text[max(0, at - 20):at + 20]!r})")
    return (f"session {self.id!r}: the rendered prompt ({len(rendered)} tokens) does not "
            f"extend the session's tokens ({len(history)}): {where} (the chat template or the "
            "client rewrote earlier turns, e.g. dropped a <think> block). Set "
            "agent.history_mismatch='split' to train such turns separately")

  def end_turn(self, *, tokens: Sequence[int], logprobs: Sequence[float],
               sampling_logprobs: Sequence[float], versions: Sequence[int], finish_reason: str,
               text: str) -> None:
    """Adds the sampled tokens of the turn `begin_turn` opened (`tokens` empty: it failed)."""
    try:
      if tokens:
        current = self.segments[-1]
        current.tokens += list(tokens)
        current.loss_mask += [1] * len(tokens)
        current.logprobs += list(logprobs)
        current.sampling_logprobs += list(sampling_logprobs)
        current.versions += list(versions)
        current.turns.append({"model_text": text, "num_tokens": len(tokens),
                              "finish_reason": finish_reason})
        self.turns += 1
    finally:
      self._busy.release()

  def abandon_turn(self, *, drop_empty_segment: bool = False) -> None:
    """The turn `begin_turn` opened decoded nothing (the engine refused it): the context it
    appended is taken back, so no trained row carries context the model never read. With
    `drop_empty_segment`, a segment that turn started (and holds no model turn) is forgotten,
    so the session goes on as before the request."""
    if self._turn_start is not None and self.segments:
      current = self.segments[-1]
      for column in (current.tokens, current.loss_mask, current.logprobs,
                     current.sampling_logprobs, current.versions):
        del column[self._turn_start:]
      if current.turns:
        current.turns[-1].pop("observation", None)
      self._turn_start = None
    if drop_empty_segment and self.segments and not self.segments[-1].turns:
      self.segments.pop()
      if self.segments:  # the segment was a split's
        self.splits -= 1
    self._busy.release()

  def completions(self, *, prompt_id: int, sample_index: int, keep_sampling_logprobs: bool
                  ) -> list[Completion]:
    """One `Completion` per segment that holds a model turn."""
    return [s.completion(prompt_id=prompt_id, sample_index=sample_index,
                         keep_sampling_logprobs=keep_sampling_logprobs)
            for s in self.segments if s.turns]


__all__ = ["HistoryMismatch", "MISMATCH_POLICIES", "Segment", "Session", "SessionBusy",
           "extension", "first_difference", "text_extension"]
