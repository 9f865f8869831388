"""Sessions: an agent's episode as the exact tokens the model saw and produced.

Every request of a session renders its whole conversation again (that is what an OpenAI client
sends). The session keeps the token history of its current segment — the first prompt, then each
turn's new context tokens and sampled tokens — and checks that the new request's rendered prompt
starts with that history (`extension`):

- It does: the tokens after the history are context the model did not write (a user message, a
  tool result, the template's turn markers) and join the segment with loss mask 0 and log-prob 0;
  the tokens the engine samples next join it with loss mask 1, their log-probs and the policy
  version that drew each. The segment is then exactly the sequence the model decoded.
- It does not (the template rewrote the history: Qwen3's drops earlier <think> blocks; a client
  edited a message; a text that does not re-tokenize to the same ids): `agent.history_mismatch`
  decides. `split` closes the segment and starts a new one whose prompt is the new rendered
  prompt, so each segment is trained separately on what the model saw when it wrote it; `refuse`
  raises `HistoryMismatch` (the server answers HTTP 400 with its reason). Nothing is ever trained
  on a sequence the model did not see.

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
    """The segment as a multi-turn `Completion` (context tokens: loss mask 0, log-prob 0)."""
    last = self.turns[-1]
    versions = [v for v, m in zip(self.versions, self.loss_mask) if m]
    return Completion(
        prompt_id=prompt_id, sample_index=sample_index, prompt_tokens=list(self.prompt_tokens),
        completion_ids=list(self.tokens), logprobs=list(self.logprobs),
        sampling_logprobs=list(self.sampling_logprobs) if keep_sampling_logprobs else None,
        finish_reason=last["finish_reason"], truncated=last["finish_reason"] == "length",
        policy_version=min(versions), loss_mask=list(self.loss_mask), turns=list(self.turns),
        token_versions=([v if m else min(versions) for v, m in zip(self.versions, self.loss_mask)]
                        if len(set(versions)) > 1 else None),
        episode_end="agent", scored_response=last["model_text"])


def extension(history: Sequence[int], rendered: Sequence[int]) -> list[int] | None:
  """The tokens `rendered` adds after `history`, or None when it does not start with it."""
  n = len(history)
  if len(rendered) < n or list(rendered[:n]) != list(history):
    return None
  return list(rendered[n:])


def first_difference(history: Sequence[int], rendered: Sequence[int]) -> int:
  """The first index where the two disagree (the shorter's length if one prefixes the other)."""
  for index, (a, b) in enumerate(zip(history, rendered)):
    if a != b:
      return index
  return min(len(history), len(rendered))


class Session:
  """One episode's segments. `begin_turn` before a decode, `end_turn` with what it drew."""

  def __init__(self, session_id: str, *, on_mismatch: str):
    if on_mismatch not in MISMATCH_POLICIES:
      raise ValueError(f"on_mismatch={on_mismatch!r}: must be one of {MISMATCH_POLICIES}")
    self.id = session_id
    self.on_mismatch = on_mismatch
    self.segments: list[Segment] = []
    self.turns = 0  # requests decoded: the turn number seeds the next one
    self.splits = 0
    self._busy = threading.Lock()

  def begin_turn(self, rendered: Sequence[int]) -> None:
    """Matches the request's rendered prompt against the current segment (module docstring):
    extends it with the new context tokens, or splits / refuses."""
    if not self._busy.acquire(blocking=False):
      raise SessionBusy(f"session {self.id!r} is already decoding a request; an episode's "
                        "requests must come one after the other")
    try:
      rendered = list(rendered)
      if not self.segments:
        self.segments.append(Segment(prompt_tokens=rendered))
        return
      current = self.segments[-1]
      added = extension(current.history, rendered)
      if added is None:
        at = first_difference(current.history, rendered)
        if self.on_mismatch == "refuse":
          raise HistoryMismatch(
              f"session {self.id!r}: the rendered prompt ({len(rendered)} tokens) does not "
              f"extend the session's tokens ({len(current.history)}): they differ from token "
              f"{at} on (the chat template or the client rewrote earlier turns, e.g. dropped a "
              "<think> block). Set agent.history_mismatch='split' to train such turns "
              "separately")
        self.splits += 1
        self.segments.append(Segment(prompt_tokens=rendered))
        return
      current.tokens += added
      current.loss_mask += [0] * len(added)
      current.logprobs += [0.0] * len(added)
      current.sampling_logprobs += [0.0] * len(added)
      current.versions += [-1] * len(added)
    except BaseException:
      self._busy.release()
      raise

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
    """The turn `begin_turn` opened decoded nothing (the engine refused it). With
    `drop_empty_segment`, a segment that turn started (and holds no model turn) is forgotten,
    so the session goes on as before the request."""
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
           "extension", "first_difference"]
