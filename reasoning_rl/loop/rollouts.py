"""Rollout collection: prompts → rollout backend → scorer → one `RolloutColumns` record.

`RolloutCollector.collect` decodes G completions per prompt on the rollout backend
(`sampler.api.RolloutBackend`: the engine registered under `rollout.backend`) and hands each
group to the scorer (`reasoning_rl.workers.scorer`) the moment its G-th completion finishes, so
verification overlaps the rest of the decoding. `sample_batch` adds DAPO's dynamic sampling on top.
A group the scorer could not score (timeout / error) keeps zero rewards and its status; the step's
metrics count those apart, and the verifier guards stop a run where they pile up.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from reasoning_rl.errors import PhaseInterrupted
from reasoning_rl.evaluation import completion_record
from reasoning_rl.loop.state import SampledBatch, scoring_counts
from reasoning_rl.rl.rollout_columns import RolloutColumns


class RolloutCollector:
  """Samples and scores groups of completions for (data position, example) pairs.

  Args:
    backend: the `sampler.api.RolloutBackend` (holds the current policy); with `episodes`, one
      that declared `Capabilities.multi_turn` (config validation checks it).
    tokenizer: decodes completions; its `eos_ids` end them.
    template: `.encode(example) -> token ids`, the prompt as the policy sees it.
    scorer: a `reasoning_rl.workers.scorer.Scorer`.
    num_samples, max_new_tokens, stop_strings, sampling, seed: the rollout settings.
    episodes: a `sampler.multiturn.EpisodeSettings` when rollouts are multi-turn episodes with an
      environment (`config.environment`): the verifiers then score each episode's final model
      turn, and the environment's outcome is the record's `environment_parts`.
    teacher: on-policy distillation's `rl.teacher.Teacher` (`teacher.path`): it scores every
      collected group's sampled tokens (`RolloutColumns.teacher_logprobs`) on this replica's
      devices; None: no teacher.
  """

  def __init__(self, backend, tokenizer, template, scorer, *, num_samples: int,
               max_new_tokens: int, stop_strings: Sequence[str], sampling, seed: int,
               episodes=None, teacher=None):
    self.backend = backend
    self.tokenizer = tokenizer
    self.template = template
    self.scorer = scorer
    self.num_samples = num_samples
    self.max_new_tokens = max_new_tokens
    self.stop_strings = tuple(stop_strings)
    self.sampling = sampling
    self.seed = seed
    self.episodes = episodes
    self.teacher = teacher
    self.teacher_s = 0.0  # this step's seconds in the teacher's forwards
    self.exact_totals: list[dict] = []  # this step's ExactStats, one per generate call
    self.decode_totals: list[dict] = []  # this step's DecodeUsage, one per generate call

  def collect(self, examples: Sequence[tuple[int, object]], *, num_samples: int | None = None,
              sampling=None, should_stop=None) -> tuple[RolloutColumns, float, float]:
    """(the groups in the order of `examples`, decode seconds, seconds waiting for the scorer
    after).
    `should_stop` is asked between decode calls; True raises `errors.PhaseInterrupted` (groups
    already handed to the scorer are abandoned with it: the run exits next)."""
    g = num_samples or self.num_samples
    sampling = sampling or self.sampling
    example_at = dict(examples)
    finished: dict[int, list] = collections.defaultdict(list)
    responses: dict[int, tuple[str, ...]] = {}
    start = time.perf_counter()
    prompts = [self.template.encode(example) for _, example in examples]
    common = dict(prompt_ids=[index for index, _ in examples], num_samples=g, sampling=sampling,
                  max_new_tokens=self.max_new_tokens, stop_ids=self.tokenizer.eos_ids,
                  tokenizer=self.tokenizer, seed=self.seed, should_stop=should_stop)
    if self.episodes is None:
      stream = self.backend.generate(prompts, stop_strings=self.stop_strings, **common)
    else:
      stream = self.backend.generate_episodes(
          prompts, examples=[example for _, example in examples], episodes=self.episodes,
          **common)
    for completion in stream:
      group = finished[completion.prompt_id]
      group.append(completion)
      if len(group) < g:
        continue
      group.sort(key=lambda c: c.sample_index)
      texts = tuple(c.scored_text(self.tokenizer) for c in group)
      responses[completion.prompt_id] = texts
      example = example_at[completion.prompt_id]
      self.scorer.submit(completion.prompt_id, [
          completion_record(example, text, num_tokens=c.num_model_tokens, truncated=c.truncated,
                            max_new_tokens=self.max_new_tokens,
                            environment_parts=c.reward_parts)
          for text, c in zip(texts, group)])
    sample_s = time.perf_counter() - start
    usage = self.backend.last_usage()  # this call's (episodes measure none)
    if usage.exact is not None:  # rollout.exact_logprobs
      self.exact_totals.append(dataclasses.asdict(usage.exact))
    if usage.decode is not None:
      self.decode_totals.append(dataclasses.asdict(usage.decode))
    start = time.perf_counter()
    scored = {}
    while len(scored) < len(examples):
      item = self.scorer.get()
      scored[item.key] = item
    verify_s = time.perf_counter() - start
    out = RolloutColumns.concat(
        [RolloutColumns.of_group(index, finished[index], responses[index],
                                 status=scored[index].status, rewards=scored[index].rewards,
                                 sampling=sampling) for index, _ in examples], group_size=g)
    return self.scored_by_teacher(out), sample_s, verify_s

  def scored_by_teacher(self, rollouts: RolloutColumns) -> RolloutColumns:
    """`rollouts` with the teacher's log-probs of their tokens (as they are without a teacher);
    the seconds go to `teacher_s`."""
    if self.teacher is None:
      return rollouts
    start = time.perf_counter()
    rollouts = self.teacher.score(rollouts)
    self.teacher_s += time.perf_counter() - start
    return rollouts

  def sample_batch(self, take_examples: Callable[[int], list], *, num_prompts: int,
                   dynamic_sampling: bool, max_rounds: int, policy_version: int,
                   should_stop=None) -> SampledBatch:
    """One step's groups. DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476, §3.2) drops
    groups whose rewards are all equal (no group-relative signal) and samples more prompts, for at
    most `max_rounds` rounds; then the step trains on what it has.

    `take_examples(n)` returns the next n (data position, example) pairs of the training stream.
    `should_stop`: as in `collect`.
    """
    kept, sampled = [], []
    sample_s = verify_s = 0.0
    self.exact_totals, self.decode_totals = [], []
    self.teacher_s = 0.0
    for _ in range(max_rounds if dynamic_sampling else 1):
      groups, s, v = self.collect(
          take_examples(num_prompts - sum(k.num_groups for k in kept)), should_stop=should_stop)
      sample_s, verify_s = sample_s + s, verify_s + v
      sampled.append(groups)
      kept.append(groups.take_groups(np.flatnonzero(groups.has_signal()))
                  if dynamic_sampling else groups)
      if sum(k.num_groups for k in kept) >= num_prompts:
        break
    sampled = RolloutColumns.concat(sampled, group_size=self.num_samples)
    scoring = scoring_counts(sampled)
    return SampledBatch(
        rollouts=RolloutColumns.concat(kept, group_size=self.num_samples),
        outcome=sampled.outcome_fractions(), groups_sampled=sampled.num_groups,
        scoring=scoring, sample_s=sample_s, verify_s=verify_s,
        policy_version=policy_version, exact=exact_summary(self.exact_totals),
        teacher_s=self.teacher_s,
        decode={name: sum(call[name] for call in self.decode_totals)
                for name in self.decode_totals[0]} if self.decode_totals else None)


def exact_summary(calls: list[dict]) -> dict | None:
  """One step's `sampler.exact.ExactStats` over its sampling rounds: counts and seconds summed,
  the draft mismatch's mean weighted by tokens and its max the largest; None without any."""
  if not calls:
    return None
  total = {name: sum(call[name] for call in calls) for name in calls[0]}
  tokens = max(total["tokens"], 1)
  total["draft_mismatch_mean"] = sum(
      c["draft_mismatch_mean"] * c["tokens"] for c in calls) / tokens
  total["draft_mismatch_max"] = max(c["draft_mismatch_max"] for c in calls)
  return total


class ShardedCollector(RolloutCollector):
  """Multi-process collection: each sampler replica samples and scores its share of the prompts
  (every R-th, R = number of replicas) on its own rollout backend and verifier pool. A
  completion's random stream depends only on (seed, data position, sample index), so which replica
  samples a prompt does not change its completions. Decode / scoring seconds are the slowest replica's.

  Two channels (docs/multihost.md, "Channels"): each replica writes its groups as one file in the
  workdir (`multihost.bulk`), and the exchange's gather carries one small message per process:
  the file's descriptor, the seconds, the interrupted flag and the groups' summaries
  (`RolloutColumns.summary`). Trainer processes read every other replica's file (they build the
  batch, process 0 also its metrics and rollout records); sampler-only processes read none and
  hold the summaries, which is all their loop decides on. A replica whose sampling a stop request
  interrupted says so in the same gather, and every process then raises PhaseInterrupted: all of
  them abandon the step together."""

  def __init__(self, *args, cluster, **kwargs):
    super().__init__(*args, **kwargs)
    self.cluster = cluster

  def collect(self, examples: Sequence[tuple[int, object]], *, num_samples: int | None = None,
              sampling=None, should_stop=None) -> tuple[RolloutColumns, float, float]:
    cluster = self.cluster
    topology = cluster.topology
    replica, replicas = topology.replica_index, len(topology.replicas)
    share = list(examples)[replica::replicas] if replica is not None else []
    g = num_samples or self.num_samples
    groups, sample_s, verify_s, interrupted = RolloutColumns.empty(g), 0.0, 0.0, None
    try:
      if share:
        groups, sample_s, verify_s = super().collect(
            share, num_samples=num_samples, sampling=sampling, should_stop=should_stop)
    except PhaseInterrupted as error:
      interrupted = f"process {topology.process_index}: {error}"
    trainers = set(topology.trainer_processes)
    other_trainers = trainers - {topology.process_index}
    sampler_only = len(trainers) < topology.num_processes
    descriptor = (cluster.bulk.put("rollouts", [groups.to_json()])
                  if groups.num_groups and other_trainers else None)
    parts = cluster.exchange.gather("rollouts", {
        "file": descriptor, "sample_s": sample_s, "verify_s": verify_s,
        "interrupted": interrupted,
        "summary": groups.summary().to_json() if sampler_only else None})
    if cluster.bulk is not None:
      cluster.bulk.sweep()  # this gather proves the previous files read
    reasons = [part["interrupted"] for part in parts if part["interrupted"]]
    if reasons:
      raise PhaseInterrupted("; ".join(reasons))
    if cluster.is_trainer:  # the groups themselves: own ones in memory, the others' from files
      files = [part["file"] for process, part in enumerate(parts)
               if part["file"] and process != topology.process_index]
      with concurrent.futures.ThreadPoolExecutor(max(1, len(files))) as pool:
        items = [item for read in pool.map(lambda d: cluster.bulk.get("rollouts", d), files)
                 for item in read]
      received = RolloutColumns.concat(
          [groups] + [RolloutColumns.from_json(item) for item in items], group_size=g)
    else:
      received = RolloutColumns.concat(
          [RolloutColumns.from_json(part["summary"]) for part in parts if part["summary"]],
          group_size=g)
    group_of = {int(position): i for i, position in enumerate(received.data_position)}
    return (received.take_groups([group_of[index] for index, _ in examples]),
            max(p["sample_s"] for p in parts), max(p["verify_s"] for p in parts))
