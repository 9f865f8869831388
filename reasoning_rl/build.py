"""The one place a config becomes objects: meshes, policy, data, rewards, scorer, engine, step.

Every launcher (train, evaluate, generate, replay, redteam) builds what it needs through these
functions, so a config field means the same thing everywhere. Building has no side effects on the
workdir: writing files is the loop's job (`reasoning_rl.trainer`), so a run whose set-up fails
leaves nothing behind.

`build(config)` returns a `Run`: everything a training run needs, with the policy already split
into `graphdef` and the initial train state placed on the trainer mesh.

It imports the whole training stack at the top: the launchers import it only once they build,
and nothing JAX-free (`--help`, config validation, the dry run) reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from reasoning_rl import config as config_lib
from reasoning_rl.agents import entry as agent_entry
from reasoning_rl.agents.collector import AgentCollector, AgentSettings
from reasoning_rl import (config_schema, environments, lora, memory_plan, precision, sharding,
                          step_layout, storage)
from reasoning_rl.data import tasks, templates
from reasoning_rl.environments.redteam import run_python_tool_redteam
from reasoning_rl.errors import ConfigError, SamplingError, VerifierError
from reasoning_rl.lora import LoraSettings
from reasoning_rl.loop import weight_sync as weight_sync_lib
from reasoning_rl.loop.partial_rollouts import (PartialCollector, PartialSettings,
                                                check_partial_rollouts)
from reasoning_rl.loop.rl_stage import RLStage
from reasoning_rl.loop.rollouts import RolloutCollector, ShardedCollector
from reasoning_rl.loop.sft_stage import SFTStage
from reasoning_rl.models.transformer import create_model, stack_layers
from reasoning_rl.models.upcycle import upcycle
from reasoning_rl.multihost.cluster import Cluster, local_cluster
from reasoning_rl.multihost.exchange import Exchange
from reasoning_rl.multihost.param_sync import ParamSync
from reasoning_rl.multihost.topology import check_sync_shapes, make_topology
from reasoning_rl.reward_redteam import enforce_redteam
from reasoning_rl.rl.distillation import DistillationSettings
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.teacher import Teacher, check_same_vocabulary
from reasoning_rl.run_checkpoint import load_model
from reasoning_rl.sampler import (BackendSpec, EngineSpec, EpisodeSettings, SamplingParams,
                                  make_backend, make_engine)
from reasoning_rl.sampler.api import RolloutBackend
from reasoning_rl.sampler.engine import prefill_bucket
from reasoning_rl.sampler.quantized import WeightQuantizer
from reasoning_rl.verifiers.rewards import RewardFunction
from reasoning_rl.workers.model_parts import with_model_parts
from reasoning_rl.workers.scorer import make_scorer
# re-exported: callers have always found these here
from reasoning_rl.run_settings import (partial_rollouts, random_model_config,  # noqa: F401
                                       rollout_staleness, rollouts_ahead, sampler_correction,
                                       step_config)

log = logging.getLogger("reasoning_rl")


# ----------------------------------------------------------------------------------- pieces


def build_topology(config: ml_collections.ConfigDict):
  """Which devices train and which sample, and this process's role (`multihost.topology`)."""
  topology = make_topology(config.mesh.num_trainer_devices, jax.devices(),
                           process_index=jax.process_index(), num_processes=jax.process_count(),
                           num_slices=config.mesh.num_slices)
  if topology.multi_process:
    check_sync_shapes(topology)
  return topology


def build_meshes(config: ml_collections.ConfigDict, topology=None):
  """(trainer mesh, mesh of this process's sampler replica). `mesh.num_trainer_devices` = 0 shares
  every device; the sampler mesh is None on a process that only trains."""

  topology = topology or build_topology(config)
  local = topology.local_replica_devices
  return (sharding.make_mesh(tuple(config.mesh.trainer), topology.trainer_devices,
                             field="config.mesh.trainer", num_slices=topology.trainer_num_slices),
          None if local is None else sharding.make_mesh(tuple(config.mesh.sampler), local,
                                                        field="config.mesh.sampler"))


def build_cluster(config: ml_collections.ConfigDict, topology, params):
  """The loop's view of the other processes (`multihost.cluster.Cluster`); `params` (what the
  samplers receive: `loop.weight_sync.abstract_payload`) gives the weight sync its shapes, dtypes
  and partition rules."""

  if not topology.multi_process:
    return local_cluster(topology)

  replica_meshes = [sharding.make_mesh(tuple(config.mesh.sampler), devices,
                                       field="config.mesh.sampler")
                    for devices in topology.replicas]
  return Cluster(topology=topology, exchange=Exchange(),
                 param_sync=ParamSync(params, topology, replica_meshes))


# Training prompts a sparse upcycling's routers are centred on (`models.upcycle`).
UPCYCLE_CALIBRATION_PROMPTS = 16


def build_policy(config: ml_collections.ConfigDict, *, calibration=None):
  """(model, tokenizer): loaded from `model.path`, or random from `model.random` + a named vocab.
  The model computes in `model.dtype`; its parameters are the trainer's master weights, in
  `model.weight_dtype`, except with LoRA, whose frozen base is never updated and so is held in
  the compute dtype (the adapters are float32). `calibration(tokenizer) -> token rows`: what an
  upcycled model's routers are centred on (`model.upcycle`); without it they are not."""

  c = config.model
  weight_dtype = c.dtype if config.lora.rank > 0 else c.weight_dtype
  if c.path:
    if c.tokenizer:
      raise ConfigError("config.model.tokenizer: leave empty when model.path is set (the "
                        "tokenizer comes with the model)")
    model, tokenizer = load_model(c.path, dtype=c.dtype, weight_dtype=weight_dtype)
  else:
    model_config, tokenizer = random_model_config(config)
    model = create_model(model_config, seed=config.seed, dtype=c.dtype, param_dtype=weight_dtype)
  if c.upcycle.num_experts:  # a run's own checkpoints then restore the upcycled weights

    model = upcycle(model, num_experts=c.upcycle.num_experts,
                    experts_per_token=c.upcycle.experts_per_token, seed=config.seed,
                    calibration=calibration(tokenizer) if calibration else ())
  if c.scan_layers:  # loaded in the files' layout; lora.apply_lora keeps it
    model = stack_layers(model)
  return model.use_attention_kernel(c.attention_kernel), tokenizer


def build_template(config: ml_collections.ConfigDict, tokenizer, *, instruction: str | None = None):
  """The prompt template of `data.*`; `instruction` replaces `data.instruction` (eval variants)."""

  c = config.data
  return templates.PromptTemplate(c.template, tokenizer,
                                  instruction=c.instruction if instruction is None else instruction,
                                  system_prompt=c.system_prompt)


@dataclasses.dataclass(frozen=True)
class Data:
  """Prompt sources: the training stream and the fixed held-out examples (never trained on)."""

  train_source: Any
  eval_examples: list
  held_out: Any  # prompts excluded from the training stream


def build_eval_examples(config: ml_collections.ConfigDict) -> list:

  source = tasks.build_source(config.data.eval, field="data.eval")
  return [source.example(i) for i in range(config.eval.num_examples)]


def build_data(config: ml_collections.ConfigDict) -> Data:

  eval_examples = build_eval_examples(config)
  # an agent run's training data may be its agent's own tasks (data.train.kind='agent')
  provided = ({"agent_examples": functools.partial(agent_entry.agent_examples, config)}
              if config.agent.entry else {})
  return Data(train_source=tasks.build_source(config.data.train, field="data.train",
                                              provided=provided),
              eval_examples=eval_examples, held_out=tasks.held_out_prompts(eval_examples))


def build_reward_fn(config: ml_collections.ConfigDict, *, redteam: bool | None = None):
  """The configured reward. With `verifier.redteam` (or `redteam=True`) it must first survive the
  known exploits (`reasoning_rl.reward_redteam`); `verifier.allow_exploits` overrides that."""

  reward_fn = RewardFunction(config.rewards)
  if config.verifier.redteam if redteam is None else redteam:

    enforce_redteam(config.rewards, allow_exploits=config.verifier.allow_exploits,
                    log=log.warning)
  return reward_fn


def build_scorer(config: ml_collections.ConfigDict, reward_fn, *, inline: bool = False,
                 mesh=None, model_parts: bool = True):
  """Inline (`verifier.num_workers` = 0, or `inline`) or pool scorer; both report ok / timeout /
  error. A reward with model-scored parts (e.g. `judge`) gets them from a
  `workers.model_parts.ModelPartsScorer` around it, their models loaded now onto `mesh` (the
  sampler's devices: colocated); `model_parts=False` leaves them out (a process that scores
  nothing)."""

  scorer = make_scorer(reward_fn, num_workers=0 if inline else config.verifier.num_workers,
                       item_timeout_s=config.verifier.item_timeout_s)
  return with_model_parts(scorer, mesh=mesh) if model_parts else scorer


def eval_max_new_tokens(config: ml_collections.ConfigDict) -> int:
  return config.eval.max_new_tokens or config.rollout.max_new_tokens


def build_engine(config: ml_collections.ConfigDict, model, *, mesh=None,
                 max_decode_length: int | None = None):
  """The sampler engine for `model` with the config's slot, prefill and chunk sizes and KV
  cache (paged with `rollout.kv_page_size`), as the `engine` backend builds it."""

  return make_engine(model, EngineSpec.of_rollouts(
      config.rollout, max_decode_length=max_decode_length or rollout_decode_length(config),
      seed=config.seed), mesh=mesh)


def rollout_decode_length(config: ml_collections.ConfigDict) -> int:
  """The longest completion the run's sampler decodes: a rollout's or a held-out evaluation's."""
  return max(config.rollout.max_new_tokens, eval_max_new_tokens(config))


def build_sampler_quantizer(config: ml_collections.ConfigDict, model, graphdef, params,
                            step_settings) -> WeightQuantizer | None:
  """The quantizer of the sampler's weights (`rollout.weight_quantization`), or None: over the
  plain model the sampler decodes (LoRA 'merged': the model without adapters) in the compute
  dtype. ConfigError naming the field for a model it cannot quantize (`quantized.check_model`)."""
  quantization = config.rollout.weight_quantization
  if quantization == "none":
    return None
  plain = graphdef
  if weight_sync_lib.mode_of(step_settings) != "full":
    plain = lora.plain_graphdef(model.config, dtype=model.dtype, param_dtype=model.param_dtype,
                                scan_layers=model.scan_layers)
  return WeightQuantizer(plain, weight_sync_lib.abstract_payload(step_settings, params),
                         quantization)


def build_backend(config: ml_collections.ConfigDict, model, *, mesh=None,
                  max_decode_length: int | None = None):
  """This process's rollout backend (`sampler.api.RolloutBackend`): the one registered as
  `rollout.backend`, sized as `build_engine` sizes one."""

  r = config.rollout
  # agent rollouts prefill each turn's whole conversation: the first prompt and what followed
  conversation = r.max_new_tokens if config.agent.entry else 0
  return make_backend(r.backend, BackendSpec(
      model=model, mesh=mesh, max_concurrent_decodes=r.max_concurrent_decodes,
      max_prefill_length=r.max_prefill_length + conversation,
      max_decode_length=max_decode_length or rollout_decode_length(config),
      steps_per_call=r.steps_per_call, seed=config.seed, config=config))


def load_checkpoint(checkpoint: str, *, dtype: str, mesh=None):
  """(model, tokenizer) of `checkpoint` (run workdir, checkpoint step, HF dir or GGUF; local or
  gs://) for launchers driven by a path rather than a config; a checkpoint without tokenizer files
  is refused, since prompts and completions are text."""

  model, tokenizer = load_model(checkpoint, dtype=dtype, mesh=mesh)
  if tokenizer is None:
    raise SamplingError(f"--checkpoint {checkpoint}: has no tokenizer files")
  return model, tokenizer


# Cache entries up to which a sized engine attends over the whole cache (`build_sized_engine`).
SHORT_CACHE = 512


def build_sized_engine(model, *, longest_prompt: int, max_new_tokens: int, num_sequences: int,
                       max_concurrent_decodes: int, steps_per_call: int, mesh=None):
  """An engine sized for a known set of prompts (launch/generate.py): no more decode slots than
  `num_sequences` (prompts of one batch x samples), a prefill bucket for the longest prompt, and
  decode room for exactly `max_new_tokens`."""

  limit = model.config.max_position_embeddings - max_new_tokens
  prefill_length = prefill_bucket(longest_prompt, max_prefill_length=limit)
  return make_engine(model, EngineSpec(
      max_concurrent_decodes=max(1, min(max_concurrent_decodes, num_sequences)),
      max_prefill_length=prefill_length, max_decode_length=max_new_tokens,
      steps_per_call=min(steps_per_call, max_new_tokens),
      # Each live-length bucket is one more compile of the decode loop (~4 s for SmolLM2 on 2
      # cores) for attention that is a few % of a step over a short cache: worth it only for
      # long ones (benchmarks/RESULTS.md, "launch/generate.py").
      live_length_attention=prefill_length + max_new_tokens > SHORT_CACHE), mesh=mesh)


def build_teacher(config: ml_collections.ConfigDict, student_tokenizer, *, mesh=None):
  """On-policy distillation's teacher (`teacher.path`: HF directory, GGUF or run workdir) in the
  compute dtype, placed on `mesh` (the sampler's devices, where the reward models sit too), after
  checking it has the student's vocabulary; None without `teacher.path`."""
  settings = DistillationSettings.from_config(config)
  if not settings.enabled:
    return None
  if not storage.path(settings.path).exists():
    raise ConfigError(f"config.teacher.path={settings.path!r}: no such file or directory; give "
                      "the teacher's Hugging Face directory, .gguf file or training run workdir")
  model, tokenizer = load_model(settings.path, dtype=config.model.dtype, mesh=mesh)
  check_same_vocabulary(student_tokenizer, tokenizer)
  # its forward is the trainer's, with the trainer's attention kernel
  model = model.use_attention_kernel(config.model.attention_kernel)
  return Teacher(model, prompt_length=config.rollout.max_prefill_length,
                 completion_length=config.rollout.max_new_tokens,
                 pad_id=student_tokenizer.pad_id or 0, max_batch=settings.max_batch,
                 chunk_size=config.algo.logprob_chunk)


def sampling_params(config: ml_collections.ConfigDict):

  return SamplingParams(**config_schema.values_of(SamplingParams, config))


# ------------------------------------------------------------------------------- a whole run


@dataclasses.dataclass
class Run:
  """Everything a training run needs, built from its config (see `build`)."""

  config: ml_collections.ConfigDict
  trainer_mesh: Any
  sampler_mesh: Any
  tokenizer: Any
  model_config: Any
  graphdef: Any
  step_fn: Any  # rl.step.TrainStep
  state: Any  # rl.step.TrainState, on the trainer mesh (None on a sampler-only process)
  # this process's sampler replica (None: trains only); rollouts and held-out evaluations
  # decode on it
  backend: RolloutBackend | None
  template: Any
  data: Data
  reward_fn: Any
  scorer: Any  # workers.scorer.Scorer; the caller closes it
  sampling: Any  # sampler.SamplingParams of the rollouts
  cluster: Any = None  # multihost.cluster.Cluster: roles, exchange, weight transfers
  weight_sync: Any = None  # loop.weight_sync.WeightSync: what the sampler receives, versions
  episodes: Any = None  # sampler.multiturn.EpisodeSettings (environment.name set), else None
  # on-policy distillation's rl.teacher.Teacher on this process's sampler devices (teacher.path),
  # else None
  teacher: Any = None


def enforce_environment_redteam(config: ml_collections.ConfigDict, episodes) -> list:
  """The environment's own red team at start-up (where it has one: `python_tool`), as
  `verifier.redteam` / `verifier.allow_exploits` say: programs that print the answer, read the
  task's answer from the host, or sleep to the timeout must earn nothing and stall nothing.
  Returns the probe results ([] when none ran)."""
  if episodes is None or not config.verifier.redteam or episodes.environment.name != "python_tool":
    return []

  results = run_python_tool_redteam(episodes.environment)
  failed = [r for r in results if not r.held]
  if failed:
    listing = "\n".join(f"  - [python_tool] {r.name}: {r.why}" for r in failed)
    if not config.verifier.allow_exploits:
      raise VerifierError(f"red team: {len(failed)} probe(s) of the python_tool environment did "
                          f"not hold:\n{listing}\nFix the environment's settings, or set "
                          "verifier.allow_exploits to train anyway.")
    log.warning("RED TEAM OVERRIDDEN: the python_tool environment fails %d probe(s):\n%s",
                len(failed), listing)
  return results


def build_episodes(config: ml_collections.ConfigDict, tokenizer):
  """The multi-turn settings of `config.environment` (None for single-turn rollouts): the
  environment built with its settings checked, and its observation format checked against the
  tokenizer, before anything runs."""
  e = config.environment
  if not e.name:
    return None

  return EpisodeSettings(
      environment=environments.build_environment(e.name, e.settings),
      format_observation=environments.observation_formatter(e.observation_format, tokenizer),
      max_turns=e.max_turns, turn_tokens=e.turn_tokens or config.rollout.max_new_tokens,
      step_workers=e.step_workers)


def build(config: ml_collections.ConfigDict, *, validated: bool = False) -> Run:
  """Chooses the step layout the config leaves open and validates the config against this
  machine's devices (unless the caller just did both: `validated`, as launch/train.py does),
  then builds every piece of a run."""
  if not validated:
    num_slices = sharding.count_slices(jax.devices(), config.mesh.num_slices)
    # what the config leaves to the machine (packing, micro-batches), written into it
    step_layout.log_choices(memory_plan.resolve_layout(
        config, machine=step_layout.this_machine(num_slices)))
    config_lib.validate(config, num_devices=jax.device_count(), num_slices=num_slices)

  warning = precision.pure_low_precision_warning(config.model.weight_dtype,
                                                 config.optim.learning_rate)
  if warning and config.lora.rank == 0:
    log.warning(warning)
  topology = build_topology(config)
  if topology.multi_process and config.stage != "rl":
    raise ConfigError(f"config.stage={config.stage!r}: runs over several processes train the RL "
                      "stage only; run SFT stages in one process (their checkpoint then starts "
                      "the multi-process RL run through model.path)")
  trainer_mesh, sampler_mesh = build_meshes(config, topology)
  data = build_data(config)  # before the model: a bad task file fails in seconds
  reward_fn = build_reward_fn(config)
  def calibration(tokenizer):  # the first training prompts, as the policy will see them
    template = build_template(config, tokenizer)
    return [template.encode(data.train_source.example(index))
            for index in range(UPCYCLE_CALIBRATION_PROMPTS)]

  model, tokenizer = build_policy(config, calibration=calibration)
  if config.algo.routing_replay and model.config.moe is None:
    raise ConfigError(f"config.algo.routing_replay=True: the policy ({model.config.model_type}) "
                      "has no routed experts to replay; set it for mixture-of-experts models "
                      "only")
  lora_settings = LoraSettings.from_config(config)
  if lora_settings.enabled:
    model = lora.apply_lora(model, lora_settings, seed=config.seed)
  template = build_template(config, tokenizer)
  episodes = build_episodes(config, tokenizer)
  enforce_environment_redteam(config, episodes)
  graphdef, params = nnx.split(model)
  step_settings = step_config(config)
  quantizer = build_sampler_quantizer(config, model, graphdef, params, step_settings)
  step_fn = TrainStep(graphdef, step_settings, trainer_mesh, sampler_quantizer=quantizer)
  cluster = build_cluster(config, topology,
                          weight_sync_lib.abstract_payload(step_fn.config, params, quantizer))
  state = backend = None
  if topology.is_trainer:
    # frozen: held in the compute dtype, the only dtype its forward passes use (precision.py)
    reference = (jax.tree.map(lambda x: jnp.array(x, dtype=_compute_dtype(x, config), copy=True),
                              params)
                 if config.beta > 0 and not lora_settings.enabled else None)
    state = step_fn.init_state(params, ref_params=reference)
  if topology.is_sampler:
    # one process: from the trainer's copy; several: every process loaded the same policy
    if state is not None and not topology.multi_process:
      initial = step_fn.full_params(state)
    else:
      initial = params
    # the sampler decodes with weights in the compute dtype (LoRA: the float32 adapters too)
    initial = precision.cast_floating(initial, config.model.dtype)
    sampler_model = nnx.merge(graphdef, initial)
    if weight_sync_lib.mode_of(step_fn.config) == "merged":
      sampler_model = lora.merged_model(sampler_model, lora_settings)
    if quantizer is not None:  # made by the function every weight sync's payload comes from
      sampler_model = quantizer.model(nnx.state(sampler_model))
    backend = build_backend(config, sampler_model, mesh=sampler_mesh)
  del params
  # the teacher scores what this process samples, beside the sampler (like the reward models)
  teacher = build_teacher(config, tokenizer, mesh=sampler_mesh) if topology.is_sampler else None
  # last: nothing after it can fail and leak workers; a process that only trains scores nothing
  scorer = build_scorer(config, reward_fn, inline=not topology.is_sampler, mesh=sampler_mesh,
                        model_parts=topology.is_sampler)
  return Run(config=config, trainer_mesh=trainer_mesh, sampler_mesh=sampler_mesh,
             tokenizer=tokenizer, model_config=model.config, graphdef=graphdef,
             step_fn=step_fn, state=state, backend=backend, template=template, data=data,
             reward_fn=reward_fn, scorer=scorer, sampling=sampling_params(config),
             cluster=cluster, weight_sync=weight_sync_lib.WeightSync(step_fn, backend, cluster),
             episodes=episodes, teacher=teacher)


@dataclasses.dataclass(frozen=True)
class Loop:
  """What drives a built `Run` step by step (`build_loop`): the collector that turns the backend's
  completions into scored groups, the stage that makes one step of them, and the held-out
  evaluation's reworded templates, as (instruction, template) pairs."""

  collector: Any
  stage: Any
  variant_templates: tuple


def build_loop(run: Run, *, stage=None) -> Loop:
  """The loop's pieces for `run`: a `RolloutCollector` (each sampler replica's share with several
  processes: `ShardedCollector`; partial rollouts: `PartialCollector`; `agent.entry`: the
  `agents.collector.AgentCollector` that runs the user's agent program), the stage the config names
  (`RLStage` / `SFTStage`) unless `stage` replaces it (tests do), and the templates of
  `eval.instruction_variants`."""

  config, cluster = run.config, run.cluster
  r = config.rollout
  collector_kwargs = dict(num_samples=r.num_samples, max_new_tokens=r.max_new_tokens,
                          stop_strings=r.stop_strings, sampling=run.sampling, seed=config.seed,
                          episodes=run.episodes, teacher=run.teacher)
  if cluster.multi_process:  # each sampler replica collects its share
    collector_kwargs["cluster"] = cluster
  collector_class = ShardedCollector if cluster.multi_process else RolloutCollector
  if partial_rollouts(config):
    check_partial_rollouts(multi_process=cluster.multi_process)
    collector_class = PartialCollector
    collector_kwargs.update(settings=PartialSettings.from_config(config),
                            example_of=run.data.train_source.example)
  agent = AgentSettings.from_config(config)
  if agent is not None:  # agent rollouts: the user's program plays each episode
    if cluster.multi_process:
      raise ConfigError(f"config.agent.entry={agent.entry!r}: agent rollouts run in one process")
    collector = AgentCollector(run.backend, run.tokenizer, agent, num_samples=r.num_samples,
                               max_new_tokens=r.max_new_tokens, sampling=run.sampling,
                               seed=config.seed, max_prompt_tokens=r.max_prefill_length,
                               agent=agent_entry.load_agent(config))
  else:
    collector = collector_class(run.backend, run.tokenizer, run.template, run.scorer,
                                **collector_kwargs)
  if stage is None:
    stage = (RLStage(run, collector, staleness=rollout_staleness(config),
                     with_sampler_logprobs=(sampler_correction(config) != "none"
                                            or config.algo.rejection != "none"
                                            or run.step_fn.config.old_logprobs_from_sampler))
             if config.stage == "rl" else SFTStage(run, collector, storage.path(config.workdir)))
  variants = tuple((instruction, build_template(config, run.tokenizer, instruction=instruction))
                   for instruction in config.eval.instruction_variants)
  return Loop(collector=collector, stage=stage, variant_templates=variants)


def _compute_dtype(array, config: ml_collections.ConfigDict):
  """The compute dtype for a floating-point array, its own dtype for any other."""

  return config.model.dtype if jnp.issubdtype(array.dtype, jnp.floating) else array.dtype


@dataclasses.dataclass
class Evaluation:
  """What evaluating a checkpoint on a config's held-out set needs (launch/evaluate.py).
  The caller stops the backend and closes the scorer."""

  backend: RolloutBackend  # holding the checkpoint's weights
  tokenizer: Any
  template: Any
  examples: Sequence[Any]
  scorer: Any
  max_new_tokens: int
  episodes: Any = None  # sampler.multiturn.EpisodeSettings of a multi-turn config


def build_evaluation(config: ml_collections.ConfigDict, checkpoint: str, *,
                     mesh=None) -> Evaluation:
  """The policy at `checkpoint` (run workdir, checkpoint step, HF dir or GGUF) + the config's
  held-out data, template, rewards and sampling limits. No red team: nothing is trained.
  `mesh` places the weights and the backend (`rollout.backend`; default: the default device)."""
  model, tokenizer = load_checkpoint(checkpoint, dtype=config.model.dtype, mesh=mesh)
  max_new_tokens = eval_max_new_tokens(config)
  backend = build_backend(config, model, mesh=mesh, max_decode_length=max_new_tokens)
  reward_fn = build_reward_fn(config, redteam=False)
  return Evaluation(backend=backend, tokenizer=tokenizer,
                    template=build_template(config, tokenizer),
                    examples=build_eval_examples(config),
                    scorer=build_scorer(config, reward_fn, mesh=mesh),
                    max_new_tokens=max_new_tokens, episodes=build_episodes(config, tokenizer))
