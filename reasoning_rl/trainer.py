"""The RL loop: prompts → sampler slice → verifiers → advantages → fused step → weight sync.

One `Trainer` owns the side effects of a run (devices, files, worker processes); the numerical work
is done by pure pieces: `reasoning_rl.rl.step.TrainStep`, `reasoning_rl.rl.batching`,
`reasoning_rl.sampler`. A run is a function of (config, seed): the data position is an integer, each
completion's random stream derives from (seed, data position of its prompt, sample index), and the
whole loop state is checkpointed, so a restart on the same workdir continues bit for bit.

Exit codes of `Trainer.run()`: 0 finished, 3 a guard stopped the run (STOPPED.md says why), 143
preempted by SIGTERM after saving a checkpoint.
"""

from __future__ import annotations

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
from reasoning_rl import metrics as metrics_lib
from reasoning_rl import sharding as sharding_lib
from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import batching
from reasoning_rl.rl import stats as stats_lib
from reasoning_rl.rl.step import StepConfig, TrainStep
from reasoning_rl.sampler import Engine, SamplingParams, stream_groups
from reasoning_rl.verifiers.rewards import CompletionRecord, RewardFunction

log = logging.getLogger("reasoning_rl")

EXIT_OK = 0
EXIT_GUARD = 3
EXIT_PREEMPTED = checkpointing.PREEMPTED_EXIT_CODE


class GroupScorer:
  """Picklable verifier-pool job: one prompt's records -> their rewards (group-level parts OK)."""

  def __init__(self, reward_fn: RewardFunction):
    self.reward_fn = reward_fn

  def __call__(self, records):
    return self.reward_fn.score_group(records)


@dataclasses.dataclass
class LoopState:
  """Host-side state checkpointed beside the arrays (JSON)."""

  data_position: int = 0
  policy_version: int = 0
  guards: dict | None = None


def step_config(config: ml_collections.ConfigDict) -> StepConfig:
  a, o = config.algo, config.optim
  return StepConfig(
      algorithm="ppo" if a.name == "ppo" else "grpo", beta=config.beta,
      kl_estimator=a.kl_estimator, epsilon_low=a.epsilon_low, epsilon_high=a.epsilon_high,
      dual_clip=a.dual_clip, loss_agg=a.loss_agg, entropy_coef=a.entropy_coef,
      tis_cap=a.tis_cap, max_completion_length=config.rollout.max_new_tokens,
      num_micro_batches=a.num_micro_batches, num_inner_updates=a.num_inner_updates,
      logprob_chunk=a.logprob_chunk, learning_rate=o.learning_rate, warmup_steps=o.warmup_steps,
      total_steps=config.total_steps, final_lr_fraction=o.final_lr_fraction,
      weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm)


class Trainer:
  """Builds everything a run needs from its config, then `run()` trains."""

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
    self.engine = Engine(
        nnx.merge(self.graphdef, self.state.params), mesh=self.sampler_mesh,
        max_concurrent_decodes=config.rollout.max_concurrent_decodes,
        max_prefill_length=config.rollout.max_prefill_length,
        max_decode_length=max(config.rollout.max_new_tokens, self._eval_max_new_tokens),
        steps_per_call=config.rollout.steps_per_call, seed=config.seed)
    self.sampling = SamplingParams(temperature=config.rollout.temperature,
                                   top_p=config.rollout.top_p, top_k=config.rollout.top_k)

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
    from reasoning_rl.models import load
    from reasoning_rl.models.config import ModelConfig
    from reasoning_rl.models.transformer import create_model

    c = self.config.model
    if c.path:
      model, tokenizer = load(c.path, dtype=c.dtype)
      if c.tokenizer:
        raise ConfigError("config.model.tokenizer: leave empty when model.path is set (the "
                          "tokenizer comes with the model)")
    else:
      from reasoning_rl.data.debug_vocab import load_named_tokenizer

      tokenizer = load_named_tokenizer(c.tokenizer)
      random = dict(c.random)
      model_config = ModelConfig(vocab_size=tokenizer.vocab_size,
                                 bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                                 pad_token_id=tokenizer.pad_id, **random)
      # The init key is folded from the run seed, so the random model is part of the run.
      model = create_model(model_config, seed=self.config.seed, dtype=c.dtype,
                           param_dtype=c.dtype)
    self.tokenizer = tokenizer
    self.model_config = model.config
    self.graphdef, params = nnx.split(model)
    self._initial_params = params
    self._write_model_card()

  def _write_model_card(self):
    """workdir/model/: config.json + tokenizer files, so checkpoints load without the config."""
    directory = self.workdir / "model"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(self.model_config.to_hf_config(), indent=2))
    self.tokenizer.save(directory)

  def _setup_data(self):
    from reasoning_rl.data import tasks, templates

    c = self.config.data
    self.template = templates.PromptTemplate(c.template, self.tokenizer,
                                             instruction=c.instruction,
                                             system_prompt=c.system_prompt)
    eval_source = tasks.build_source(c.eval, field="data.eval")
    self.eval_examples = [eval_source.example(i) for i in range(self.config.eval.num_examples)]
    self.train_source = tasks.build_source(c.train, field="data.train")
    self._exclude = {e.prompt for e in self.eval_examples}
    self._eval_max_new_tokens = self.config.eval.max_new_tokens or self.config.rollout.max_new_tokens

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
    reference = None
    if self.config.beta > 0:
      reference = jax.tree.map(jnp.copy, self._initial_params)
    self.state = self.step_fn.init_state(self._initial_params, ref_params=reference)
    del self._initial_params
    self.loop = LoopState()

  # ---------------------------------------------------------------------------- sampling

  def sample_groups(self, examples, *, sampling, max_new_tokens, num_samples, seed):
    """(index, example) pairs -> ScoredGroup per prompt (sampling and verification overlap)."""
    prompts = [self.template.encode(example) for _, example in examples]
    ids = [index for index, _ in examples]
    by_prompt: dict[int, list] = {i: [] for i in ids}
    records_by_prompt: dict[int, list] = {}
    scored: dict[int, list] = {}
    timings = {"sample": 0.0, "verify": 0.0}
    start = time.perf_counter()
    example_of = dict(examples)
    for completion in stream_groups(
        self.engine, prompts, num_samples=num_samples, sampling=sampling,
        max_new_tokens=max_new_tokens, stop_ids=self.tokenizer.eos_ids,
        stop_strings=tuple(self.config.rollout.stop_strings), tokenizer=self.tokenizer,
        seed=seed, prompt_ids=ids):
      by_prompt[completion.prompt_id].append(completion)
      if len(by_prompt[completion.prompt_id]) == num_samples:
        group = sorted(by_prompt[completion.prompt_id], key=lambda c: c.sample_index)
        records = [self._record(example_of[completion.prompt_id], c, max_new_tokens)
                   for c in group]
        records_by_prompt[completion.prompt_id] = records
        if self.pool is not None:
          self.pool.submit(completion.prompt_id, records)
        else:
          scored[completion.prompt_id] = self.reward_fn.score_group(records)
    timings["sample"] = time.perf_counter() - start
    timeouts = 0
    if self.pool is not None:
      wait = time.perf_counter()
      while len(scored) < len(ids):
        result = self.pool.get()
        if result.status != "ok":
          timeouts += 1
          zero = {p.name: 0.0 for p in self.reward_fn.parts}
          from reasoning_rl.verifiers.rewards import Reward

          scored[result.item_id] = [Reward(total=0.0, parts=dict(zero),
                                           verifier_version=self.reward_fn.verifier_version)
                                    for _ in range(num_samples)]
        else:
          scored[result.item_id] = result.value
      timings["verify"] = time.perf_counter() - wait
    groups = []
    for index in ids:
      completions = sorted(by_prompt[index], key=lambda c: c.sample_index)
      rewards = scored[index]
      groups.append(batching.ScoredGroup(
          prompt_tokens=list(completions[0].prompt_tokens),
          completion_ids=[list(c.completion_ids) for c in completions],
          logprobs=[list(c.logprobs) for c in completions],
          rewards=[r.total for r in rewards],
          parts={name: [r.parts[name] for r in rewards] for name in rewards[0].parts},
          truncated=[c.truncated for c in completions]))
    return groups, records_by_prompt, timings, timeouts

  def _record(self, example, completion, max_new_tokens) -> CompletionRecord:
    return CompletionRecord(
        response=self.tokenizer.decode(completion.completion_ids, skip_special_tokens=True),
        ground_truth=example.answer, task=example.task,
        num_tokens=len(completion.completion_ids), truncated=completion.truncated,
        max_new_tokens=max_new_tokens, prompt=example.prompt, tests=list(example.tests),
        metadata=dict(example.metadata))

  def _take_examples(self, count: int):
    """The next `count` training examples (skipping held-out prompts); advances the position."""
    taken = []
    while len(taken) < count:
      index = self.loop.data_position
      self.loop.data_position += 1
      example = self.train_source.example(index)
      if example.prompt not in self._exclude:
        taken.append((index, example))
    return taken

  def collect_batch(self):
    """One step's groups, with DAPO dynamic sampling when enabled (Yu et al. 2025, §3.2)."""
    c = self.config
    wanted = c.rollout.num_prompts
    kept, sampled = [], []
    records = {}
    timings = {"sample": 0.0, "verify": 0.0}
    timeouts = 0
    rounds = c.dynamic_sampling.max_rounds if c.dynamic_sampling.enabled else 1
    for _ in range(rounds):
      examples = self._take_examples(wanted - len(kept))
      groups, group_records, t, n = self.sample_groups(
          examples, sampling=self.sampling, max_new_tokens=c.rollout.max_new_tokens,
          num_samples=c.rollout.num_samples, seed=c.seed)
      timings = {k: timings[k] + t[k] for k in timings}
      timeouts += n
      sampled.extend(groups)
      for (index, example), group in zip(examples, groups):
        if group.has_signal or not c.dynamic_sampling.enabled:
          kept.append((index, example, group))
          records[index] = group_records[index]
      if len(kept) >= wanted:
        break
    return kept, sampled, records, timings, timeouts

  # ---------------------------------------------------------------------------- the loop

  def _abstract_state(self):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        self.state)

  def _checkpoint_tree(self):
    """What the checkpoint holds: the train state without the frozen reference (rebuilt from
    the model source at start-up, identical bit for bit)."""
    return self.state.replace(ref_params=None)

  def restore(self, checkpointer) -> int:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            self._checkpoint_tree())
    restored = checkpointer.restore_latest(abstract)
    if restored is None:
      return 0
    step, tree, meta = restored
    self.state = tree.replace(ref_params=self.state.ref_params)
    self.loop = LoopState(**meta["loop"])
    self.engine.update_params(self.state.params)
    self.engine.policy_version = self.loop.policy_version
    return step

  def run(self) -> int:
    c = self.config
    checkpointer = checkpointing.Checkpointer(self.workdir / "checkpoints", keep=c.checkpoint.keep,
                                              async_save=c.checkpoint.async_save)
    checkpointing.install_preemption_handler()
    start_step = self.restore(checkpointer)
    writer = metrics_lib.MetricsWriter(self.workdir, resume_step=start_step or None,
                                       tensorboard=c.logging.tensorboard)
    progress = metrics_lib.ProgressBar(c.total_steps, initial=start_step,
                                       enabled=None if c.logging.progress_bar else False)
    exit_code = EXIT_OK
    try:
      if start_step == 0:
        self.evaluate(0)
      for step in range(start_step + 1, c.total_steps + 1):
        row = self.train_one_step(step, writer)
        progress.update(step, {k: row[k] for k in ("reward/mean", "loss") if k in row})
        if step % c.checkpoint.every_steps == 0 or step == c.total_steps:
          checkpointer.save(step, self._checkpoint_tree(), {"loop": dataclasses.asdict(self.loop)},
                            force=True)
        if c.eval.every_steps and step % c.eval.every_steps == 0 and step != c.total_steps:
          self.evaluate(step)
        if checkpointing.preemption_requested():
          checkpointer.save(step, self._checkpoint_tree(), {"loop": dataclasses.asdict(self.loop)},
                            force=True)
          exit_code = EXIT_PREEMPTED
          break
      else:
        self.evaluate(c.total_steps)
    finally:
      checkpointer.wait()
      checkpointer.close()
      writer.close()
      progress.close()
      if self.pool is not None:
        self.pool.close()
    return exit_code

  def train_one_step(self, step: int, writer) -> dict:
    c = self.config
    start = time.perf_counter()
    kept, sampled, records, timings, timeouts = self.collect_batch()
    batch, advantages = batching.build_batch(
        [g for _, _, g in kept], num_groups=c.rollout.num_prompts,
        group_size=c.rollout.num_samples, prompt_length=c.rollout.max_prefill_length,
        completion_length=c.rollout.max_new_tokens, pad_id=self.tokenizer.pad_id,
        estimator=c.algo.estimator)
    if c.algo.name != "ppo":
      del batch["rewards"]
    train_start = time.perf_counter()
    self.state, stats = self.step_fn(self.state, jax.tree.map(jnp.asarray, batch))
    stats = stats_lib.finalize(jax.device_get(stats))
    train_seconds = time.perf_counter() - train_start
    sync_start = time.perf_counter()
    self.engine.update_params(self.state.params)
    self.loop.policy_version += 1
    sync_seconds = time.perf_counter() - sync_start

    row = self._metrics_row(kept, sampled, stats, timeouts)
    row.update({"time/sample_s": timings["sample"], "time/verify_s": timings["verify"],
                "time/train_s": train_seconds, "time/sync_s": sync_seconds,
                "time/step_s": time.perf_counter() - start})
    writer.write(step, row)
    if c.logging.rollouts_every_steps and step % c.logging.rollouts_every_steps == 0:
      writer.write_rollouts(step, self._rollout_records(step, kept, advantages, records))
    return row

  def _metrics_row(self, kept, sampled, stats, timeouts) -> dict:
    groups = [g for _, _, g in kept]
    rewards = np.array([r for g in groups for r in g.rewards] or [0.0])
    lengths = np.array([len(ids) for g in groups for ids in g.completion_ids] or [0])
    truncated = np.array([t for g in groups for t in g.truncated] or [False])
    row = {
        "loss": stats["loss"],
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "kl": stats.get("kl", float("nan")),
        "entropy": stats["entropy"],
        "clip_frac": stats["clip_frac"],
        "response_length/mean": float(lengths.mean()),
        "response_length/max": int(lengths.max()),
        "response_length/truncated_frac": float(truncated.mean()),
        "verifier/timeouts": timeouts,
        "dynamic_sampling/groups_sampled": len(sampled),
        "dynamic_sampling/groups_kept": len(groups),
        "policy_version": self.loop.policy_version,
        "data_position": self.loop.data_position,
    }
    for name in (groups[0].parts if groups else {}):
      row[f"reward/{name}"] = float(np.mean([v for g in groups for v in g.parts[name]]))
    row.update(batching.group_outcome_fractions(sampled))
    for key, value in stats.items():
      if key not in ("loss", "kl", "entropy", "clip_frac"):
        row[f"train/{key}"] = value
    return row

  def _rollout_records(self, step, kept, advantages, records):
    c = self.config
    out = []
    for g, (index, example, group) in enumerate(kept):
      for s in range(group.size):
        record = records[index][s]
        row = {
            "step": step, "prompt_id": index, "group_id": g, "sample_index": s,
            "prompt": self.tokenizer.decode(group.prompt_tokens),
            "completion": record.response, "reward": group.rewards[s],
            "advantage": float(advantages[g, s]), "num_tokens": record.num_tokens,
            "truncated": group.truncated[s], "policy_version": self.loop.policy_version - 1,
            "verifier_version": self.reward_fn.verifier_version,
            "sampling": {"temperature": c.rollout.temperature, "top_p": c.rollout.top_p,
                         "max_new_tokens": c.rollout.max_new_tokens, "seed": c.seed,
                         "top_k": c.rollout.top_k},
            "ground_truth": example.answer, "task": example.task,
            "metadata": dict(example.metadata),
        }
        for name, values in group.parts.items():
          row[f"reward/{name}"] = values[s]
        out.append(row)
    return out

  # ---------------------------------------------------------------------------- evaluation

  def evaluate(self, step: int) -> dict:
    """Greedy pass@1 on the held-out examples; written to workdir/eval/step_XXXXXXXX.json."""
    start = time.perf_counter()
    examples = [(1_000_000_000 + i, e) for i, e in enumerate(self.eval_examples)]
    groups, records, _, _ = self.sample_groups(
        examples, sampling=SamplingParams(temperature=0.0),
        max_new_tokens=self._eval_max_new_tokens, num_samples=1, seed=self.config.seed)
    correct = [g.parts.get("correct", g.rewards)[0] for g in groups]
    result = {
        "step": step,
        "num_examples": len(groups),
        "accuracy": float(np.mean([c >= 1.0 for c in correct])),
        "reward/mean": float(np.mean([g.rewards[0] for g in groups])),
        "response_length/mean": float(np.mean([len(g.completion_ids[0]) for g in groups])),
        "samples": [{"prompt": e.prompt, "answer": e.answer,
                     "completion": records[i][0].response, "reward": g.rewards[0]}
                    for (i, e), g in list(zip(examples, groups))[:8]],
        "time/eval_s": time.perf_counter() - start,
    }
    directory = self.workdir / "eval"
    directory.mkdir(exist_ok=True)
    path = directory / f"step_{step:08d}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)
    log.info("held-out accuracy at step %d: %.3f", step, result["accuracy"])
    return result
