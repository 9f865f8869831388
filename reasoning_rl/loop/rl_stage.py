"""The RL stage: one rollout batch and its updates per step, synchronous or k steps ahead.

One step's data path: rollouts (`RolloutCollector` over the `RolloutBackend`) → one record of
them (`rl.rollout_columns.RolloutColumns`) → advantages (`rl.advantages.batch_advantages`, their
own stage, kept in the record, so the rollout records show what the loss used; with a teacher,
on-policy distillation's per-token advantages, `rl.distillation`, made in the same stage from the
teacher's log-probs the collector recorded; PPO's per-token GAE advantages come out of the step,
`TrainStep.call_with_outputs`, and go back into the record through the packed layout's index)
→ the batch (`rl.batching.build_batch`: the record's samples as rows, then an agent run's
`agent.segment_rows` rows of split episodes' other segments, `rl.segment_rows`; packed by the
step's layout) → `TrainStep` → the weight sync (`WeightSync.publish`: the
sampler receives the new policy, and the policy version advances).

Asynchronous rollouts with bounded staleness k (`async_rollouts.max_staleness`): the batch trained
at step s is sampled with policy version max(0, s − 1 − k) (version v = the parameters after v
steps; `loop.weight_sync`). The loop keeps k sampled batches queued; after dispatching step s it
samples batch s + k with the newest finished version (s − 1) while the step runs, then publishes
version s to the sampler. With k = 0 the queue is empty and every batch is sampled right before its step: exactly
the synchronous loop. With k > 0 (or `algo.is_correction` set) the batch carries the sampler's
log-probs and the loss corrects against them (`rl.losses.importance_weights`). Queued batches
live in the loop state, so a resume is exact too.

Partial rollouts (`partial_rollouts.enabled`, `loop.partial_rollouts`): each step's batch is a
round over more groups than it trains on; the round ends once enough groups completed, and the
rest (unfinished samples, completed groups not trained yet) stays in the loop state's
`in_flight` for the next step's round, under the weights that step publishes.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from reasoning_rl import flops as flops_lib
from reasoning_rl import stop_signals
from reasoning_rl.data import tasks
from reasoning_rl.errors import PhaseInterrupted
from reasoning_rl.loop import compile_clock, telemetry
from reasoning_rl.loop.partial_rollouts import PartialCollector
from reasoning_rl.loop.parts import RunParts
from reasoning_rl.loop.rollouts import RolloutCollector
from reasoning_rl.loop.state import LoopState, SampledBatch
from reasoning_rl.multihost.cluster import global_batch
from reasoning_rl.rl import advantages as advantages_lib
from reasoning_rl.rl import batching, packing
from reasoning_rl.rl import distillation
from reasoning_rl.rl import segment_rows
from reasoning_rl.rl import stats as stats_lib
from reasoning_rl.rl.rollout_columns import Ragged


def take_examples(run: RunParts, loop: LoopState, count: int) -> list:
  """The next `count` (data position, example) training pairs; advances the loop's position."""
  stream = tasks.PromptStream(run.data.train_source, position=loop.data_position,
                              exclude=run.data.held_out)
  taken = stream.take(count)
  loop.data_position = stream.position
  return taken


class RLStage:
  """`step()` = sample (or dequeue) a batch, train on it, publish the new policy to the sampler.

  Args:
    run: the run's parts (`loop.parts.RunParts`).
    collector: samples and scores groups through the run's rollout backend.
    staleness: k, how many versions a trained batch may lag (0: synchronous rollouts).
    with_sampler_logprobs: the batch carries the sampler's log-probs (an importance correction
      against them is on).
  """

  def __init__(self, run: RunParts, collector: RolloutCollector, *, staleness: int,
               with_sampler_logprobs: bool):
    self.run = run
    self.collector = collector
    self.staleness = staleness
    self.with_sampler_logprobs = with_sampler_logprobs
    # (step, batch, PPO's token advantages still on the device) of the latest step, for its
    # rollout records
    self._last = None

  def sample_batch(self, loop: LoopState, *, should_stop=None) -> SampledBatch:
    """The next batch from the training stream. A stop request (`should_stop`, asked between
    decode calls) raises PhaseInterrupted with the loop's data position left where it was."""
    c = self.run.config
    position = loop.data_position
    try:
      if isinstance(self.collector, PartialCollector):  # a round; what is left stays in flight
        batch, loop.in_flight = self.collector.sample_round(
            loop.in_flight, lambda count: take_examples(self.run, loop, count),
            num_prompts=c.rollout.num_prompts, policy_version=loop.policy_version,
            should_stop=should_stop)
        return batch
      return self.collector.sample_batch(
          lambda count: take_examples(self.run, loop, count), num_prompts=c.rollout.num_prompts,
          dynamic_sampling=c.dynamic_sampling.enabled, max_rounds=c.dynamic_sampling.max_rounds,
          policy_version=loop.policy_version, should_stop=should_stop)
    except PhaseInterrupted:
      loop.data_position = position
      raise

  def start(self, loop: LoopState) -> None:
    """Fills the queue with batches 1..k, all sampled by version 0 (nothing to do when k = 0)."""
    while len(loop.queue) < self.staleness:
      loop.queue.append(self.sample_batch(loop))

  def step(self, step: int, state, loop: LoopState):
    """(new train state, metrics row) of RL step `step`.

    A stop request while this step samples its batch raises PhaseInterrupted before anything
    changed (the loop state is as after step − 1). Batches sampled ahead (asynchronous rollouts)
    are not interrupted: they are sampled while the step trains, and a resume must find them in
    the queue to continue exactly."""
    c, run = self.run.config, self.run
    start, compiled_before = time.perf_counter(), compile_clock.seconds()
    sampled = loop.queue.popleft() if loop.queue else self.sample_batch(
        loop, should_stop=stop_signals.preemption_requested)
    cluster = run.cluster
    batch = None  # sampler-only processes hold the rollouts' summary: no batch to build
    if cluster.is_trainer:
      sampled, batch = with_advantages_and_batch(
          sampled, c, pad_id=run.tokenizer.pad_id,
          with_behavior_logprobs=self.with_sampler_logprobs,
          truncation=run.step_fn.config.truncated_ratio,
          with_routing=routes_recorded(run.model_config, c))
    train_start = time.perf_counter()
    token_advantages = None
    computed_tokens = None
    if cluster.is_trainer:
      device_batch, layout = run.step_fn.host_batch_with_layout(batch, pad_id=run.tokenizer.pad_id)
      computed_tokens = layout.tokens if layout is not None else None
      if cluster.multi_process:
        device_batch = global_batch(device_batch, run.trainer_mesh)
      # dispatched; runs while we sample ahead
      state, stats, outputs = run.step_fn.call_with_outputs(state, device_batch)
      if "token_advantages" in outputs:  # PPO: left on the device until records are written
        token_advantages = (outputs["token_advantages"], layout)
    ahead_s = 0.0
    if self.staleness > 0:  # batch step + k, sampled by version step − 1
      ahead = time.perf_counter()
      loop.queue.append(self.sample_batch(loop))
      ahead_s = time.perf_counter() - ahead
    row = None
    if cluster.is_trainer:
      stats = stats_lib.finalize(jax.device_get(stats))
    train_s = time.perf_counter() - train_start - ahead_s
    published = run.weight_sync.publish(state, loop)
    self._last = (step, sampled, token_advantages)
    pool_metrics = cluster.summed_metrics(run.scorer.metrics())
    if cluster.is_primary:
      times = telemetry.StepTimes(train_s=train_s, sync_s=published.seconds,
                                  sample_ahead_s=ahead_s,
                                  step_s=time.perf_counter() - start,
                                  compile_s=compile_clock.seconds() - compiled_before)
      row = telemetry.rl_metrics(sampled, stats, reward_parts=[p.name for p in run.reward_fn.parts],
                                 policy_version=loop.policy_version,
                                 data_position=loop.data_position)
      row.update(telemetry.rl_timing(sampled, times, asynchronous=self.staleness > 0))
      row["sync/bytes"] = float(published.num_bytes)  # per sampler replica
      row.update(telemetry.rl_throughput(
          sampled, times, trained_tokens=int(batch["attention_mask"].sum()),
          computed_tokens=computed_tokens, step_flops=self._step_flops,
          peak_flops=c.logging.peak_flops_per_device * jax.device_count(),
          asynchronous=self.staleness > 0))
      row.update({f"verifier/pool/{k}": v for k, v in pool_metrics.items()})
    # every process takes the loop's decisions (guards, ...) on process 0's row
    return state, cluster.exchange.broadcast("row", row, source=0)

  def _step_flops(self, *, prompts: int, prompt_tokens: int, generated_tokens: int,
                  trained_tokens: int) -> float:
    """Model FLOPs of this step's real token counts, with the attention contexts the engine and
    the step run at (the planner's model, `reasoning_rl.flops`)."""
    r = self.run.config.rollout
    width = r.max_prefill_length + r.max_new_tokens
    return flops_lib.rl_step_flops(
        self.run.model_config, prompts=prompts, prompt_tokens=prompt_tokens,
        prompt_context=r.max_prefill_length, generated_tokens=generated_tokens,
        decode_context=width, trained_tokens=trained_tokens, trained_context=width,
        completion_tokens=generated_tokens,
        passes=flops_lib.TrainingPasses.of_step(self.run.step_fn.config, r.max_new_tokens)).total

  def rollout_records(self, step: int) -> list[dict]:
    last_step, sampled, token_advantages = self._last
    assert last_step == step, (last_step, step)
    c, run = self.run.config, self.run
    if token_advantages is not None:
      sampled = dataclasses.replace(sampled, rollouts=self._with_token_advantages(
          sampled.rollouts, *token_advantages))
    return telemetry.rollout_records(
        step, sampled, examples=run.data.train_source.example,
        decode=run.tokenizer.decode,
        # agent runs: the rewards are the agent program's, not config.rewards' verifiers
        verifier_version=(f"agent={c.agent.entry}" if c.agent.entry
                          else run.reward_fn.verifier_version),
        sampling={"temperature": c.rollout.temperature, "top_p": c.rollout.top_p,
                  "top_k": c.rollout.top_k, "max_new_tokens": c.rollout.max_new_tokens,
                  "seed": c.seed}, with_experts=c.logging.rollout_experts)

  @staticmethod
  def _with_token_advantages(rollouts, values, layout):
    """The record with PPO's per-token advantages as the step used them: fetched only here
    (steps that write no records transfer nothing), [rows, T] in the batch's rows or, packed,
    mapped back to them by the layout's one index (`packing.unpack_sequences`); row g·G + s is
    sample g·G + s of the record."""
    values = jax.device_get(values)
    if layout is not None:
      values = packing.unpack_sequences(values, layout, rollouts.num_samples)
    return rollouts.with_token_advantages(Ragged.from_rows(
        [values[row, :length] for row, length in enumerate(rollouts.completion_ids.lengths)],
        np.float32))


def with_advantages_and_batch(sampled: SampledBatch, c, *, pad_id: int,
                              with_behavior_logprobs: bool, truncation: bool,
                              with_routing: bool) -> tuple[SampledBatch, dict]:
  """(the sampled batch with its advantages, the step's padded batch): the advantage stage, then
  `batching.build_batch` (module docstring). PPO's advantages are GAE over its value head's
  predictions, made inside the step: its batch carries the rewards instead. An agent run's
  other segments of split episodes take their episodes' advantages and fill the
  `agent.segment_rows` rows appended to the batch (`rl.segment_rows`)."""
  ppo = c.algo.name == "ppo"
  if not ppo:
    rollouts = sampled.rollouts
    advantages = advantages_lib.batch_advantages(
        rollouts.group_rewards(), num_groups=c.rollout.num_prompts,
        group_size=c.rollout.num_samples, estimator=c.algo.estimator)
    rollouts = rollouts.with_advantages(advantages[:rollouts.num_groups])
    if rollouts.teacher_logprobs is not None:  # on-policy distillation: per token
      distill = distillation.DistillationSettings.from_config(c)
      rollouts = rollouts.with_token_advantages(distillation.token_advantages(
          rollouts, kl_coef=distill.kl_coef, reward_weight=distill.reward_weight,
          discount=distill.discount))
    segments = sampled.segments
    if segments is not None and len(segments):
      segments = segments.with_episode_advantages(rollouts.advantages)
    sampled = dataclasses.replace(sampled, rollouts=rollouts, segments=segments)
  layout = dict(prompt_length=c.rollout.max_prefill_length,
                completion_length=c.rollout.max_new_tokens, pad_id=pad_id, with_rewards=ppo,
                with_behavior_logprobs=with_behavior_logprobs, truncation=truncation,
                with_routing=with_routing)
  batch = batching.build_batch(sampled.rollouts, num_groups=c.rollout.num_prompts,
                               group_size=c.rollout.num_samples, **layout)
  if c.agent.entry and c.agent.segment_rows:  # every step has the rows, filled or not
    batch = segment_rows.with_segment_rows(batch, sampled.segments,
                                           capacity=c.agent.segment_rows, **layout)
  return sampled, batch


def routes_recorded(model_config, config) -> bool:
  """Whether the run's batches carry the sampler's experts (`recorded_experts`): for a
  mixture-of-experts policy, except in multi-turn episodes, whose observation tokens the engine
  appends without recording their routing (`algo.routing_replay` is refused there)."""
  return model_config.moe is not None and not config.environment.name
