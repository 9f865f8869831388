"""Exact agent turns (`rollout.exact_logprobs` with `agent.entry`): every model turn the rollout
server returns is verified against the canonical forward, and repaired, before the reply is sent.

Single-turn exact rollouts (`sampler.exact`) verify a draft after the engine decoded it; an agent
acts on each reply as it arrives, so here the check sits between the decode and the answer. A
turn is one completion of the canonical layout:

- its prompt is the session's whole token context before the turn: the segment's first prompt,
  every earlier turn and context token, and this request's new context;
- its completion is the turn's tokens, token t drawn with fold_in(key, first_draw + t), where
  (key, first_draw) is the seeding the driver gives the request (`driver.EngineDriver.
  turn_seeding`: an owned episode's key and the model tokens it kept so far, or the request's
  own key from draw 0).

The scorer replays the draft (`exact.check_draft`). At the first position where the draft differs
from the canonical Gumbel-max draw, the canonical token replaces it and the engine decodes on from
there: a request to the driver with the verified tokens as its `prefix`, drawing number
first_draw + len(prefix) onwards, so it shares the decode slots with every other request as any
request does. This repeats until every position agrees; the reply then carries exactly the
tokens canonical sampling draws with that noise, and the session records their canonical
log-probs. By induction over turns, every trained token of an episode is an exact draw of the
canonical policy given the tokens before it, and its recorded log-prob is the canonical
forward's, whatever the episode was decoded beside (the argument of `sampler/exact.py`'s
docstring, applied turn by turn; the context between turns is the agent's, not drawn).

One scorer for the run: the engine backend's (`rollout.exact_logprobs`), whose layout an agent
run sizes as its engine: prompts up to max_prefill_length + max_new_tokens (a turn's context is
the segment's prompt and at most max_new_tokens more), completions up to the decode length. Every
turn of every session is scored by that one compiled program.

Scoring requests from concurrent sessions are gathered by one thread and scored together (the
scorer's calls take a fixed number of rows, so sessions fill each other's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np

from reasoning_rl.agents.driver import DecodeRequest, DecodeResult, EngineDriver
from reasoning_rl.errors import ConfigError, SamplingError
from reasoning_rl.sampler.api import ExactStats
from reasoning_rl.sampler.exact import CanonicalScorer, check_draft, stop_rule
from reasoning_rl.sampler.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class _Scored:
  """One sequence's canonical draws and log-probs over its completion positions."""

  draws: np.ndarray
  logprobs: np.ndarray
  sampling_logprobs: np.ndarray


_STOP = object()


class ExactTurns:
  """Verifies and repairs the turns `server.RolloutServer` serves (module docstring).

  driver: the engine driver drafts and repairs decode on. scorer: the run's canonical forward.
  target_params: the weights it scores with (default: the driver's engine's, read at each score;
  other weights make the engine a draft model, as `exact.exact_groups` allows).
  `stats` sums what verification did until `take_stats` hands it over (one step's worth).
  """

  def __init__(self, driver: EngineDriver, scorer: CanonicalScorer, *, tokenizer,
               target_params=None):
    self.driver = driver
    self.scorer = scorer
    self.tokenizer = tokenizer
    self.target_params = target_params
    self._lock = threading.Lock()
    self._stats = ExactStats()
    self._compared = 0  # draft tokens in the draft-mismatch mean so far
    self._queue: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._score_loop, name="exact-turns", daemon=True)
    self._thread.start()

  @classmethod
  def for_backend(cls, backend, driver: EngineDriver, tokenizer) -> "ExactTurns | None":
    """The run's exact turns when its backend verifies (`rollout.exact_logprobs`: it carries a
    `scorer`), else None."""
    scorer = getattr(backend, "scorer", None)
    if scorer is None:
      return None
    if driver.engine.config.moe is not None:
      raise ConfigError("config.rollout.exact_logprobs: exact rollouts of a mixture-of-experts "
                        "model replay the canonical forward's experts, which agent episodes do "
                        "not record; set rollout.exact_logprobs=False for this agent run")
    return cls(driver, scorer, tokenizer=tokenizer)

  def close(self) -> None:
    if self._thread.is_alive():
      self._queue.put(_STOP)
      self._thread.join()

  def take_stats(self) -> dict | None:
    """What verification did since the last call (`ExactStats` as a dict), None if nothing."""
    with self._lock:
      stats, self._stats, self._compared = self._stats, ExactStats(), 0
    return dataclasses.asdict(stats) if stats.sequences else None

  def check_fits(self, prompt: Sequence[int], max_tokens: int) -> None:
    """SamplingError naming the field when a turn would not fit the canonical layout."""
    if not 1 <= len(prompt) <= self.scorer.max_prompt_length:
      raise SamplingError(
          f"a turn's context of {len(prompt)} tokens exceeds the exact layout's "
          f"{self.scorer.max_prompt_length} (rollout.max_prefill_length + rollout.max_new_tokens, "
          "rollout.exact_logprobs): raise config.rollout.max_prefill_length or shorten the "
          "conversation")
    if max_tokens > self.scorer.max_completion_length:
      raise SamplingError(
          f"max_tokens={max_tokens} exceeds the exact layout's "
          f"{self.scorer.max_completion_length} completion tokens (rollout.exact_logprobs): "
          "ask for fewer, or raise config.rollout.max_new_tokens")

  async def decode(self, request: DecodeRequest) -> DecodeResult:
    """The turn `request` asks for (explicitly seeded: `first_draw` set), verified: its tokens
    the canonical draws, its log-probs the canonical forward's."""
    if request.first_draw is None or request.prefix:
      raise SamplingError("exact turns: the request must be seeded explicitly (first_draw) and "
                          "hold no prefix")
    self.check_fits(request.prompt, request.max_new_tokens)
    ending = stop_rule(stop_ids=request.stop_ids, max_new_tokens=request.max_new_tokens,
                       tokenizer=self.tokenizer, stop_strings=request.stop_strings)
    result = await asyncio.wrap_future(self.driver.submit(request))
    draft_logprobs = list(result.logprobs)
    rounds, repairs, repair_s = 0, 0, 0.0
    while True:
      rounds += 1
      scored = await asyncio.wrap_future(self._score_async(request, result.tokens))
      if rounds == 1:
        self._add_mismatch(draft_logprobs, scored.logprobs[:len(draft_logprobs)])
      verdict = check_draft(result.tokens, scored.draws, **ending)
      if verdict is None:
        break
      _, repaired, reason = verdict
      repairs += 1
      if reason is not None:
        result = DecodeResult(repaired, [], [], [self.driver.engine.policy_version] * len(
            repaired), reason)
        continue
      start = time.perf_counter()
      result = await asyncio.wrap_future(self.driver.submit(
          dataclasses.replace(request, prefix=repaired)))
      repair_s += time.perf_counter() - start
    n = len(result.tokens)
    versions = list(result.versions) or [self.driver.engine.policy_version] * n
    with self._lock:
      s = self._stats
      s.sequences += 1
      s.tokens += n
      s.repairs += repairs
      s.repaired_sequences += repairs > 0
      s.rounds = max(s.rounds, rounds)
      s.repair_s += repair_s
    return DecodeResult(list(result.tokens), scored.logprobs[:n].tolist(),
                        scored.sampling_logprobs[:n].tolist(), versions, result.finish_reason)

  # ------------------------------------------------------------------------------ scoring

  def _add_mismatch(self, draft: Sequence[float], canonical: np.ndarray) -> None:
    """Folds one draft's |decode-path log-prob − canonical| into the mismatch statistics."""
    if not len(draft):
      return
    gaps = np.abs(np.asarray(draft, np.float64) - canonical)
    with self._lock:
      s, n = self._stats, self._compared
      s.draft_mismatch_mean = (s.draft_mismatch_mean * n + float(gaps.sum())) / (n + gaps.size)
      s.draft_mismatch_max = max(s.draft_mismatch_max, float(gaps.max()))
      self._compared = n + gaps.size

  def _score_async(self, request: DecodeRequest, completion: Sequence[int]
                   ) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    if not self._thread.is_alive():
      future.set_exception(SamplingError("exact turns were closed"))
    else:
      self._queue.put((request, list(completion), future))
    return future

  def _score_loop(self) -> None:
    """Scores what waits, together (one scorer call per sampling setting)."""
    while True:
      items = [self._queue.get()]
      while True:
        try:
          items.append(self._queue.get_nowait())
        except queue.Empty:
          break
      stop = any(item is _STOP for item in items)
      items = [item for item in items if item is not _STOP]
      by_sampling: dict[SamplingParams, list] = {}
      for item in items:
        by_sampling.setdefault(item[0].sampling, []).append(item)
      for sampling, group in by_sampling.items():
        self._score_group(sampling, group)
      if stop:
        return

  def _score_group(self, sampling: SamplingParams, group: list) -> None:
    try:
      start = time.perf_counter()
      params = (self.driver.engine.params if self.target_params is None
                else self.target_params)
      scores = self.scorer.score(
          params, [request.prompt for request, _, _ in group],
          [completion for _, completion, _ in group],
          [request.key for request, _, _ in group], sampling,
          first_draws=[request.first_draw for request, _, _ in group])
      with self._lock:
        self._stats.score_s += time.perf_counter() - start
    except Exception as error:  # pylint: disable=broad-except
      for _, _, future in group:
        future.set_exception(error)
      return
    for index, (_, _, future) in enumerate(group):
      future.set_result(_Scored(scores.draws[index], scores.logprobs[index],
                                scores.sampling_logprobs[index]))


__all__ = ["ExactTurns"]
