"""Multi-turn rollouts: the model talks to an environment (a tool, a game) inside one decode slot.

An episode is a sequence of model turns and environment observations in one growing sequence:

    prompt | model turn 1 | observation 1 | model turn 2 | observation 2 | … | final model turn

This mirrors the gym-style reset / step loop used for tool-integrated RL (ToRL, Li et al. 2025;
ReTool, Feng et al. 2025): `environment.reset(example, seed=…)` starts an episode and
`episode.step(model_text)` answers each model turn with a `Turn` (observation, done, reward parts).

How it runs on the `Engine` (the same continuous batching as `rollout.stream_groups`):
- A model turn ends at one of the environment's `turn_stop_strings` (e.g. "</python>", found on
  the host), at a stop id, or at the per-turn budget. Its text goes to `episode.step` on a worker
  thread, so a slow tool (a program running in the sandbox) never stops the other slots: they keep
  decoding while the slot waits.
- The observation is formatted (`format_observation`), tokenized and appended to the waiting
  slot's KV cache with `Engine.append_to_slot`: one forward over the observation's tokens, never a
  prefill of the conversation again. The slot then decodes its next turn.
- Observation tokens are context, not actions: they carry loss mask 0 and log-prob 0, and they do
  not count against the model's token budget (they do count against `max_total_tokens`, which
  bounds the whole sequence, and against the cache).
- The verifiers read the final model turn (`Completion.scored_response`): an observation is not
  the model's answer. An environment whose observations are trusted results (a calculator) sets
  `scores_conversation = True`, and they read the whole conversation.
- The episode ends when the environment says done, after `max_turns` model turns, or when the
  next observation would not fit `max_total_tokens` / the cache; the environment's `finish` then
  gives the outcome's reward parts.
- Determinism: token n of sample g of prompt p is drawn with fold_in(sample_key(seed, p, g), n),
  n counting the model tokens the sample kept before it across its turns (tokens drawn past a
  stop string and cut off do not count: how many there are depends on how decode steps were
  batched), so an episode does not depend on slots, `steps_per_call` or other samples;
  observations depend on (example, seed, model texts) only (the environments' contract), so an
  episode is reproducible and a resumed run regenerates it exactly.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from reasoning_rl.errors import PhaseInterrupted, SamplingError
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.rollout import Completion, fill_free_slots, find_stop_string
from reasoning_rl.sampler.sampling import SamplingParams, sample_key


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
  """How a run's rollouts become episodes (built from `config.environment` by `build`).

  environment: the `environments.Environment`; format_observation: observation text -> the text
  appended after the model's turn; max_turns: model turns per episode; turn_tokens: model tokens
  per turn (the whole completion, observations included, stays within `rollout.max_new_tokens`);
  step_workers: environment steps run at once.
  """

  environment: Any
  format_observation: Callable[[str], str]
  max_turns: int
  turn_tokens: int
  step_workers: int = 8


@dataclasses.dataclass
class _Episode:
  """One sample's episode while it runs: its tokens so far and its turns."""

  prompt_id: int
  sample_index: int
  prompt_tokens: list[int]
  policy_version: int
  episode: Any  # the environment's Episode
  tokens: list[int] = dataclasses.field(default_factory=list)  # model and observation tokens
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  sampling_logprobs: list[float] = dataclasses.field(default_factory=list)
  turns: list[dict] = dataclasses.field(default_factory=list)
  model_tokens: int = 0  # model tokens kept so far (all turns)
  turn: list[int] = dataclasses.field(default_factory=list)  # the current model turn's tokens
  turn_logprobs: list[float] = dataclasses.field(default_factory=list)
  turn_sampling_logprobs: list[float] = dataclasses.field(default_factory=list)


def stream_episodes(engine: Engine, prompts: Sequence[Sequence[int]], *, examples: Sequence[Any],
                    environment, format_observation: Callable[[str], str], tokenizer,
                    num_samples: int = 1, sampling: SamplingParams = SamplingParams(),
                    max_new_tokens: int, max_turns: int, max_total_tokens: int,
                    stop_ids: Sequence[int] = (), seed: int = 0,
                    prompt_ids: Sequence[int] | None = None, step_workers: int = 8,
                    should_stop: Callable[[], bool] | None = None) -> Iterator[Completion]:
  """Yields one `Completion` per finished episode (G per prompt), continuously batching.

  Args:
    engine: the sampler engine (its current params and policy_version are used).
    prompts: token ids per prompt; examples: the task example of each prompt (`reset`'s input).
    environment: an `environments.Environment` (reset / finish, turn_stop_strings).
    format_observation: observation text -> the exact text appended after the model's turn
      (`environments.formatting`).
    tokenizer: decodes model turns, encodes observations (no special tokens added).
    num_samples: G, episodes per prompt.
    sampling: temperature / top_p / top_k / min_p.
    max_new_tokens: model tokens per turn.
    max_turns: model turns per episode.
    max_total_tokens: the whole completion (model turns + observations) at most this long.
    stop_ids: ids that end a model turn (EOS, end of turn).
    seed, prompt_ids, should_stop: as in `rollout.stream_groups`.
    step_workers: environment steps run at once (threads).

  The completion's `loss_mask` marks model tokens (1) and observation tokens (0); `turns` holds
  each model turn's text and token count with the observation appended after it (None after the
  last turn, whose answer the model never sees: that text is `unsent_observation`) and the info
  the environment answered;
  `reward_parts` the environment's outcome.
  """
  if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
    raise SamplingError(f"num_samples={num_samples!r}: must be an integer >= 1")
  for name, value in (("max_turns", max_turns), ("max_total_tokens", max_total_tokens),
                      ("step_workers", step_workers)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise SamplingError(f"{name}={value!r}: must be a positive integer")
  if len(examples) != len(prompts):
    raise SamplingError(f"examples: need one per prompt ({len(prompts)}), got {len(examples)}")
  stop_strings = tuple(environment.turn_stop_strings)
  prompt_ids = list(range(len(prompts))) if prompt_ids is None else [int(i) for i in prompt_ids]
  if len(prompt_ids) != len(prompts) or len(set(prompt_ids)) != len(prompt_ids):
    raise SamplingError(f"prompt_ids: need {len(prompts)} distinct ids, got {prompt_ids!r}")
  prepared = []
  for index, prompt in enumerate(prompts):
    try:
      prepared.append(engine.prepare_prompt(prompt))
    except SamplingError as error:
      raise SamplingError(f"prompts[{index}]: {error}") from None
  if prompts:  # validates the budget and stop ids before anything runs
    engine.make_request(key=sample_key(seed, 0, 0), sampling=sampling,
                        max_new_tokens=max_new_tokens, stop_ids=stop_ids)
  return _run_episodes(engine, prepared, prompt_ids, list(examples), environment=environment,
                       format_observation=format_observation, tokenizer=tokenizer,
                       num_samples=num_samples, sampling=sampling, max_new_tokens=max_new_tokens,
                       max_turns=max_turns, max_total_tokens=max_total_tokens,
                       stop_ids=stop_ids, stop_strings=stop_strings, seed=seed,
                       step_workers=step_workers, should_stop=should_stop)


def _run_episodes(engine, prepared, prompt_ids, examples, *, environment, format_observation,
                  tokenizer, num_samples, sampling, max_new_tokens, max_turns, max_total_tokens,
                  stop_ids, stop_strings, seed, step_workers, should_stop):
  def request(p: int, g: int):
    return engine.make_request(key=sample_key(seed, prompt_ids[p], g), sampling=sampling,
                               max_new_tokens=max_new_tokens, stop_ids=stop_ids)

  stop_set = set(int(i) for i in stop_ids)
  # what the verifiers read: the final model turn (an observation is not the model's answer), or
  # the whole conversation where the environment's observations are trusted results
  scores_conversation = bool(getattr(environment, "scores_conversation", False))
  waiting = collections.deque((p, g) for p in range(len(prepared)) for g in range(num_samples))
  prefixes: dict[int, list] = {}
  running: list[_Episode | None] = [None] * engine.max_concurrent_decodes
  stepping: dict[int, tuple[concurrent.futures.Future, str]] = {}  # slot -> (step, end reason)
  state = engine.init_decode_state()

  def close_turn(run: _Episode, length: int, reason: str) -> str:
    """Moves the turn's first `length` tokens into the episode; returns the turn's text."""
    run.tokens += run.turn[:length]
    run.loss_mask += [1] * length
    run.logprobs += run.turn_logprobs[:length]
    run.sampling_logprobs += run.turn_sampling_logprobs[:length]
    run.model_tokens += length
    text = tokenizer.decode(run.turn[:length], skip_special_tokens=True)
    run.turns.append({"model_text": text, "num_tokens": length, "finish_reason": reason})
    run.turn, run.turn_logprobs, run.turn_sampling_logprobs = [], [], []
    return text

  def finish(run: _Episode, outcome, end: str) -> Completion:
    last = run.turns[-1]
    scored = (tokenizer.decode(run.tokens, skip_special_tokens=True) if scores_conversation
              else last["model_text"])
    return Completion(
        prompt_id=run.prompt_id, sample_index=run.sample_index, prompt_tokens=run.prompt_tokens,
        completion_ids=run.tokens, logprobs=run.logprobs,
        sampling_logprobs=run.sampling_logprobs if sampling.changes_distribution else None,
        finish_reason=last["finish_reason"],
        truncated=last["finish_reason"] == "length" or end == "token_budget",
        policy_version=run.policy_version, loss_mask=run.loss_mask, turns=run.turns,
        reward_parts=dict(outcome.reward_parts), episode_end=end, scored_response=scored)

  with concurrent.futures.ThreadPoolExecutor(max_workers=step_workers,
                                             thread_name_prefix="env-step") as pool:
    calls = 0
    while waiting or any(run is not None for run in running):
      if should_stop is not None and should_stop():
        raise PhaseInterrupted(f"sampling stopped on request after {calls} decode calls")
      # Environment answers first: a continued slot decodes in this very call.
      for slot in [s for s, (future, _) in stepping.items() if future.done()]:
        future, reason = stepping.pop(slot)
        run = running[slot]
        outcome = future.result()
        run.turns[-1].update(observation=outcome.observation, info=dict(outcome.info))
        end = _episode_end(outcome, run, reason, max_turns)
        ids = None
        if end is None:
          ids = tokenizer.encode(format_observation(outcome.observation),
                                 add_special_tokens=False)
          start = len(run.prompt_tokens) + len(run.tokens)
          if (len(run.tokens) + len(ids) + 1 > max_total_tokens
              or start + len(ids) + 1 > engine.cache_length):
            end = "token_budget"
        if end is not None:
          # The episode ends here: the model never sees this observation, so the turn's
          # `observation` (what was appended after it) is None and the text is kept apart.
          last = run.turns[-1]
          if last["observation"] is not None:
            last["unsent_observation"] = last["observation"]
            last["observation"] = None
          if not outcome.done:
            outcome = environment.finish(run.episode)
          running[slot] = None
          engine.free_resource(slot)
          yield finish(run, outcome, end)
          continue
        budget = min(max_new_tokens, max_total_tokens - len(run.tokens) - len(ids))
        state = engine.append_to_slot(engine.params, state, slot, ids, start=start,
                                      max_new_tokens=budget, draws_kept=run.model_tokens)
        run.tokens += ids
        run.loss_mask += [0] * len(ids)
        run.logprobs += [0.0] * len(ids)
        run.sampling_logprobs += [0.0] * len(ids)

      state, assigned = fill_free_slots(engine, state, running, waiting, prefixes, prepared,
                                        request, num_samples)
      for slot, p, g in assigned:
        padded, true_length = prepared[p]
        running[slot] = _Episode(prompt_ids[p], g, padded[:true_length].tolist(),
                                 engine.policy_version,
                                 environment.reset(examples[p], seed=_episode_seed(
                                     seed, prompt_ids[p], g)))

      decoding = [s for s, run in enumerate(running) if run is not None and s not in stepping]
      if not decoding:
        if stepping:  # every live episode waits on its environment
          concurrent.futures.wait([future for future, _ in stepping.values()],
                                  return_when=concurrent.futures.FIRST_COMPLETED)
        continue
      calls += 1
      # Always return at a finished turn: its environment step should start at once.
      state, result = engine.generate(engine.params, state, return_on_finish=True)
      result = result.to_host()
      for slot in decoding:
        run = running[slot]
        valid = result.valid[slot]
        new_tokens = result.tokens[slot][valid].tolist()
        run.turn += new_tokens
        run.turn_logprobs += result.logprobs[slot][valid].tolist()
        run.turn_sampling_logprobs += result.sampling_logprobs[slot][valid].tolist()
        cut = (find_stop_string(tokenizer, run.turn, stop_strings)
               if stop_strings and new_tokens else None)
        if cut is not None:
          if not result.done[slot]:
            state = engine.release(state, slot)
          reason = "stop_string"
        elif result.done[slot]:
          cut = len(run.turn)
          reason = "stop_id" if run.turn and run.turn[-1] in stop_set else "length"
        else:
          continue
        text = close_turn(run, cut, reason)
        stepping[slot] = (pool.submit(run.episode.step, text), reason)


def _episode_end(outcome, run: _Episode, reason: str, max_turns: int) -> str | None:
  """Why the episode ends after this turn, or None when it goes on."""
  if outcome.done:
    return "done"
  if len(run.turns) >= max_turns:
    return "max_turns"
  if reason == "length":  # the model used its whole turn: there is no call to answer
    return "turn_budget"
  return None


def _episode_seed(seed: int, prompt_id: int, sample_index: int) -> int:
  """The environment's seed for sample g of prompt p: fixed by (seed, p, g), like the tokens."""
  return (int(seed) * 1_000_003 + int(prompt_id)) * 1_009 + int(sample_index)


def generate_episodes(engine: Engine, prompts: Sequence[Sequence[int]], **kwargs
                      ) -> list[Completion]:
  """All episodes of `stream_episodes`, ordered by (prompt_id, sample_index)."""
  completions = list(stream_episodes(engine, prompts, **kwargs))
  return sorted(completions, key=lambda c: (c.prompt_id, c.sample_index))


__all__ = ["EpisodeSettings", "generate_episodes", "stream_episodes"]
