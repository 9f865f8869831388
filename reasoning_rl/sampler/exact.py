"""Zero-mismatch rollouts (`rollout.exact_logprobs`): every token is an exact draw from the
policy as the training forward computes it, and its recorded log-probs are that forward's, bit for
bit, whatever the batch, slot, padding or cache layout it was decoded in.

Why the decode path alone cannot give this: the KV-cached decode step and the trainer's full
forward compute the same function in different orders (one token against a cache vs. T tokens at
once, other batch shapes, other reduction splits), so their float results differ in the last bits
(float32) or more (bfloat16), and so do the log-probs of the same token. Importance ratios then
carry a mismatch nobody chose (docs/off_policy.md, "Exact mode").

What this module does instead:

1. **A canonical forward** (`CanonicalScorer`). Each sequence is laid out alone in one row of a
   fixed length L = max_prefill_length + max_decode_length, prompt first at position 0, and the
   rows are run one after another (`lax.map`) by one compiled program that always takes the same
   number of rows, so every sequence meets the same machine code with the same shapes whatever
   else is in the batch. (A program per row count is not enough: XLA compiles a one-row loop
   differently from a longer one, and SmolLM2's log-probs then differ in the last bit.) Causal
   attention reads only earlier positions, and masked scores contribute exact zeros, so a
   position's logits depend on the sequence's own tokens up to it and nothing else. The forward
   is the training one (`Transformer.hidden_states` + the vocabulary head, the model's dtype and
   attention kernel).
   Its outputs at each completion position t: the full-softmax log-prob of the token there, its
   log-prob under the sampler's warped distribution (`sampling.truncated_logprobs`, the function
   the trainer rebuilds π^W with), and the token the sampler's own rule (`sampling.sample_tokens`:
   Gumbel-max with the key fold_in(sample_key, t), or argmax when greedy) draws from these logits.

2. **Verify and repair** (`exact_groups`). The engine decodes as usual (the draft). The scorer then
   replays every draft: with Gumbel-max coupling (the same noise g_t at each position), a draft
   token that equals the canonical draw is exactly the token canonical sampling would have drawn
   after that prefix. At the first position where they differ (a near-tie the decode path's
   rounding resolved differently) the canonical token replaces the draft's, and the engine
   continues the sequence from there (`Engine.append_to_slot`, with the draw counter at t + 1 so
   the noise stream continues). Repeating until every position agrees yields, for each sample,
   exactly the sequence C(g) that autoregressive sampling from the canonical forward produces with
   noise g — a deterministic function of independent Gumbel noise, hence an exact sample of the
   canonical policy (the argument of speculative decoding with a coupled draft, Leviathan et al.
   2023, arXiv:2211.17192, with Gumbel-max coupling instead of rejection sampling).
   Agent runs verify each turn the rollout server serves the same way, before the reply is sent
   (`agents.exact_turns`: the turn's prompt is the episode's context before it, and its draws
   continue the episode's draw numbers, `CanonicalScorer.score`'s `first_draws`), through the
   shared step `check_draft`.

So μ (what the sampler drew from) is the canonical policy at the sampler's weights, the recorded
log-probs are its log-probs, and a trainer with the same weights needs no recomputation of π_old
and no correction: π_old = μ exactly (`rl.step_config.StepConfig.old_logprobs_from_sampler`).

Mixture-of-experts models: the canonical forward also reports the experts every sparse layer
chose for each token of the sequence, and those are the completion's recorded routing
(`Completion.experts`): the routing of the canonical policy, i.e. of μ. The trainer's own forward
computes router logits in another order, so a near-tie can pick another expert there; a run in
exact mode therefore always replays the recorded experts (`algo.routing_replay` is implied), and
the trainer routes every token exactly as μ did.

Cost (benchmarks/RESULTS.md, "Exact log-probs"): one canonical forward over every completion per
round, plus the Gumbel noise of every position again, plus a continuation per repair.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reasoning_rl.errors import PhaseInterrupted, SamplingError
from reasoning_rl.sampler import sampling as sampling_lib
from reasoning_rl.sampler.api import ExactStats
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.rollout import (Completion, find_stop_string, routing_dtype,
                                           stream_groups)
from reasoning_rl.sampler.sampling import SamplingParams, sample_key


@dataclasses.dataclass(frozen=True)
class CanonicalScores:
  """The canonical forward's view of N sequences, [N, T] each (T = the scorer's completion
  length; positions past a sequence's end hold values for padding tokens: ignore them).

  draws: the token the sampler's rule draws at each position after the sequence's prefix.
  logprobs: full-softmax log p of the sequence's own token there.
  sampling_logprobs: its log-prob under the warped, renormalised distribution (π^W).
  """

  draws: np.ndarray
  logprobs: np.ndarray
  sampling_logprobs: np.ndarray
  # MoE models: [N, L, L_sparse, k] int32, the experts of every position of each canonical row
  # (prompt first); None for a dense model.
  experts: np.ndarray | None = None


class CanonicalScorer:
  """The batch-invariant forward of `exact_logprobs` (module docstring, point 1).

  Args:
    graphdef: the policy's NNX graph definition (its parameters are passed to `score`).
    max_prompt_length, max_completion_length: the layout's row is their sum, fixed for a run:
      a sequence's scores depend on this length too, so sampler and trainer must share one scorer
      configuration.
    rows_per_call: sequences per call of the compiled program (the last call is padded): fixed,
      so one program scores everything.
  """

  def __init__(self, graphdef, *, max_prompt_length: int, max_completion_length: int,
               rows_per_call: int = 4):
    self.max_prompt_length = int(max_prompt_length)
    self.max_completion_length = int(max_completion_length)
    self.rows_per_call = int(rows_per_call)
    self.length = self.max_prompt_length + self.max_completion_length
    length, completion = self.length, self.max_completion_length

    def score(params, tokens, prompt_lengths, keys, first_draws, temperature, top_p, top_k,
              min_p):
      model = nnx.merge(graphdef, params)
      settings = tuple(jnp.broadcast_to(x, (completion,))
                       for x in (temperature, top_p, top_k, min_p))

      routed = model.config.moe is not None

      def one_sequence(args):
        row, prompt_length, key, first_draw = args
        out = model.hidden_states(row[None], jnp.ones((1, length), jnp.int32),
                                  with_router_stats=routed)
        hidden, stats = out if routed else (out, None)
        hidden = hidden[0]
        # the hidden state at position p + t - 1 predicts completion token t
        hidden = jax.lax.dynamic_slice_in_dim(hidden, prompt_length - 1, completion, axis=0)
        targets = jax.lax.dynamic_slice_in_dim(row, prompt_length, completion, axis=0)
        logits = model.logits_from_hidden(hidden).astype(jnp.float32)  # [T, V]
        log_norm = jax.nn.logsumexp(logits, axis=-1)
        full = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - log_norm
        warped = sampling_lib.truncated_logprobs(logits, targets, *settings)
        draw_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
            key, first_draw + jnp.arange(completion, dtype=jnp.int32))
        draws, _, _ = sampling_lib.sample_tokens(logits, draw_keys, *settings)
        if routed:  # [L_sparse, 1, L, k] → [L, L_sparse, k]
          return draws, full, warped, jnp.moveaxis(stats.experts[:, 0], 0, 1)
        return draws, full, warped

      return jax.lax.map(one_sequence, (tokens, prompt_lengths, keys, first_draws))

    self._score_fn = jax.jit(score)

  def layout(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]):
    """(tokens [R, L] int32, prompt lengths [R] int32) of the canonical layout, R the sequence
    count rounded up to a multiple of `rows_per_call` (padding rows: one token)."""
    rows = -(-len(prompts) // self.rows_per_call) * self.rows_per_call
    tokens = np.zeros((rows, self.length), np.int32)
    prompt_lengths = np.ones(rows, np.int32)
    for index, (prompt, completion) in enumerate(zip(prompts, completions)):
      if not 1 <= len(prompt) <= self.max_prompt_length:
        raise SamplingError(f"prompt {index}: {len(prompt)} tokens; the canonical layout holds "
                            f"1..{self.max_prompt_length}")
      if len(completion) > self.max_completion_length:
        raise SamplingError(f"completion {index}: {len(completion)} tokens exceed the canonical "
                            f"layout's {self.max_completion_length}")
      sequence = list(prompt) + list(completion)
      tokens[index, :len(sequence)] = sequence
      prompt_lengths[index] = len(prompt)
    return tokens, prompt_lengths

  def score(self, params, prompts: Sequence[Sequence[int]],
            completions: Sequence[Sequence[int]], keys: Sequence[jax.Array],
            sampling: SamplingParams, first_draws: Sequence[int] | None = None
            ) -> CanonicalScores:
    """Canonical draws and log-probs of each (prompt, completion), the n-th sequence's draws
    made with keys[n] (its `sample_key`; token t with fold_in(keys[n], first_draws[n] + t)).

    `first_draws` (default all 0): the draw number of each completion's first token, for a
    completion that continues a stream of earlier draws (an agent's later turn draws on from the
    model tokens its episode kept, `agents.driver`)."""
    if not len(prompts) == len(completions) == len(keys):
      raise SamplingError(f"score: {len(prompts)} prompts, {len(completions)} completions and "
                          f"{len(keys)} keys; pass one of each per sequence")
    first_draws = [0] * len(prompts) if first_draws is None else list(first_draws)
    if len(first_draws) != len(prompts) or min(first_draws, default=0) < 0:
      raise SamplingError(f"score: first_draws={first_draws}: pass one draw number >= 0 per "
                          "sequence")
    if not prompts:
      empty = np.zeros((0, self.max_completion_length), np.float32)
      return CanonicalScores(empty.astype(np.int32), empty, empty)
    tokens, prompt_lengths = self.layout(prompts, completions)
    rows, chunk = tokens.shape[0], self.rows_per_call
    key_rows = jnp.stack(list(keys) + [keys[0]] * (rows - len(keys)))
    first_draws = np.asarray(first_draws + [0] * (rows - len(keys)), np.int32)
    settings = (np.float32(sampling.temperature), np.float32(sampling.top_p),
                np.int32(sampling.top_k), np.float32(sampling.min_p))
    # dispatched together, fetched once: the calls queue on the device back to back
    outputs = [self._score_fn(params, tokens[i:i + chunk], prompt_lengths[i:i + chunk],
                              key_rows[i:i + chunk], first_draws[i:i + chunk], *settings)
               for i in range(0, rows, chunk)]
    draws, logprobs, warped, *experts = (np.concatenate(parts)[:len(prompts)]
                                         for parts in zip(*jax.device_get(outputs)))
    return CanonicalScores(draws, logprobs, warped, experts[0] if experts else None)


@dataclasses.dataclass
class _Pending:
  """A sequence on its way to being exact: `completion` verified below `verified`."""

  draft: Completion
  key: jax.Array
  completion: list[int]
  reason: str
  verified: int = 0


def _ending(tokens: Sequence[int], *, stop_set, max_new_tokens, tokenizer, stop_strings):
  """Why a sequence of completion tokens has ended ("stop_id", "stop_string", "length"), with
  the length it ends at, or (None, len): it continues."""
  if tokens and tokens[-1] in stop_set:
    return "stop_id", len(tokens)
  cut = find_stop_string(tokenizer, tokens, stop_strings) if stop_strings else None
  if cut is not None:
    return "stop_string", cut
  if len(tokens) >= max_new_tokens:
    return "length", len(tokens)
  return None, len(tokens)


def stop_rule(*, stop_ids: Sequence[int], max_new_tokens: int, tokenizer,
              stop_strings: Sequence[str]) -> dict:
  """How a completion ends (a stop id, a stop string, the budget), as `check_draft` takes it."""
  return dict(stop_set={int(i) for i in stop_ids}, max_new_tokens=max_new_tokens,
              tokenizer=tokenizer, stop_strings=list(stop_strings))


def check_draft(completion: Sequence[int], draws: np.ndarray, *, stop_set, max_new_tokens,
                tokenizer, stop_strings) -> tuple[int, list[int], str | None] | None:
  """One verification of a draft against the canonical draws at its positions (module
  docstring, point 2): None when every token is the canonical draw; else (t, repaired, reason):
  the first position t where they differ, the completion cut there with the canonical token in
  its place (and cut again at a stop string it now ends with), and why that repaired completion
  ends ("stop_id", "stop_string", "length"), or None when it goes on: decode on from it with the
  draw counter at len(repaired)."""
  wrong = np.flatnonzero(np.asarray(draws[:len(completion)]) != np.asarray(completion, np.int32))
  if not wrong.size:
    return None
  t = int(wrong[0])
  repaired = list(completion[:t]) + [int(draws[t])]
  reason, length = _ending(repaired, stop_set=stop_set, max_new_tokens=max_new_tokens,
                           tokenizer=tokenizer, stop_strings=stop_strings)
  return t, repaired[:length], reason


def continue_sequences(engine: Engine, items: Sequence[tuple[list[int], list[int], jax.Array]],
                       *, sampling: SamplingParams, max_new_tokens: int, stop_ids: Sequence[int],
                       stop_strings: Sequence[str], tokenizer,
                       should_stop: Callable[[], bool] | None = None) -> list[list[int]]:
  """Decodes each (prompt, completion so far, sample key) on from its end: the completion's tokens
  are appended after the prefilled prompt (`Engine.append_to_slot`) and the next draw is number
  len(completion) of the key's stream. Returns each whole completion (the given tokens first),
  ended by a stop id, a stop string (cut after it) or the budget. Runs in waves of the engine's
  slots."""
  results: list[list[int]] = []
  slots = engine.max_concurrent_decodes
  for start in range(0, len(items), slots):
    wave = items[start:start + slots]
    prepared = [engine.prepare_prompt(prompt) for prompt, _, _ in wave]
    prefixes = engine.prefill_many(
        params=engine.params, padded_tokens=[padded for padded, _ in prepared],
        true_lengths=[length for _, length in prepared],
        requests=[engine.make_request(key=key, sampling=sampling, max_new_tokens=max_new_tokens,
                                      stop_ids=stop_ids) for _, _, key in wave])
    state = engine.insert_many(prefixes, engine.init_decode_state(), range(len(prefixes)))
    tokens = []
    for slot, (prompt, completion, _) in enumerate(wave):
      state = engine.append_to_slot(engine.params, state, slot, completion, start=len(prompt),
                                    max_new_tokens=max_new_tokens - len(completion),
                                    draws_kept=len(completion))
      tokens.append(list(completion))
    live = set(range(len(wave)))
    while live:
      if should_stop is not None and should_stop():
        raise PhaseInterrupted("exact rollouts: stopped on request while repairing")
      state, result = engine.generate(engine.params, state)
      result = result.to_host()
      for slot in sorted(live):
        new = result.tokens[slot][result.valid[slot]].tolist()
        tokens[slot] += new
        cut = (find_stop_string(tokenizer, tokens[slot], stop_strings)
               if stop_strings and new else None)
        if cut is not None:
          tokens[slot] = tokens[slot][:cut]
          if not result.done[slot]:
            state = engine.release(state, slot)
          live.discard(slot)
          engine.free_resource(slot)
        elif result.done[slot]:
          live.discard(slot)
          engine.free_resource(slot)
    results += tokens
  return results


def exact_groups(engine: Engine, scorer: CanonicalScorer, prompts: Sequence[Sequence[int]], *,
                 num_samples: int, sampling: SamplingParams, max_new_tokens: int,
                 stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (), tokenizer=None,
                 seed: int = 0, prompt_ids: Sequence[int] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 stats: ExactStats | None = None, target_params=None) -> Iterator[Completion]:
  """`rollout.stream_groups`, made exact (module docstring, point 2): yields every completion once
  all of them are verified, each with the canonical forward's `logprobs` and `sampling_logprobs`
  (None when the sampling settings leave the model's distribution as it is).

  `stats`, when given, is filled in (`ExactStats`). `target_params`: the weights the canonical
  forward scores with (default: the engine's own). Other weights make the engine a draft model
  (speculative decoding): the output is still exact sampling of the target, with more repairs."""
  if max_new_tokens > scorer.max_completion_length:
    raise SamplingError(f"max_new_tokens={max_new_tokens} exceeds the canonical layout's "
                        f"{scorer.max_completion_length} completion tokens")
  stats = stats if stats is not None else ExactStats()
  target = engine.params if target_params is None else target_params
  drafts = list(stream_groups(
      engine, prompts, num_samples=num_samples, sampling=sampling, max_new_tokens=max_new_tokens,
      stop_ids=stop_ids, stop_strings=stop_strings, tokenizer=tokenizer, seed=seed,
      prompt_ids=prompt_ids, should_stop=should_stop))
  ending = stop_rule(stop_ids=stop_ids, max_new_tokens=max_new_tokens, tokenizer=tokenizer,
                     stop_strings=stop_strings)
  pending = [_Pending(draft=c, key=sample_key(seed, c.prompt_id, c.sample_index),
                      completion=list(c.completion_ids), reason=c.finish_reason)
             for c in drafts]
  stats.sequences += len(pending)
  finished: list[Completion] = []
  first_round = True
  while pending:
    stats.rounds += 1
    start = time.perf_counter()
    scores = scorer.score(target, [p.draft.prompt_tokens for p in pending],
                          [p.completion for p in pending], [p.key for p in pending], sampling)
    stats.score_s += time.perf_counter() - start
    if first_round:
      gaps = np.concatenate([np.abs(np.asarray(p.draft.logprobs) - scores.logprobs[i, :len(
          p.completion)]) for i, p in enumerate(pending)] or [np.zeros(0)])
      if gaps.size:
        stats.draft_mismatch_mean = float(gaps.mean())
        stats.draft_mismatch_max = float(gaps.max())
      first_round = False
    unverified, to_continue = [], []
    for index, p in enumerate(pending):
      n = len(p.completion)
      verdict = check_draft(p.completion, scores.draws[index], **ending)
      if verdict is None:
        stats.tokens += n
        experts = None
        if scores.experts is not None:  # the canonical routing of the prompt and completion
          experts = scores.experts[index, :len(p.draft.prompt_tokens) + n].astype(
              routing_dtype(engine.config.moe.num_experts))
        finished.append(dataclasses.replace(
            p.draft, completion_ids=p.completion,
            logprobs=scores.logprobs[index, :n].tolist(),
            sampling_logprobs=(scores.sampling_logprobs[index, :n].tolist()
                               if sampling.changes_distribution else None),
            finish_reason=p.reason, truncated=p.reason == "length", experts=experts))
        continue
      t, p.completion, reason = verdict
      stats.repairs += 1
      stats.repaired_sequences += p.verified == 0
      p.verified = t + 1
      unverified.append(p)
      if reason is None:
        to_continue.append(p)
      else:
        p.reason = reason
    if to_continue:
      start = time.perf_counter()
      continued = continue_sequences(
          engine, [(p.draft.prompt_tokens, p.completion, p.key) for p in to_continue],
          sampling=sampling, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
          stop_strings=stop_strings, tokenizer=tokenizer, should_stop=should_stop)
      stats.repair_s += time.perf_counter() - start
      for p, completion in zip(to_continue, continued):
        p.completion = completion
        p.reason = _ending(completion, **ending)[0] or "length"
    pending = unverified
  yield from finished


__all__ = ["CanonicalScorer", "CanonicalScores", "ExactStats", "check_draft",
           "continue_sequences", "exact_groups", "stop_rule"]
