"""One thread drives the engine; requests from any thread join its decode slots as they arrive.

`EngineDriver.submit(DecodeRequest)` queues a request and returns a `concurrent.futures.Future`
of its `DecodeResult`. The driver thread runs the engine's own calls as `sampler.rollout` does
for in-process rollouts — `prefill_many` for the requests that got a free slot (several at once
when several wait), `insert` into those slots, then `generate` for every live slot with
`return_on_finish`, so a finished request frees its slot for the next waiting one at once — and
checks stop strings on the host after each call. Concurrent requests therefore share the decode
batch: continuous batching, not one request after another.

Determinism: token n of a request is drawn with fold_in(key, n), `key` the request's own
(`request_key`: seed, session, turn, choice), so a request's tokens do not depend on which slot it
ran in or what else was decoding.

Episodes the trainer runs (`own_episode`: the collector's sessions) are seeded as in-process
multi-turn episodes are (`sampler.multiturn`): every request of episode g of data position p
draws from the one key sample_key(seed, p, g), token n of the episode with fold_in(key, n), n
counting the model tokens its earlier requests kept. The same task, seed and agent behaviour
then draw the tokens an environment's episode draws, and a rerun draws them again.

Each request runs its whole prompt through the model again: the conversation of an agent's
earlier turns, since its slot went to other requests while the agent was thinking. (A request
that continues an episode's draws prefills all but the prompt's last token, which
`Engine.append_to_slot` feeds with the draw number to continue from.)

Exact turns (`exact_turns`, `rollout.exact_logprobs`) seed their requests explicitly
(`DecodeRequest.first_draw`, from `turn_seeding`) and settle an episode's draw count once a turn
is verified (`count_draws`); a repair is a request whose `prefix` holds the verified tokens, fed
after the prompt with `append_to_slot`, the draws going on after them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import threading
import zlib
from collections.abc import Sequence

import jax

from reasoning_rl.errors import SamplingError
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.rollout import find_stop_string
from reasoning_rl.sampler.sampling import SamplingParams, sample_key


def request_key(seed: int, session: str | None, turn: int, choice: int) -> jax.Array:
  """The PRNG key of choice `choice` of turn `turn` of `session`: fold_in(sample_key(seed,
  crc32(session), turn), choice). The same session id, turn and seed draw the same tokens."""
  session_number = zlib.crc32((session or "").encode()) & 0x7FFFFFFF
  return jax.random.fold_in(sample_key(seed, session_number, turn), choice)


@dataclasses.dataclass
class DecodeRequest:
  """One sequence to decode: its prompt tokens, key, sampling, budget and stops."""

  prompt: Sequence[int]
  key: jax.Array
  sampling: SamplingParams
  max_new_tokens: int
  stop_ids: Sequence[int] = ()
  stop_strings: Sequence[str] = ()
  # the session it belongs to: an episode's (`EngineDriver.own_episode`) is seeded by the episode
  session: str | None = None
  # seeded explicitly instead (exact turns, `agents.exact_turns`): `key`'s stream from this draw
  # number on, whatever the session; not counted in an owned episode's draws
  first_draw: int | None = None
  # tokens the completion already holds (a repaired draft's verified part): fed after the prompt,
  # draws go on after them (number first_draw + len(prefix)), and the result starts with them
  # (log-probs 0: the caller scores them); `max_new_tokens` counts them
  prefix: Sequence[int] = ()


@dataclasses.dataclass
class DecodeResult:
  """What a request drew: tokens (kept up to a stop string), both log-probs of each, the policy
  version that drew each, and why it ended ("stop_id", "stop_string" or "length")."""

  tokens: list[int]
  logprobs: list[float]
  sampling_logprobs: list[float]
  versions: list[int]
  finish_reason: str


@dataclasses.dataclass(frozen=True)
class EpisodeSeeding:
  """How an owned episode's requests draw: from sample_key(seed, prompt_id, sample_index)."""

  seed: int
  prompt_id: int
  sample_index: int


@dataclasses.dataclass(eq=False)  # compared by identity (its request holds a PRNG key array)
class _Live:
  request: DecodeRequest
  future: concurrent.futures.Future
  episode: str | None = None  # the owned episode whose draws it continues
  result: DecodeResult = dataclasses.field(
      default_factory=lambda: DecodeResult([], [], [], [], "length"))


_STOP = object()


class EngineDriver:
  """Owns the decode state of `engine`; see the module docstring. `tokenizer` decodes for stop
  strings. `stop()` fails what is queued or running and ends the thread."""

  def __init__(self, engine: Engine, *, tokenizer=None):
    self.engine = engine
    self.tokenizer = tokenizer
    self._queue: queue.Queue = queue.Queue()
    self.requests_done = 0
    self.most_live = 0  # the most requests that decoded in one generate call
    self._episodes: dict[str, EpisodeSeeding] = {}
    self._draws: dict[str, int] = {}  # an owned episode's model tokens kept so far
    self._episodes_lock = threading.Lock()
    self._thread = threading.Thread(target=self._run, name="engine-driver", daemon=True)
    self._thread.start()

  def submit(self, request: DecodeRequest) -> concurrent.futures.Future:
    """Queues `request`; the future raises SamplingError for a prompt or budget the engine
    refuses."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if not self._thread.is_alive():
      future.set_exception(SamplingError("the engine driver was stopped"))
      return future
    self._queue.put((request, future))
    return future

  def own_episode(self, session: str, *, seed: int, prompt_id: int, sample_index: int) -> None:
    """From now on `session`'s requests are episode `sample_index` of `prompt_id`'s (module
    docstring), starting at draw 0."""
    with self._episodes_lock:
      self._episodes[session] = EpisodeSeeding(seed, prompt_id, sample_index)
      self._draws[session] = 0

  def release_episode(self, session: str) -> None:
    """`session`'s requests are seeded by their own keys again."""
    with self._episodes_lock:
      self._episodes.pop(session, None)
      self._draws.pop(session, None)

  def turn_seeding(self, session: str | None, key: jax.Array) -> tuple[jax.Array, int]:
    """(key, first draw number) a request of `session` with its own `key` draws with now: its
    owned episode's (module docstring), or (key, 0)."""
    seeded, first_draw, _ = self._episode_seeding(session, key)
    return seeded, first_draw

  def count_draws(self, session: str, kept: int) -> None:
    """Adds `kept` model tokens to an owned episode's draws (for requests seeded explicitly,
    `DecodeRequest.first_draw`, whose tokens were settled after they decoded)."""
    with self._episodes_lock:
      if session in self._draws:
        self._draws[session] += kept

  def _seeding(self, request: DecodeRequest) -> tuple[jax.Array, int, str | None]:
    """(the key a request draws with, the draw number of its first token, the owned episode
    whose draws it continues or None)."""
    if request.first_draw is not None:
      return request.key, request.first_draw, None
    return self._episode_seeding(request.session, request.key)

  def _episode_seeding(self, session: str | None, key: jax.Array
                       ) -> tuple[jax.Array, int, str | None]:
    """(key, first draw number, owned episode) of a request of `session` with its own `key`:
    the owned episode's key and the model tokens it kept so far, or (key, 0, None)."""
    with self._episodes_lock:
      episode = self._episodes.get(session) if session is not None else None
      if episode is None:
        return key, 0, None
      return (sample_key(episode.seed, episode.prompt_id, episode.sample_index),
              self._draws[session], session)

  def _kept(self, live: _Live) -> None:
    """Counts a finished request's kept tokens in its episode's draws."""
    if live.episode is None:
      return
    with self._episodes_lock:
      if live.episode in self._draws:
        self._draws[live.episode] += len(live.result.tokens)

  def stop(self) -> None:
    if self._thread.is_alive():
      self._queue.put(_STOP)
      self._thread.join()

  # ------------------------------------------------------------------------------ the thread

  def _run(self) -> None:
    engine = self.engine
    waiting: collections.deque = collections.deque()
    running: list[_Live | None] = [None] * engine.max_concurrent_decodes
    state = None
    while True:
      idle = not waiting and all(r is None for r in running)
      try:
        item = self._queue.get() if idle else self._queue.get_nowait()
        while True:
          if item is _STOP:
            self._fail_all(waiting, running, SamplingError("the engine driver was stopped"))
            return
          waiting.append(item)
          item = self._queue.get_nowait()
      except queue.Empty:
        pass
      try:
        if state is None:
          state = engine.init_decode_state()
        state = self._fill(state, waiting, running)
        if all(r is None for r in running):
          state = None  # nothing decodes: the next request starts from a fresh state
          continue
        state = self._step(state, running)
      except Exception as error:  # pylint: disable=broad-except
        # an engine failure fails the requests it held; the driver goes on with a fresh state
        self._fail_all((), running, error)
        state = None

  def _fill(self, state, waiting, running):
    """Prefills the waiting requests that fit in free slots and inserts them."""
    engine = self.engine
    free = [slot for slot, r in enumerate(running) if r is None]
    chosen = []
    while waiting and len(chosen) < len(free):
      request, future = waiting.popleft()
      if not future.set_running_or_notify_cancel():
        continue
      key, draws_kept, episode = self._seeding(request)
      # a request that continues its episode's draws prefills its prompt but the last token,
      # which `append_to_slot` feeds with the episode's draw number (as multi-turn episodes and
      # partial rollouts resume a slot); one with a prefix prefills the prompt and feeds that
      held, budget = list(request.prefix), request.max_new_tokens - len(request.prefix)
      prefilled = list(request.prompt[:-1] if draws_kept and not held else request.prompt)
      appended = held or list(request.prompt[len(prefilled):])
      try:
        if appended and not 1 <= len(prefilled) < engine.cache_length - len(appended):
          raise SamplingError(f"prompt: {len(request.prompt) + len(held)} tokens leave no "
                              f"room to decode in the engine's cache of {engine.cache_length}")
        if budget < 1:
          raise SamplingError(f"max_new_tokens={request.max_new_tokens} leaves no token to draw "
                              f"after the prefix of {len(held)}")
        padded, length = engine.prepare_prompt(prefilled)
        slot_request = engine.make_request(key=key, sampling=request.sampling,
                                           max_new_tokens=budget, stop_ids=request.stop_ids)
      except SamplingError as error:
        future.set_exception(error)
        continue
      live = _Live(request, future, episode)
      live.result = DecodeResult(held, [0.0] * len(held), [0.0] * len(held),
                                 [engine.policy_version] * len(held), "length")
      chosen.append((live, padded, length, slot_request,
                     (appended, draws_kept + len(held), budget)))
    if not chosen:
      return state
    try:
      prefixes = engine.prefill_many(params=engine.params,
                                     padded_tokens=[c[1] for c in chosen],
                                     true_lengths=[c[2] for c in chosen],
                                     requests=[c[3] for c in chosen])
      state = engine.insert_many(prefixes, state, free[:len(prefixes)])
      for slot, (live, _, length, _, (appended, draws_kept, budget)) in zip(free, chosen):
        if appended:
          state = engine.append_to_slot(engine.params, state, slot, appended, start=length,
                                        max_new_tokens=budget, draws_kept=draws_kept)
        running[slot] = live
    except Exception as error:  # pylint: disable=broad-except
      # the requests not in a slot yet fail here; those in one fail with the rest (`_run`)
      for live, *_ in chosen:
        if not live.future.done() and live not in running:
          live.future.set_exception(error)
      raise
    return state

  def _step(self, state, running):
    """One `generate` call; finished requests get their results."""
    engine = self.engine
    version = engine.policy_version
    state, result = engine.generate(engine.params, state, return_on_finish=True)
    result = result.to_host()
    self.most_live = max(self.most_live, sum(r is not None for r in running))
    for slot, live in enumerate(running):
      if live is None:
        continue
      valid = result.valid[slot]
      out = live.result
      new = result.tokens[slot][valid].tolist()
      out.tokens += new
      out.logprobs += result.logprobs[slot][valid].tolist()
      out.sampling_logprobs += result.sampling_logprobs[slot][valid].tolist()
      out.versions += [version] * len(new)
      stops = live.request.stop_strings
      cut = (find_stop_string(self.tokenizer, out.tokens, stops)
             if stops and new and self.tokenizer is not None else None)
      if cut is not None:
        if not result.done[slot]:
          state = engine.release(state, slot)
        for name in ("tokens", "logprobs", "sampling_logprobs", "versions"):
          setattr(out, name, getattr(out, name)[:cut])
        out.finish_reason = "stop_string"
      elif result.done[slot]:
        stop_ids = set(int(i) for i in live.request.stop_ids)
        out.finish_reason = "stop_id" if out.tokens and out.tokens[-1] in stop_ids else "length"
      else:
        continue
      running[slot] = None
      engine.free_resource(slot)
      self.requests_done += 1
      self._kept(live)
      live.future.set_result(out)
    return state

  @staticmethod
  def _fail_all(waiting, running, error) -> None:
    for _, future in waiting:
      if not future.done():
        future.set_exception(error)
    for slot, live in enumerate(running):
      if live is not None:
        if not live.future.done():
          live.future.set_exception(error)
        running[slot] = None


__all__ = ["DecodeRequest", "DecodeResult", "EngineDriver", "EpisodeSeeding", "request_key"]
