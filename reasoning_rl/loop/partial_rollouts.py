"""Partial rollouts: generation that outlives a training step (`partial_rollouts.enabled`).

A synchronous step waits for its longest completion: with a long-tail length mix most decode
slots idle while a few samples run to the limit. Here a step's sampling is a *round*
(Kimi k1.5, arXiv:2501.12599, §2.6.2 "partial rollouts"; AReaL, arXiv:2505.24298):

1. Up to `groups_in_flight` prompts are in flight (more than the `num_prompts` a step trains on).
   A round continues every unfinished sample of them under the weights the sampler holds now, and
   starts the samples that never ran.
2. The round ends after the decode call in which the `num_prompts`-th group completes (all G of
   its samples finished); a completed group goes to the scorer at once.
3. The step trains on the `num_prompts` completed groups with the oldest data positions. Every
   other sample stays in flight: its tokens so far, their log-probs and the policy version that
   drew each token (`sampler.rollout.Unfinished`), and completed groups not trained yet with their
   scores.

Correction: a sample's tokens may come from several policy versions, μ_t = π_{v_t} for token t.
The sampler records log μ_t for every token when it draws it, so the loss's per-token importance
weight w_t = π_old(y_t | s_t) / μ_t(y_t | s_t) (truncated at C, `algo.is_correction`, which
partial rollouts set to token-truncate when it is "none") corrects each token against the
policy that actually drew it (docs/off_policy.md, "Partial rollouts").

Staleness cap: at the start of a round whose batch trains with version V, a sample holding a token
older than V − `max_lag` is restarted from its first token (its key stream is the same; it is
drawn again under V). So no trained token lags the weights that train on it by more than
`max_lag` versions.

Everything in flight is part of the loop state (`InFlight.to_json`), so a resumed run continues
the same samples. A stop request during a round leaves the loop state as it was before the round.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Callable

from reasoning_rl.errors import ConfigError
from reasoning_rl.evaluation import completion_record
from reasoning_rl.loop.rollouts import RolloutCollector
from reasoning_rl.loop.state import InFlight, InFlightGroup, SampledBatch, scoring_counts
from reasoning_rl.rl.rollout_columns import RolloutColumns
from reasoning_rl.sampler.api import Completion, Unfinished
from reasoning_rl.verifiers.rewards import Reward
from reasoning_rl.workers.scorer import ScoredItem


@dataclasses.dataclass(frozen=True)
class PartialSettings:
  """`partial_rollouts.*`, resolved: groups_in_flight ≥ num_prompts, max_lag ≥ 0."""

  groups_in_flight: int
  max_lag: int

  @classmethod
  def from_config(cls, config) -> "PartialSettings":
    p = config.partial_rollouts
    return cls(groups_in_flight=p.groups_in_flight or 2 * config.rollout.num_prompts,
               max_lag=p.max_lag)


def check_partial_rollouts(*, multi_process: bool) -> None:
  """ConfigError naming the field when this run cannot sample in rounds (config validation
  already checked that its backend declares `Capabilities.partial_rounds`)."""
  if multi_process:
    raise ConfigError("partial_rollouts.enabled: rounds run in one process for now (each "
                      "sampler replica would hold its own groups in flight); run one process or "
                      "set partial_rollouts.enabled=False")


class PartialCollector(RolloutCollector):
  """A `RolloutCollector` whose batches come from rounds over groups kept in flight (module
  docstring). `sample_round` replaces `sample_batch`; its backend is a `sampler.api.PartialRounds`
  (it declared `Capabilities.partial_rounds`)."""

  def __init__(self, *args, settings: PartialSettings, example_of: Callable[[int], object],
               **kwargs):
    super().__init__(*args, **kwargs)
    self.settings = settings
    self.example_of = example_of  # data position -> example (groups restored from a checkpoint)

  def sample_round(self, in_flight: InFlight, take_examples: Callable[[int], list], *,
                   num_prompts: int, policy_version: int,
                   should_stop=None) -> tuple[SampledBatch, InFlight]:
    """(this step's batch, what stays in flight). `in_flight` is not changed: the caller keeps
    the returned state once the round is over (a stop request, PhaseInterrupted, leaves the
    old one in place)."""
    state = copy.deepcopy(in_flight)
    g, lag_floor = self.num_samples, policy_version - self.settings.max_lag
    restarted = _apply_staleness_cap(state, lag_floor)
    carried = len(state.groups)
    resumed_tokens = sum(len(u.completion_ids) for group in state.groups
                         for u in group.unfinished.values())
    fresh = take_examples(self.settings.groups_in_flight - len(state.groups))
    state.groups += [InFlightGroup(position) for position, _ in fresh]
    examples = dict(fresh)
    for group in state.groups:
      if group.data_position not in examples:
        examples[group.data_position] = self.example_of(group.data_position)

    def complete() -> list[InFlightGroup]:
      return [group for group in state.groups if len(group.finished) == g]

    start, submitted = time.perf_counter(), []

    def submit(group: InFlightGroup) -> None:
      ordered = [group.finished[s] for s in range(g)]
      example = examples[group.data_position]
      self.scorer.submit(group.data_position, [
          completion_record(example, c.scored_text(self.tokenizer), num_tokens=c.num_model_tokens,
                            truncated=c.truncated, max_new_tokens=self.max_new_tokens)
          for c in ordered])
      submitted.append(group)

    for group in complete():
      if group.scored is None:  # completed, its score was dropped with a restarted sample
        submit(group)
    running = [group for group in state.groups if len(group.finished) < g]
    usage = None
    if running and len(complete()) < num_prompts:
      samples = [(group.data_position, s) for group in running for s in range(g)
                 if s not in group.finished]
      resume = [u for group in running for u in group.unfinished.values()]
      by_position = {group.data_position: group for group in running}
      stream = self.backend.generate_round(
          [self.template.encode(examples[group.data_position]) for group in running],
          prompt_ids=[group.data_position for group in running], samples=samples, resume=resume,
          round_over=lambda: len(complete()) >= num_prompts, num_samples=g,
          sampling=self.sampling, max_new_tokens=self.max_new_tokens,
          stop_ids=self.tokenizer.eos_ids, stop_strings=self.stop_strings,
          tokenizer=self.tokenizer, seed=self.seed, should_stop=should_stop)
      for item in stream:
        group = by_position[item.prompt_id]
        if isinstance(item, Unfinished):
          group.unfinished[item.sample_index] = item
          continue
        group.unfinished.pop(item.sample_index, None)
        group.finished[item.sample_index] = item
        if len(group.finished) == g:
          submit(group)
      decode = self.backend.last_usage().decode
      usage = dataclasses.asdict(decode) if decode is not None else None
    sample_s = time.perf_counter() - start
    start = time.perf_counter()
    pending = {group.data_position: group for group in submitted}
    while pending:
      item = self.scorer.get()
      pending.pop(item.key).scored = _stored_score(item)
    verify_s = time.perf_counter() - start

    chosen = sorted(complete(), key=lambda group: group.data_position)[:num_prompts]
    # the round ends at num_prompts complete groups or with all of them (more than that)
    assert len(chosen) == num_prompts, (len(chosen), num_prompts)
    state.groups = [group for group in state.groups if group not in chosen]
    rollouts = RolloutColumns.concat([RolloutColumns.of_group(
        group.data_position, [group.finished[s] for s in range(g)],
        [group.finished[s].scored_text(self.tokenizer) for s in range(g)],
        status=group.scored["status"], rewards=_rewards(group), sampling=self.sampling)
        for group in chosen], group_size=g)
    # the teacher scores the trained groups only (what stays in flight may still grow); its
    # weights never change, so scoring now equals scoring each token as it was drawn
    self.teacher_s = 0.0
    rollouts = self.scored_by_teacher(rollouts)
    versions = rollouts.token_versions.values.tolist()
    lags = [policy_version - v for v in versions] or [0]
    partial = {
        "groups_in_flight": len(state.groups) + len(chosen),
        "groups_carried": carried, "tokens_resumed": resumed_tokens,
        "samples_restarted": restarted,
        "token_lag_mean": sum(lags) / len(lags), "token_lag_max": max(lags),
        "stale_token_frac": sum(lag > 0 for lag in lags) / len(lags),
    }
    scoring = scoring_counts(rollouts)
    batch = SampledBatch(
        rollouts=rollouts, outcome=rollouts.outcome_fractions(),
        groups_sampled=rollouts.num_groups, scoring=scoring, sample_s=sample_s, verify_s=verify_s,
        policy_version=min(versions, default=policy_version), decode=usage, partial=partial,
        teacher_s=self.teacher_s)
    return batch, state


def _versions(completion: Completion) -> list[int]:
  return completion.token_versions or [completion.policy_version] * len(completion.completion_ids)


def _apply_staleness_cap(state: InFlight, floor: int) -> int:
  """Restarts every sample holding a token drawn before version `floor` (a completed group loses
  its score with it); returns how many samples were restarted."""
  restarted = 0
  for group in state.groups:
    for s, item in list(group.unfinished.items()):
      if item.token_versions and min(item.token_versions) < floor:
        del group.unfinished[s]
        restarted += 1
    for s, completion in list(group.finished.items()):
      if min(_versions(completion)) < floor:
        del group.finished[s]
        group.scored = None
        restarted += 1
  return restarted


def _stored_score(item: ScoredItem) -> dict:
  return {"status": item.status, "totals": [r.total for r in item.rewards],
          "parts": [r.parts for r in item.rewards],
          "verifier_version": item.rewards[0].verifier_version if item.rewards else ""}


def _rewards(group: InFlightGroup) -> list[Reward]:
  """The stored score of a completed group as the scorer's rewards."""
  score = group.scored
  return [Reward(total=total, parts=dict(parts), verifier_version=score["verifier_version"])
          for total, parts in zip(score["totals"], score["parts"])]
