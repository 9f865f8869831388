"""The RL loop: prompts → sampler slice → verifiers → advantages → fused step → weight sync.

One `Trainer` owns the side effects of a run (devices, files, worker processes); the numerical work
is done by pure pieces (`rl.step.TrainStep`, `rl.batching`, `sampler`). A run is a function of its
config: the data position is an integer, each completion's random stream derives from (seed, data
position of its prompt, sample index), and the loop state is checkpointed, so a restart on the same
workdir continues bit for bit.

Asynchronous rollouts with bounded staleness k (`async_rollouts.max_staleness`): the batch trained
at step s is sampled with policy version max(0, s − 1 − k) (version v = parameters after v
updates). The loop keeps k sampled batches queued; after dispatching step s it samples batch s + k
with the newest finished version (s − 1) while the step runs, then publishes version s to the
sampler. With k = 0 the queue is empty and every batch is sampled right before its step: exactly
the synchronous loop. With k > 0 the loss applies truncated importance sampling against the
sampler's log-probs. Queued batches are saved in the checkpoint, so a resume is exact too.

Exit codes of `run()`: 0 finished, 3 a guard stopped the run (STOPPED.md), 143 preempted by SIGTERM
after saving a checkpoint (see reasoning_rl.guards).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from reasoning_rl import checkpointing
from reasoning_rl import config as config_lib
from reasoning_rl import evaluation
from reasoning_rl import guards as guards_lib
from reasoning_rl import metrics as metrics_lib
from reasoning_rl import sharding as sharding_lib
from reasoning_rl.data import tasks, templates
from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import batching
from reasoning_rl.rl import stats as stats_lib
from reasoning_rl.rl.step import StepConfig, TrainStep
from reasoning_rl.sampler import Engine, SamplingParams, stream_groups
from reasoning_rl.sft import SFTStages
from reasoning_rl.verifiers.rewards import CompletionRecord, Reward, RewardFunction

log = logging.getLogger("reasoning_rl")


class GroupScorer:
  """Picklable verifier-pool job: one prompt's records -> their rewards (group-level parts OK)."""

  def __init__(self, reward_fn: RewardFunction):
    self.reward_fn = reward_fn

  def __call__(self, records):
    return self.reward_fn.score_group(records)


@dataclasses.dataclass
class SampledBatch:
  """One step's sampled and scored groups (JSON-able, so queued batches can be checkpointed).

  groups: [data position of the prompt, ScoredGroup fields, decoded responses] per kept group.
  """

  groups: list
  outcome: dict
  groups_sampled: int
  timeouts: int
  verifications: int
  sample_s: float
  verify_s: float
  policy_version: int

  def scored(self) -> list[tuple[int, batching.ScoredGroup, list[str]]]:
    return [(index, batching.ScoredGroup(**fields), responses)
            for index, fields, responses in self.groups]


def step_config(config: ml_collections.ConfigDict) -> StepConfig:
  a, o = config.algo, config.optim
  return StepConfig(
      algorithm="sft" if config.stage != "rl" else ("ppo" if a.name == "ppo" else "grpo"),
      beta=config.beta,
      kl_estimator=a.kl_estimator, epsilon_low=a.epsilon_low, epsilon_high=a.epsilon_high,
      dual_clip=a.dual_clip, loss_agg=a.loss_agg, entropy_coef=a.entropy_coef,
      tis_cap=a.tis_cap, max_completion_length=config.rollout.max_new_tokens,
      num_micro_batches=a.num_micro_batches, num_inner_updates=a.num_inner_updates,
      logprob_chunk=a.logprob_chunk, remat=a.remat, learning_rate=o.learning_rate, warmup_steps=o.warmup_steps,
      total_steps=config.total_steps, final_lr_fraction=o.final_lr_fraction,
      weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm)


class Trainer(SFTStages):
  """Builds everything a run needs from its config, then `run()` trains (RL or an SFT stage)."""

  def __init__(self, config: ml_collections.ConfigDict):
    config_lib.validate(config, num_devices=jax.device_count())
    self.config = config
    self.workdir = pathlib.Path(config.workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self._setup_devices()
    self._setup_model()
    self._setup_data()
    self._setup_rewards()
    self._setup_step()
    r = config.rollout
    self.engine = Engine(
        nnx.merge(self.graphdef, self.state.params), mesh=self.sampler_mesh,
        max_concurrent_decodes=r.max_concurrent_decodes, max_prefill_length=r.max_prefill_length,
        max_decode_length=max(r.max_new_tokens, self.eval_max_new_tokens),
        steps_per_call=r.steps_per_call, seed=config.seed)
    self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    self.staleness = config.async_rollouts.max_staleness if config.async_rollouts.enabled else 0
    self.guards = guards_lib.Guards(config.guards)
    self.data_position = 0
    self.queue: collections.deque[SampledBatch] = collections.deque()

  # ---------------------------------------------------------------------------- set-up

  def _setup_devices(self):
    m = self.config.mesh
    devices = jax.devices()
    if m.num_trainer_devices == 0:
      trainer_devices = sampler_devices = devices
    else:
      trainer_devices, sampler_devices = sharding_lib.split_devices(
          m.num_trainer_devices, devices, field="config.mesh.num_trainer_devices")
    self.trainer_mesh = sharding_lib.make_mesh(tuple(m.trainer), trainer_devices,
                                               field="config.mesh.trainer")
    self.sampler_mesh = sharding_lib.make_mesh(tuple(m.sampler), sampler_devices,
                                               field="config.mesh.sampler")

  def _setup_model(self):
    from reasoning_rl.data.debug_vocab import load_named_tokenizer
    from reasoning_rl.models import load
    from reasoning_rl.models.config import ModelConfig
    from reasoning_rl.models.transformer import create_model

    c = self.config.model
    if c.path:
      if c.tokenizer:
        raise ConfigError("config.model.tokenizer: leave empty when model.path is set (the "
                          "tokenizer comes with the model)")
      model, tokenizer = load(c.path, dtype=c.dtype)
    else:
      tokenizer = load_named_tokenizer(c.tokenizer)
      model_config = ModelConfig(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                 eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                                 **dict(c.random))
      model = create_model(model_config, seed=self.config.seed, dtype=c.dtype, param_dtype=c.dtype)
    self.tokenizer = tokenizer
    self.model_config = model.config
    self.graphdef, self._initial_params = nnx.split(model)
    # workdir/model/: config.json + tokenizer files, so checkpoints load without this config.
    directory = self.workdir / "model"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(self.model_config.to_hf_config(), indent=2))
    self.tokenizer.save(directory)

  def _setup_data(self):
    c = self.config.data
    self.template = templates.PromptTemplate(c.template, self.tokenizer,
                                             instruction=c.instruction,
                                             system_prompt=c.system_prompt)
    eval_source = tasks.build_source(c.eval, field="data.eval")
    self.eval_examples = [eval_source.example(i) for i in range(self.config.eval.num_examples)]
    self.train_source = tasks.build_source(c.train, field="data.train")
    self.held_out = tasks.held_out_prompts(self.eval_examples)
    self.eval_max_new_tokens = (self.config.eval.max_new_tokens
                                or self.config.rollout.max_new_tokens)

  def _setup_rewards(self):
    self.reward_fn = RewardFunction(self.config.rewards)
    if self.config.verifier.redteam:
      from reasoning_rl.verifiers.redteam import enforce_redteam

      enforce_redteam(self.config.rewards, allow_exploits=self.config.verifier.allow_exploits,
                      log=log.warning)
    self.pool = None
    if self.config.verifier.num_workers > 0:
      from reasoning_rl.verifiers.queue import VerifierPool

      self.pool = VerifierPool(GroupScorer(self.reward_fn),
                               num_workers=self.config.verifier.num_workers,
                               item_timeout_s=self.config.verifier.item_timeout_s, fallback=None)

  def _setup_step(self):
    self.step_fn = TrainStep(self.graphdef, step_config(self.config), self.trainer_mesh)
    reference = jax.tree.map(jnp.copy, self._initial_params) if self.config.beta > 0 else None
    self.state = self.step_fn.init_state(self._initial_params, ref_params=reference)
    del self._initial_params

  # ---------------------------------------------------------------------------- sampling

  def _record(self, example, response: str, completion) -> CompletionRecord:
    return CompletionRecord(
        response=response, ground_truth=example.answer, task=example.task,
        num_tokens=len(completion.completion_ids), truncated=completion.truncated,
        max_new_tokens=self.config.rollout.max_new_tokens, prompt=example.prompt,
        tests=list(example.tests), metadata=dict(example.metadata))

  def _zero_rewards(self, count: int) -> list[Reward]:
    parts = {p.name: 0.0 for p in self.reward_fn.parts}
    return [Reward(total=0.0, parts=dict(parts), verifier_version=self.reward_fn.verifier_version)
            for _ in range(count)]

  def sample_groups(self, examples, *, num_samples=None, sampling=None):
    """(data position, example) pairs -> (index, ScoredGroup, responses) per prompt.

    Groups go to the verifier pool as soon as their G completions are done, so verification
    overlaps the rest of the sampling. A group whose verification times out or fails scores 0.
    """
    g = num_samples or self.config.rollout.num_samples
    prompts = [self.template.encode(example) for _, example in examples]
    example_at = dict(examples)
    finished: dict[int, list] = collections.defaultdict(list)
    responses: dict[int, list[str]] = {}
    rewards: dict[int, list[Reward]] = {}
    timeouts = 0
    start = time.perf_counter()
    for completion in stream_groups(
        self.engine, prompts, num_samples=g, sampling=sampling or self.sampling,
        max_new_tokens=self.config.rollout.max_new_tokens, stop_ids=self.tokenizer.eos_ids,
        stop_strings=tuple(self.config.rollout.stop_strings), tokenizer=self.tokenizer,
        seed=self.config.seed, prompt_ids=[index for index, _ in examples]):
      group = finished[completion.prompt_id]
      group.append(completion)
      if len(group) < g:
        continue
      group.sort(key=lambda c: c.sample_index)
      example = example_at[completion.prompt_id]
      texts = [self.tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in group]
      responses[completion.prompt_id] = texts
      records = [self._record(example, t, c) for t, c in zip(texts, group)]
      if self.pool is not None:
        self.pool.submit(completion.prompt_id, records)
      else:
        rewards[completion.prompt_id] = self.reward_fn.score_group(records)
    sample_s = time.perf_counter() - start
    start = time.perf_counter()
    while len(rewards) < len(examples):
      result = self.pool.get()
      if result.status == "ok":
        rewards[result.item_id] = result.value
      else:
        timeouts += 1
        log.warning("verifier %s for prompt %s: %s", result.status, result.item_id, result.error)
        rewards[result.item_id] = self._zero_rewards(g)
    verify_s = time.perf_counter() - start
    out = []
    for index, _ in examples:
      group, scored = finished[index], rewards[index]
      out.append((index, batching.ScoredGroup(
          prompt_tokens=list(group[0].prompt_tokens),
          completion_ids=[list(c.completion_ids) for c in group],
          logprobs=[[float(x) for x in c.logprobs] for c in group],
          rewards=[r.total for r in scored],
          parts={name: [r.parts[name] for r in scored] for name in scored[0].parts},
          truncated=[bool(c.truncated) for c in group]), responses[index]))
    return out, sample_s, verify_s, timeouts

  def _take_examples(self, count: int):
    stream = tasks.PromptStream(self.train_source, position=self.data_position,
                                exclude=self.held_out)
    taken = stream.take(count)
    self.data_position = stream.position
    return taken

  def sample_batch(self) -> SampledBatch:
    """One step's groups; DAPO dynamic sampling (Yu et al. 2025, §3.2) drops groups whose rewards
    are all equal and samples more prompts, up to `dynamic_sampling.max_rounds` rounds."""
    c = self.config
    wanted = c.rollout.num_prompts
    kept, all_groups = [], []
    sample_s = verify_s = 0.0
    timeouts = 0
    rounds = c.dynamic_sampling.max_rounds if c.dynamic_sampling.enabled else 1
    for _ in range(rounds):
      groups, s, v, t = self.sample_groups(self._take_examples(wanted - len(kept)))
      sample_s, verify_s, timeouts = sample_s + s, verify_s + v, timeouts + t
      all_groups.extend(group for _, group, _ in groups)
      kept.extend(item for item in groups
                  if item[1].has_signal or not c.dynamic_sampling.enabled)
      if len(kept) >= wanted:
        break
    return SampledBatch(
        groups=[[index, dataclasses.asdict(group), texts] for index, group, texts in kept],
        outcome=batching.group_outcome_fractions(all_groups), groups_sampled=len(all_groups),
        timeouts=timeouts, verifications=len(all_groups), sample_s=sample_s, verify_s=verify_s,
        policy_version=self.engine.policy_version)

  # ---------------------------------------------------------------------------- checkpoints

  def _checkpoint_tree(self):
    """The train state without the frozen reference (rebuilt identically at start-up)."""
    return self.state.replace(ref_params=None)

  def _meta(self) -> dict:
    return {"data_position": self.data_position, "policy_version": self.engine.policy_version,
            "guards": self.guards.state_dict(),
            "queue": [dataclasses.asdict(b) for b in self.queue]}

  def _restore(self, checkpointer) -> int:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            self._checkpoint_tree())
    restored = checkpointer.restore_latest(abstract)
    if restored is None:
      return 0
    step, tree, meta = restored
    self.state = tree.replace(ref_params=self.state.ref_params)
    self.data_position = meta["data_position"]
    self.guards.load_state_dict(meta["guards"])
    self.queue = collections.deque(SampledBatch(**b) for b in meta["queue"])
    self.engine.update_params(self.state.params)
    self.engine.policy_version = meta["policy_version"]
    return step

  # ---------------------------------------------------------------------------- the loop

  def run(self) -> int:
    c = self.config
    checkpointer = checkpointing.Checkpointer(self.workdir / "checkpoints", keep=c.checkpoint.keep,
                                              async_save=c.checkpoint.async_save)
    checkpointing.install_preemption_handler()
    start_step = self._restore(checkpointer)
    writer = metrics_lib.MetricsWriter(self.workdir, resume_step=start_step or None,
                                       tensorboard=c.logging.tensorboard)
    progress = metrics_lib.ProgressBar(c.total_steps, initial=start_step,
                                       enabled=None if c.logging.progress_bar else False)
    stopped = guards_lib.STOPPED_FILE
    exit_code = guards_lib.DONE_EXIT_CODE
    save = lambda step: checkpointer.save(step, self._checkpoint_tree(), self._meta(),  # noqa
                                          force=True)
    try:
      if start_step == 0:
        (self.workdir / stopped).unlink(missing_ok=True)
        self.evaluate(0)
      if c.stage != "rl":
        self.sft_pairs = self._sft_data()
      while c.stage == "rl" and len(self.queue) < self.staleness:  # batches 1..k, version 0
        self.queue.append(self.sample_batch())
      for step in range(start_step + 1, c.total_steps + 1):
        row = self.train_one_step(step) if c.stage == "rl" else self.sft_step()
        writer.write(step, row)
        if (c.stage == "rl" and c.logging.rollouts_every_steps
            and step % c.logging.rollouts_every_steps == 0):
          writer.write_rollouts(step, self._rollout_records(step))
        progress.update(step, {k: row[k] for k in ("reward/mean", "loss") if k in row})
        trip = self.guards.check_step(step, row)
        if (trip is None and c.eval.every_steps and step % c.eval.every_steps == 0
            and step != c.total_steps):
          trip = self.guards.check_eval(step, self.evaluate(step))
        if trip is not None:
          save(step)
          guards_lib.write_stopped_md(self.workdir, trip)
          log.error("guard %s stopped the run at step %d: %s", trip.guard, step, trip.message)
          exit_code = guards_lib.GUARD_EXIT_CODE
          break
        if step % c.checkpoint.every_steps == 0 or step == c.total_steps:
          save(step)
        if checkpointing.preemption_requested():
          save(step)
          exit_code = guards_lib.PREEMPTED_EXIT_CODE
          break
      else:
        if start_step < c.total_steps:
          self.evaluate(c.total_steps)
      self._print_summary()
    finally:
      checkpointer.wait()
      checkpointer.close()
      writer.close()
      progress.close()
      if self.pool is not None:
        self.pool.close()
    return exit_code

  def train_one_step(self, step: int) -> dict:
    c = self.config
    start = time.perf_counter()
    batch_data = self.queue.popleft() if self.queue else self.sample_batch()
    groups = batch_data.scored()
    batch, advantages = batching.build_batch(
        [g for _, g, _ in groups], num_groups=c.rollout.num_prompts,
        group_size=c.rollout.num_samples, prompt_length=c.rollout.max_prefill_length,
        completion_length=c.rollout.max_new_tokens, pad_id=self.tokenizer.pad_id,
        estimator=c.algo.estimator, with_behavior_logprobs=self.staleness > 0)
    if c.algo.name != "ppo":
      del batch["rewards"]
    train_start = time.perf_counter()
    self.state, stats = self.step_fn(self.state, jax.tree.map(jnp.asarray, batch))
    ahead_s = 0.0
    if self.staleness > 0:  # sample batch step + k with version step − 1 while the step runs
      ahead = time.perf_counter()
      self.queue.append(self.sample_batch())
      ahead_s = time.perf_counter() - ahead
    stats = stats_lib.finalize(jax.device_get(stats))
    train_s = time.perf_counter() - train_start - ahead_s
    sync_start = time.perf_counter()
    self.engine.update_params(self.state.params)
    sync_s = time.perf_counter() - sync_start
    self._last = (batch_data, groups, advantages)
    row = self._metrics_row(batch_data, groups, stats, batch)
    step_s = time.perf_counter() - start
    sampled_now = 0.0 if self.staleness else batch_data.sample_s + batch_data.verify_s
    row.update({
        "time/sample_s": batch_data.sample_s, "time/verify_s": batch_data.verify_s,
        "time/train_s": train_s, "time/sync_s": sync_s, "time/sample_ahead_s": ahead_s,
        "time/step_s": step_s,
        # host time attributed to nothing above (batching, metrics): neither slice works
        "time/idle_s": max(0.0, step_s - sampled_now - train_s - sync_s - ahead_s),
    })
    row.update(self._throughput(batch_data, groups, batch, step_s))
    return row

  def _throughput(self, batch_data, groups, batch, step_s) -> dict:
    """Tokens/s and an RL-aware MFU counting generation FLOPs as well as training FLOPs."""
    n = self.model_config.num_params()
    generated = sum(len(ids) for _, g, _ in groups for ids in g.completion_ids)
    prompts = sum(len(g.prompt_tokens) for _, g, _ in groups)
    trained = int(np.asarray(batch["attention_mask"]).sum())
    forward_passes = 3 + (1 if self.config.beta > 0 else 0)  # fwd + bwd (2x) + reference
    flops = 2 * n * (generated + prompts) + 2 * n * forward_passes * trained
    peak = self.config.logging.peak_flops_per_device * jax.device_count()
    seconds = step_s + batch_data.sample_s + batch_data.verify_s if self.staleness == 0 else step_s
    return {"throughput/generated_tokens_per_s": generated / max(batch_data.sample_s, 1e-9),
            "throughput/trained_tokens_per_s": trained / max(seconds, 1e-9),
            "throughput/rl_mfu": flops / max(seconds, 1e-9) / peak}

  def _metrics_row(self, batch_data: SampledBatch, groups, stats, batch) -> dict:
    scored = [g for _, g, _ in groups]
    rewards = np.array([r for g in scored for r in g.rewards] or [0.0])
    lengths = np.array([len(ids) for g in scored for ids in g.completion_ids] or [0])
    truncated = np.array([t for g in scored for t in g.truncated] or [False])
    row = {
        "loss": stats["loss"], "kl": stats.get("kl", float("nan")),
        "entropy": stats["entropy"], "clip_frac": stats["clip_frac"],
        "skipped_update": stats["skipped_update"],
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": int(lengths.max()),
        "response_length/truncated_frac": float(truncated.mean()),
        "verifier/timeouts": batch_data.timeouts,
        "verifier/timeout_rate": batch_data.timeouts / max(batch_data.verifications, 1),
        "dynamic_sampling/groups_sampled": batch_data.groups_sampled,
        "dynamic_sampling/groups_kept": len(scored),
        "policy_version": self.engine.policy_version,
        "policy_lag": self.engine.policy_version - 1 - batch_data.policy_version,
        "data_position": self.data_position,
    }
    for name in self.reward_fn.parts:
      values = [v for g in scored for v in g.parts[name.name]]
      row[f"reward/{name.name}"] = float(np.mean(values)) if values else 0.0
    row.update(batch_data.outcome)
    for key, value in stats.items():
      if key not in ("loss", "kl", "entropy", "clip_frac", "skipped_update"):
        row[f"train/{key}"] = value
    if self.pool is not None:
      for key, value in self.pool.metrics().items():
        row[f"verifier/pool/{key}"] = value
    return row

  def _rollout_records(self, step: int) -> list[dict]:
    c = self.config
    batch_data, groups, advantages = self._last
    out = []
    for g, (index, group, responses) in enumerate(groups):
      example = self.train_source.example(index)
      for s in range(group.size):
        row = {
            "step": step, "prompt_id": index, "group_id": g, "sample_index": s,
            "prompt": self.tokenizer.decode(group.prompt_tokens), "completion": responses[s],
            "reward": group.rewards[s], "advantage": float(advantages[g, s]),
            "num_tokens": len(group.completion_ids[s]), "truncated": group.truncated[s],
            "policy_version": batch_data.policy_version,
            "verifier_version": self.reward_fn.verifier_version,
            "sampling": {"temperature": c.rollout.temperature, "top_p": c.rollout.top_p,
                         "top_k": c.rollout.top_k, "max_new_tokens": c.rollout.max_new_tokens,
                         "seed": c.seed},
            "ground_truth": example.answer, "task": example.task,
            "metadata": dict(example.metadata), "tests": list(example.tests),
        }
        for name, values in group.parts.items():
          row[f"reward/{name}"] = values[s]
        out.append(row)
    return out

  def _print_summary(self):
    """One line per held-out evaluation of the run, on stdout."""
    results = evaluation.read_eval_results(self.workdir)
    if results:
      trail = " -> ".join(f"{r['accuracy']:.1%} (step {r['step']})" for r in results)
      print(f"held-out accuracy on {results[-1]['num_examples']} examples: {trail}", flush=True)

  # ---------------------------------------------------------------------------- evaluation

  def evaluate(self, step: int) -> dict:
    """Greedy pass@1 on the held-out examples (+ canaries); eval/step_XXXXXXXX.json."""
    start = time.perf_counter()
    result = evaluation.run_evaluation(
        self.engine, self.tokenizer, self.template, self.eval_examples, self.reward_fn,
        num_samples=self.config.eval.num_samples, temperature=self.config.eval.temperature,
        max_new_tokens=self.eval_max_new_tokens,
        stop_strings=tuple(self.config.rollout.stop_strings), seed=self.config.seed,
        canaries=tuple(self.config.eval.canaries))
    result["time/eval_s"] = time.perf_counter() - start
    evaluation.write_eval_result(self.workdir, step, result)
    log.info("held-out accuracy at step %d: %.3f", step, result["accuracy"])
    return result
