"""Group rollouts: G completions per prompt with prefix sharing and continuous batching.

`stream_groups` drives an `Engine`:
- Each prompt is prefilled once; its `Prefix` is inserted into one slot per sample (G inserts, one
  prefill). The prefix is kept only until its last sample has a slot. The prompts that the free
  slots need are prefilled together (`Engine.prefill_many`), joined by the next waiting prompts up
  to `max_prefill_batch`, so later refills find their prefixes ready.
- Continuous batching: after every `generate` call, slots whose completion finished are refilled from
  the queue of waiting samples (prompt-major order) while the other slots keep decoding. While
  samples are waiting, `generate` returns as soon as any slot finishes, so no slot idles until the
  end of a `steps_per_call` chunk.
- Stops: a stop id (EOS, end of turn) ends a completion on device and is kept as its last token;
  `max_new_tokens` (or a full cache) ends it with `truncated=True`; stop strings (e.g. "</answer>")
  are searched on the host in the decoded text after each `generate` call.
- Where a stop string cuts: the completion keeps the shortest token prefix whose decoded text
  contains the stop string, i.e. every token up to and including the one that completes it; later
  tokens (already drawn inside the same `generate` call) are dropped with their log-probs.
- Determinism: sample g of prompt p draws its n-th token with
  fold_in(fold_in(fold_in(key(seed), p), g), n) (see `sampling.sample_key`), so a completion depends
  on (seed, prompt_id, sample_index) and the model only — not on its slot, on the other requests in
  the batch, or on the order prompts are given in.
- Rounds (partial rollouts, `loop.partial_rollouts`): with `round_over`, the caller may end the
  call after any `generate` call; every sample not finished by then comes out as an `Unfinished`
  (its tokens so far, their log-probs and the policy version that drew each). Passed back as
  `resume`, such a sample continues where it stopped, under whatever weights the engine holds
  then: its prompt is prefilled (shared by the group as usual), its tokens so far are written into
  the slot's cache by one forward (`Engine.append_to_slot`) and its next token is draw number
  len(tokens so far) of its key stream. The tokens it drew are kept as drawn; their KV entries
  are recomputed with the new weights.
- Routing (mixture-of-experts models): each completion carries the experts every sparse layer
  chose for each of its prompt and completion tokens when the engine ran them (`experts`), what
  routing replay trains with. A sample continued after a preemption keeps the routing of the
  tokens it drew before.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from reasoning_rl.errors import PhaseInterrupted, SamplingError
# the records and usage this module produces live in the JAX-free interface (re-exported here)
from reasoning_rl.sampler.api import (Completion, DecodeUsage, Unfinished,  # noqa: F401
                                      array_from_json, array_to_json)
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.sampling import SamplingParams, sample_key


def routing_dtype(num_experts: int) -> np.dtype:
  """The smallest unsigned integer type that holds an expert index."""
  return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


_INSERTIONS = itertools.count()  # orders runs by when they started (the newest is preempted)


@dataclasses.dataclass
class _Running:
  prompt_id: int
  sample_index: int
  prompt_tokens: list[int]
  policy_version: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  sampling_logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  inserted_at: int = dataclasses.field(default_factory=lambda: next(_INSERTIONS))
  # MoE models: the prompt's routing [P, L, k], then one [n, L, k] block per generate call
  experts: list[np.ndarray] | None = None

  def unfinished(self) -> Unfinished:
    return Unfinished(self.prompt_id, self.sample_index, list(self.tokens), list(self.logprobs),
                      list(self.sampling_logprobs), list(self.versions),
                      experts=(np.concatenate(self.experts[1:]) if self.experts is not None
                               and len(self.experts) > 1 else None))


def find_stop_string(tokenizer, tokens: Sequence[int], stop_strings: Sequence[str]) -> int | None:
  """Length of the shortest prefix of `tokens` whose text contains a stop string, or None.

  Decoding is monotone in the prefix for containment, so a binary search needs O(log n) decodes.
  """
  def contains(length: int) -> bool:
    text = tokenizer.decode(tokens[:length])
    return any(stop in text for stop in stop_strings)

  if not tokens or not contains(len(tokens)):
    return None
  low, high = 1, len(tokens)
  while low < high:
    middle = (low + high) // 2
    if contains(middle):
      high = middle
    else:
      low = middle + 1
  return low


def fill_free_slots(engine: Engine, state, running: list, waiting: collections.deque,
                    prefixes: dict, prepared, request, num_samples: int, resume=None,
                    max_new_tokens: int = 0, prompt_routes: dict | None = None):
  """Inserts the next waiting (prompt, sample) pairs into the free slots (`running[slot] is
  None`): (new decode state, [(slot, prompt index, sample index)] inserted); the caller records
  what runs in each. A prompt is prefilled once (`prefixes`: prompt -> [prefix, samples still to
  insert]), its samples share the prefix (`num_samples`: how many of them will be inserted).
  `resume` ((prompt index, sample) -> tokens drawn before): those tokens follow the prompt in the
  slot's cache, and the sample goes on from its draw number len(tokens), for at most
  `max_new_tokens` tokens in all. `prompt_routes` (MoE models): gets prompt index -> the routing
  of its true tokens [P, L, k] (host copy) for each prompt prefilled here."""
  free_slots = [slot for slot, run in enumerate(running) if run is None]
  assigned = [(slot, waiting.popleft()) for slot in free_slots[:len(waiting)]]
  to_prefill = list(dict.fromkeys(p for _, (p, _) in assigned if p not in prefixes))
  if to_prefill:
    # Prompts about to be needed join the call, up to max_prefill_batch: one call of several
    # prompts costs less per prompt than one call each (SmolLM2, 48-token bucket: 47 ms for one,
    # 229 ms for eight), and slots refilled later find their prefix ready.
    for p, _ in waiting:
      if len(to_prefill) >= engine.max_prefill_batch:
        break
      if p not in prefixes and p not in to_prefill:
        to_prefill.append(p)
    new_prefixes = engine.prefill_many(
        params=engine.params, padded_tokens=[prepared[p][0] for p in to_prefill],
        true_lengths=[prepared[p][1] for p in to_prefill],
        requests=[request(p, 0) for p in to_prefill])
    prefixes.update({p: [prefix, num_samples if isinstance(num_samples, int) else num_samples[p]]
                     for p, prefix in zip(to_prefill, new_prefixes)})
    if prompt_routes is not None:
      for p, prefix in zip(to_prefill, new_prefixes):
        if prefix.experts is not None:
          prompt_routes[p] = np.asarray(prefix.experts)[:prepared[p][1]]
  inserted, placed = [], []
  at_once = engine.inserts_many_at_once  # else each insert changes the room for the next
  for index, (slot, (p, g)) in enumerate(assigned):
    entry = prefixes[p]
    if not engine.has_room_for(entry[0], len((resume or {}).get((p, g)) or ())):
      # a paged cache without the pages: wait for samples to finish
      waiting.extendleft(reversed([pair for _, pair in assigned[index:]]))
      break
    inserted.append((slot, (p, g)))
    placed.append(entry[0].with_request(request(p, g)))
    if not at_once:
      state = engine.insert(placed[-1], state, slot)
    entry[1] -= 1
    if entry[1] == 0:
      del prefixes[p]
    if not at_once:
      state = append_drawn(engine, state, slot, p, g, resume, prepared, max_new_tokens)
  if at_once and inserted:
    # one program call per prompt bucket instead of one per slot (`Engine.insert_many`)
    state = engine.insert_many(placed, state, [slot for slot, _ in inserted])
    for slot, (p, g) in inserted:
      state = append_drawn(engine, state, slot, p, g, resume, prepared, max_new_tokens)
  return state, [(slot, p, g) for slot, (p, g) in inserted]


def append_drawn(engine: Engine, state, slot: int, p: int, g: int, resume, prepared,
                 max_new_tokens: int):
  """`state` with sample (p, g)'s tokens drawn before (`resume`), if any, appended in `slot`."""
  drawn = (resume or {}).get((p, g))
  if not drawn:
    return state
  return engine.append_to_slot(engine.params, state, slot, drawn, start=prepared[p][1],
                               max_new_tokens=max_new_tokens - len(drawn), draws_kept=len(drawn))


def stream_groups(engine: Engine, prompts: Sequence[Sequence[int]], *, num_samples: int = 1,
                  sampling: SamplingParams = SamplingParams(), max_new_tokens: int,
                  stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                  tokenizer=None, seed: int = 0, prompt_ids: Sequence[int] | None = None,
                  should_stop: Callable[[], bool] | None = None,
                  samples: Sequence[tuple[int, int]] | None = None,
                  resume: Sequence[Unfinished] = (),
                  round_over: Callable[[], bool] | None = None,
                  usage: DecodeUsage | None = None) -> Iterator[Completion | Unfinished]:
  """Yields completions as they finish (G per prompt), continuously batching on `engine`.

  Args:
    engine: the sampler engine (its current params and policy_version are used).
    prompts: token ids per prompt.
    num_samples: G, completions per prompt.
    sampling: temperature / top_p / top_k.
    max_new_tokens: budget per completion (<= engine.max_decode_length).
    stop_ids: token ids that end a completion (usually tokenizer.eos_ids); empty = none.
    stop_strings: texts that end a completion (needs `tokenizer`).
    tokenizer: decodes completions for stop strings.
    seed: root of every sample's PRNG key (see the module docstring).
    prompt_ids: ids to report and to derive keys from (default 0..P-1); must be distinct.
    should_stop: asked before every `generate` call; True abandons the whole call (raises
      PhaseInterrupted): a preemption notice then waits for one decode chunk, not for the rest
      of the batch.
    samples: (prompt_id, sample_index) pairs to run, in order (default: every prompt's G
      samples, prompt-major); a group partly finished in an earlier round runs the rest.
    resume: `Unfinished` samples of an earlier round, continued where they stopped (module
      docstring); each must be one of `samples`.
    round_over: asked after every `generate` call (once the completions it finished are
      yielded); True ends the call: every sample still running or waiting is yielded as an
      `Unfinished`, and the generator returns.
    usage: a `DecodeUsage` that counts decode steps and live slots (idle slots are the cost of
      waiting for the longest completion).

  Raises:
    SamplingError: bad arguments or prompts — raised before any decoding starts.
    PhaseInterrupted: `should_stop()` said so.
  """
  if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
    raise SamplingError(f"num_samples={num_samples!r}: must be an integer >= 1")
  stop_strings = [s for s in stop_strings]
  if any(not isinstance(s, str) or not s for s in stop_strings):
    raise SamplingError(f"stop_strings={stop_strings!r}: must be non-empty strings")
  if stop_strings and tokenizer is None:
    raise SamplingError("stop_strings: need a tokenizer to decode completions; pass tokenizer=")
  prompt_ids = list(range(len(prompts))) if prompt_ids is None else [int(i) for i in prompt_ids]
  if len(prompt_ids) != len(prompts) or len(set(prompt_ids)) != len(prompt_ids):
    raise SamplingError(f"prompt_ids: need {len(prompts)} distinct ids, got {prompt_ids!r}")
  prepared = []
  for index, prompt in enumerate(prompts):
    try:
      prepared.append(engine.prepare_prompt(prompt))
    except SamplingError as error:
      raise SamplingError(f"prompts[{index}]: {error}") from None

  if prompts:  # validates max_new_tokens and stop_ids before anything runs
    engine.make_request(key=sample_key(seed, 0, 0), sampling=sampling,
                        max_new_tokens=max_new_tokens, stop_ids=stop_ids)
  index_of = {prompt_id: index for index, prompt_id in enumerate(prompt_ids)}
  if samples is None:
    order = [(p, g) for p in range(len(prepared)) for g in range(num_samples)]
  else:
    order = []
    for prompt_id, g in samples:
      if prompt_id not in index_of or not 0 <= g < num_samples:
        raise SamplingError(f"samples: ({prompt_id}, {g}) is not a sample of these prompts "
                            f"(prompt_ids {prompt_ids}, num_samples={num_samples})")
      order.append((index_of[prompt_id], g))
    if len(set(order)) != len(order):
      raise SamplingError("samples: a (prompt_id, sample_index) pair appears twice")
  continued, to_run = {}, set(order)
  for item in resume:
    key = (index_of.get(item.prompt_id), item.sample_index)
    if key not in to_run:
      raise SamplingError(f"resume: sample ({item.prompt_id}, {item.sample_index}) is not one "
                          "of the samples to run")
    lengths = {len(item.completion_ids), len(item.logprobs), len(item.sampling_logprobs),
               len(item.token_versions)}
    if len(lengths) != 1 or len(item.completion_ids) >= max_new_tokens:
      raise SamplingError(f"resume: sample ({item.prompt_id}, {item.sample_index}) has "
                          f"{sorted(lengths)} tokens / log-probs / versions; they must agree and "
                          f"be fewer than max_new_tokens={max_new_tokens}")
    continued[key] = item
  return _run_groups(engine, prepared, prompt_ids, num_samples=num_samples, sampling=sampling,
                     max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                     stop_strings=stop_strings, tokenizer=tokenizer, seed=seed,
                     should_stop=should_stop, order=order, continued=continued,
                     round_over=round_over, usage=usage)


def _run_groups(engine: Engine, prepared, prompt_ids, *, num_samples, sampling, max_new_tokens,
                stop_ids, stop_strings, tokenizer, seed, should_stop, order, continued,
                round_over, usage) -> Iterator[Completion | Unfinished]:
  """The decoding loop of `stream_groups` (arguments already validated)."""

  def request(prompt_index: int, sample_index: int):
    return engine.make_request(key=sample_key(seed, prompt_ids[prompt_index], sample_index),
                               sampling=sampling, max_new_tokens=max_new_tokens,
                               stop_ids=stop_ids)

  stop_set = set(int(i) for i in stop_ids)
  waiting = collections.deque(order)
  per_prompt = collections.Counter(p for p, _ in order)
  prefixes: dict[int, list] = {}  # prompt index -> [prefix, samples still to insert]
  running: list[_Running | None] = [None] * engine.max_concurrent_decodes
  state = engine.init_decode_state()
  resume_tokens = {key: item.completion_ids for key, item in continued.items()
                   if item.completion_ids}

  route_type = (routing_dtype(engine.config.moe.num_experts)
                if engine.config.moe is not None else None)
  prompt_routes: dict[int, np.ndarray] = {}

  def routes(run: _Running, length: int) -> np.ndarray | None:
    """The routing of the prompt and the first `length` completion tokens."""
    if run.experts is None:
      return None
    prompt = len(run.prompt_tokens)
    return np.concatenate(run.experts)[:prompt + length].astype(route_type)

  def finish(run: _Running, length: int, reason: str) -> Completion:
    mixed = len(set(run.versions[:length])) > 1
    return Completion(
        prompt_id=run.prompt_id, sample_index=run.sample_index, prompt_tokens=run.prompt_tokens,
        completion_ids=run.tokens[:length], logprobs=run.logprobs[:length],
        sampling_logprobs=(run.sampling_logprobs[:length] if sampling.changes_distribution
                           else None),
        finish_reason=reason, truncated=reason == "length",
        policy_version=min(run.versions[:length], default=run.policy_version),
        token_versions=run.versions[:length] if mixed else None, experts=routes(run, length))

  calls = 0
  sample_in = {}  # slot -> (prompt index, sample index) of its run
  while waiting or any(run is not None for run in running):
    if should_stop is not None and should_stop():
      raise PhaseInterrupted(f"sampling stopped on request after {calls} decode calls")
    calls += 1
    state, assigned = fill_free_slots(engine, state, running, waiting, prefixes, prepared,
                                      request, per_prompt, resume=resume_tokens,
                                      max_new_tokens=max_new_tokens, prompt_routes=prompt_routes)
    for slot, p, g in assigned:
      padded, true_length = prepared[p]
      run = running[slot] = _Running(prompt_ids[p], g, padded[:true_length].tolist(),
                                     engine.policy_version)
      sample_in[slot] = (p, g)
      if route_type is not None:
        run.experts = [prompt_routes[p]]
      before = continued.get((p, g))
      if before is not None:
        run.tokens, run.logprobs = list(before.completion_ids), list(before.logprobs)
        run.sampling_logprobs = list(before.sampling_logprobs)
        run.versions = list(before.token_versions)
        if run.experts is not None and before.completion_ids:
          if before.experts is None:
            raise SamplingError(
                f"resume: sample ({before.prompt_id}, {before.sample_index}) of a "
                "mixture-of-experts model has no routing for its tokens so far (an earlier "
                "round's samples keep it only within one stream_groups call)")
          run.experts.append(before.experts)
    # A paged cache short of pages for this call: its newest samples go back to the queue's
    # front, continued later from their tokens so far (recompute preemption, as vLLM's).
    newest_first = sorted((s for s, run in enumerate(running) if run is not None),
                          key=lambda s: -running[s].inserted_at)
    for slot in engine.slots_to_preempt(state, newest_first):
      run, (p, g) = running[slot], sample_in[slot]
      state = engine.release(state, slot)
      engine.free_resource(slot)
      running[slot] = None
      continued[(p, g)] = run.unfinished()
      resume_tokens[(p, g)] = list(run.tokens)
      waiting.appendleft((p, g))
      if p in prefixes:
        prefixes[p][1] += 1
      else:  # its prefix is gone: the next prefill of p serves every waiting sample of p
        per_prompt[p] = sum(1 for q, _ in waiting if q == p)
      if usage is not None:
        usage.preempted += 1

    state, result = engine.generate(engine.params, state,
                                    return_on_finish=bool(waiting) or round_over is not None)
    result = result.to_host()
    if usage is not None:
      steps = int(result.num_steps)
      usage.calls, usage.steps = usage.calls + 1, usage.steps + steps
      usage.slot_steps += steps * len(running)
      usage.live_slot_steps += int(result.valid.sum())
    for slot, run in enumerate(running):
      if run is None:
        continue
      valid = result.valid[slot]
      new_tokens = result.tokens[slot][valid].tolist()
      run.tokens += new_tokens
      run.logprobs += result.logprobs[slot][valid].tolist()
      run.sampling_logprobs += result.sampling_logprobs[slot][valid].tolist()
      run.versions += [engine.policy_version] * len(new_tokens)
      if run.experts is not None:
        run.experts.append(result.experts[slot][valid])
      cut = (find_stop_string(tokenizer, run.tokens, stop_strings)
             if stop_strings and new_tokens else None)
      if cut is not None:
        if not result.done[slot]:
          state = engine.release(state, slot)
        running[slot] = None
        engine.free_resource(slot)
        yield finish(run, cut, "stop_string")
      elif result.done[slot]:
        running[slot] = None
        engine.free_resource(slot)
        ended_by_stop_id = bool(run.tokens) and run.tokens[-1] in stop_set
        yield finish(run, len(run.tokens), "stop_id" if ended_by_stop_id else "length")
    if round_over is not None and (waiting or any(r is not None for r in running)) \
        and round_over():
      for run in running:
        if run is not None:
          yield run.unfinished()
      for p, g in waiting:
        before = continued.get((p, g))
        yield before if before is not None else Unfinished(prompt_ids[p], g, [], [], [], [])
      return


def generate_groups(engine: Engine, prompts: Sequence[Sequence[int]], **kwargs) -> list[Completion]:
  """All completions of `stream_groups`, ordered by (prompt_id, sample_index)."""
  completions = list(stream_groups(engine, prompts, **kwargs))
  return sorted(completions, key=lambda c: (c.prompt_id, c.sample_index))


__all__ = ["Completion", "DecodeUsage", "Unfinished", "find_stop_string", "generate_groups",
           "array_from_json", "array_to_json", "routing_dtype", "stream_groups"]
