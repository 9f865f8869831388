"""Validation of a training config and the launchers' command-line checks.

Every field, its default, meaning and accepted values are declared once in
`reasoning_rl/config_schema.py` (`base_config()` comes from there; config files in configs/ start
from it and override what differs). `launch/train.py` applies `--config.a.b=value` overrides and
then `validate(config)` raises one `ConfigError` naming the first bad field before anything is
loaded or compiled: first each field's declared range or choices, then the rules that tie fields
together.
"""

from __future__ import annotations

import math
import os

import ml_collections

from reasoning_rl.config_help import help_text
from reasoning_rl.config_fields import OneOf, Range, Satisfies, Text
from reasoning_rl.config_schema import FIELDS, value_at
from reasoning_rl.config_schema import base_config  # noqa: F401  (config files import it here)
from reasoning_rl.errors import ConfigError, ExitCode
from reasoning_rl.sampler import api as sampler_api  # no JAX: the backends' declared capabilities
from reasoning_rl.verifiers.rewards import build_parts  # no JAX, math-verify or sympy (0.15 s)

# The range of every numeric field (derived from the schema; `validate` checks them all).
FIELD_RANGES: dict[str, Range] = {dotted: item.check for dotted, item in FIELDS.items()
                                  if isinstance(item.check, Range)}
# Fields that take one name of a fixed list or of a registry.
FIELD_CHOICES: dict[str, OneOf] = {dotted: item.check for dotted, item in FIELDS.items()
                                   if isinstance(item.check, OneOf)}
# Fields whose value must match a pattern or pass a test (e.g. agent.action: 'module:function').
FIELD_RULES: dict[str, Text | Satisfies] = {dotted: item.check for dotted, item in FIELDS.items()
                                           if isinstance(item.check, (Text, Satisfies))}


def check_range(dotted: str, value) -> None:
  """ConfigError naming `config.<dotted>` when `value` is outside FIELD_RANGES[dotted]."""
  problem = FIELD_RANGES[dotted].problem(value)
  if problem:
    raise ConfigError(f"config.{dotted}={value!r}: {problem}")


_field = value_at


def _plain_value(value):
  """A ConfigDict field's value as the plain dict a rule tests (other values as they are)."""
  return value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value


def check_choice(dotted: str, value) -> None:
  """ConfigError naming `config.<dotted>` when `value` is not one of FIELD_CHOICES[dotted]."""
  rule = FIELD_CHOICES[dotted]
  if rule.registry:
    from reasoning_rl import registry  # pylint: disable=import-outside-toplevel  (imports JAX)

    getattr(registry, rule.registry).get(value, field=dotted)  # its own one-line error
  elif value not in rule.values:
    raise ConfigError(f"config.{dotted}={value!r}: must be {rule.describe()}")


def rollout_rescales(config: ml_collections.ConfigDict) -> bool:
  """Whether rollouts sample from another distribution than the model's own (temperature other
  than 1, or a top-k / top-p / min-p filter; greedy rows keep the full softmax): only then does
  `algo.truncated_ratio` change the ratio, so only then does the step rebuild the truncation."""
  r = config.rollout
  return r.temperature not in (0, 1.0) or r.top_p < 1.0 or r.top_k > 0 or r.min_p > 0


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None,
             num_slices: int = 1) -> None:
  """Raises ConfigError naming the first inconsistent field."""

  def require(condition: bool, field: str, message: str):
    if not condition:
      raise ConfigError(f"config.{field}={_field(config, field)!r}: {message}")

  require(bool(config.workdir), "workdir", "set --config.workdir=DIR (metrics, checkpoints, "
          "rollouts go there)")
  for dotted, item in FIELDS.items():
    if isinstance(item.default, bool) or (item.kind is bool and _field(config, dotted) is not None):
      require(isinstance(_field(config, dotted), bool), dotted, "must be True or False")
  for dotted in FIELD_RANGES:
    check_range(dotted, _field(config, dotted))
  for dotted in FIELD_CHOICES:
    check_choice(dotted, _field(config, dotted))
  for dotted, rule in FIELD_RULES.items():
    problem = rule.problem(_plain_value(_field(config, dotted)))
    require(problem is None, dotted, problem or "")
  if config.stage == "sft":
    require(bool(config.sft.data_path), "sft.data_path", "the sft stage needs a JSONL file of "
            "{prompt, completion} rows")
  if config.stage != "rl":
    require(config.sft.batch_size % max(config.algo.num_micro_batches, 1) == 0, "sft.batch_size",
            "must be divisible by algo.num_micro_batches")
  if config.stage != "rl":
    require(config.beta == 0, "beta", "SFT stages have no KL term; set beta=0")
  if config.stage == "rejection_sft":
    require("correct" in config.rewards, "rewards", "rejection sampling keeps verified-correct "
            "traces: configure a 'correct' reward part")
  require(bool(config.model.path) or bool(config.model.tokenizer), "model.path",
          "give a model path (HF dir or .gguf) or model.tokenizer for a random model")
  require(config.model.weight_dtype == "float32" or config.model.dtype == "bfloat16",
          "model.weight_dtype", "bfloat16 weights with float32 compute lose the updates and gain "
          "no speed; use weight_dtype=float32, or dtype=bfloat16 as well")
  from reasoning_rl.lora import LoraSettings  # pylint: disable=import-outside-toplevel

  lora = LoraSettings.from_config(config)
  lora.validate()
  r = config.rollout
  from reasoning_rl import registry  # pylint: disable=import-outside-toplevel

  for split in ("train", "eval"):
    source = config.data[split]
    registry.TASK_SOURCES.get(source.get("kind") if hasattr(source, "get") else None,
                              field=f"data.{split}.kind")

  parts = build_parts(config.rewards)  # every part's kind and settings
  _validate_environment(config, parts, require)
  _validate_teacher(config, require)
  # distillation alone needs no group: its advantages are per token
  distillation_alone = bool(config.teacher.path) and config.teacher.reward_weight == 0
  if config.algo.name == "grpo" and config.stage == "rl" and not distillation_alone:
    require(r.num_samples >= 2, "rollout.num_samples",
            f"group estimator {config.algo.estimator!r} compares samples of one prompt: "
            "needs at least 2")
  batch = batch_rows(config)
  segments = batch - r.num_prompts * r.num_samples
  # 0 micro-batches: chosen at start-up (step_layout), always a divisor of the mini-batch
  mini, micro = config.algo.num_mini_batches, max(config.algo.num_micro_batches, 1)
  require(config.stage != "rl" or batch % (mini * micro) == 0,
          "agent.segment_rows" if segments else
          "algo.num_micro_batches" if mini == 1 else "algo.num_mini_batches",
          f"num_mini_batches x num_micro_batches = {mini} x {micro} must divide the batch of "
          f"num_prompts x num_samples = {r.num_prompts * r.num_samples} completions"
          + (f" + agent.segment_rows = {segments} rows" if segments else ""))
  # packed_row_factor 0: chosen at start-up (step_layout), a divisor of the micro-batch's rows
  require(not config.algo.packing or config.stage != "rl" or config.algo.packed_row_factor == 0
          or (batch // (mini * micro)) % config.algo.packed_row_factor == 0,
          "algo.packed_row_factor", f"packed rows {config.algo.packed_row_factor} times as long "
          f"must evenly share the {batch // max(mini * micro, 1)} rows of a micro-batch")
  _validate_partial_rollouts(config, require)
  _validate_paged_cache(config, require)
  require(not (r.exact_logprobs and config.environment.name), "rollout.exact_logprobs",
          "exact rollouts verify single-turn completions and the turns an agent program "
          "(agent.entry) is served; in-process multi-turn episodes "
          f"(environment.name={config.environment.name!r}) are not covered: set "
          "rollout.exact_logprobs=False, or play the environment through an agent "
          "(docs/agents.md)")
  require(not (r.exact_logprobs and lora.enabled and lora.sampler_weights == "merged"),
          "lora.sampler_weights",
          "exact rollouts (rollout.exact_logprobs) stand the sampler's log-probs in for the "
          "trainer's π_old, which needs the sampler to compute with the trainer's weights; "
          "merged ones (the adapters folded into the base, rounded in the compute dtype) are "
          "another policy: set lora.sampler_weights='adapters', or rollout.exact_logprobs=False")
  _validate_weight_quantization(config, lora, require)
  require(not (config.algo.routing_replay and config.environment.name), "algo.routing_replay",
          "multi-turn episodes append the environment's tokens without recording their "
          f"routing (environment.name={config.environment.name!r}), so there is nothing to "
          "replay for them: set algo.routing_replay=False")
  _validate_backend_capabilities(config, require)
  _validate_agent(config, require)
  require(config.beta > 0 or math.isinf(config.guards.max_kl), "guards.max_kl",
          "the KL guard measures KL to the reference, which exists only with beta > 0; set "
          "--config.beta or leave max_kl at inf")
  for variant in config.eval.instruction_variants:
    require(isinstance(variant, str) and "{prompt}" in variant, "eval.instruction_variants",
            "every variant is an instruction text containing {prompt}")
  if num_devices is not None:
    _validate_mesh(config, num_devices, num_slices)


def batch_rows(config: ml_collections.ConfigDict) -> int:
  """Rows of an RL step's batch: num_prompts x num_samples, one per episode or completion, plus
  an agent run's `agent.segment_rows` for the other segments of split episodes
  (`rl.segment_rows`)."""
  r = config.rollout
  return r.num_prompts * r.num_samples + (config.agent.segment_rows if config.agent.entry else 0)


def _validate_agent(config, require) -> None:
  """Agent rollouts (`config.agent.entry`, reasoning_rl/agents): what they do not combine with
  (the backend's `agent_server` capability is checked with the others)."""
  a, r = config.agent, config.rollout
  if not a.entry:
    return
  require(":" in a.entry, "agent.entry", "must be 'module:function'")
  require(a.min_episodes_per_group <= r.num_samples, "agent.min_episodes_per_group",
          f"must be at most rollout.num_samples={r.num_samples}")
  if a.segment_rows:
    require(a.history_mismatch == "split", "agent.segment_rows",
            f"holds the segments of split sessions; agent.history_mismatch="
            f"{a.history_mismatch!r} never splits: set agent.segment_rows=0")
    # PPO's GAE puts the episode's reward at a row's last token; the segments of one episode
    # end at different points, and the value targets of each would credit it with the whole
    # episode's outcome
    require(config.algo.name != "ppo", "agent.segment_rows",
            "PPO's per-token advantages (GAE to the episode's reward at a row's end) are not "
            "defined for the several segments of one episode: set agent.segment_rows=0 or use a "
            "group estimator (algo.name='grpo')")
  for field, value, what in (
      ("environment.name", config.environment.name, "an environment's episodes"),
      ("partial_rollouts.enabled", config.partial_rollouts.enabled, "partial rollouts"),
      ("dynamic_sampling.enabled", config.dynamic_sampling.enabled, "dynamic sampling"),
      ("rollout.kv_page_size", r.kv_page_size, "a paged KV cache"),
      # the teacher scores what the in-process collectors sample; the agent collector has no
      # call to it, so distillation would silently train on the agent's reward alone
      ("teacher.path", config.teacher.path, "on-policy distillation")):
    require(not value, field, f"agent rollouts (agent.entry={a.entry!r}) do not run with "
            f"{what}: turn it off")


def _validate_environment(config, parts, require) -> None:
  """Multi-turn episodes (`config.environment`): the environment's name and settings, and what
  it cannot be combined with."""
  e = config.environment
  if not e.name:
    require(not any(p.kind == "environment" for p in parts), "rewards",
            "an 'environment' reward part reads a multi-turn episode's outcome: set "
            "environment.name, or drop the part")
    return
  from reasoning_rl import registry  # pylint: disable=import-outside-toplevel

  # building it checks its settings (ConfigError naming config.environment.settings.<x>)
  registry.ENVIRONMENTS.get(e.name, field="environment.name").impl(
      e.settings, field="environment.settings")
  require(config.stage == "rl", "stage", "multi-turn episodes (environment.name) are RL "
          "rollouts; use stage='rl'")
  require(config.algo.name == "grpo", "algo.name", "PPO's value head and GAE would run across "
          "observation tokens, which the model did not choose; use algo.name='grpo' with "
          "environment.name")
  require(e.turn_tokens <= config.rollout.max_new_tokens, "environment.turn_tokens",
          "one turn cannot be longer than the whole completion (rollout.max_new_tokens, "
          "observations included)")


def _validate_teacher(config, require) -> None:
  """On-policy distillation (`config.teacher`): per-token advantages before the step, which
  the objectives that make their own (PPO) or need one per sequence (GSPO) cannot take."""
  t = config.teacher
  if not t.path:
    return
  require(config.stage == "rl", "teacher.path", "on-policy distillation trains on the "
          "student's own samples, an RL stage; use stage='rl', or set teacher.path=''")
  require(config.algo.name == "grpo", "algo.name", "PPO computes its per-token advantages "
          "inside the step (GAE over its value head), and on-policy distillation's are made "
          "before it; use algo.name='grpo' with teacher.path, or set teacher.path=''")
  require(config.algo.loss_type != "gspo", "algo.loss_type", "GSPO's sequence ratio takes one "
          "advantage per sequence, and on-policy distillation gives one per token; use "
          "algo.loss_type='gspo-token' (or ppo, cispo), or set teacher.path=''")

def _validate_weight_quantization(config, lora, require) -> None:
  """rollout.weight_quantization and what it cannot be combined with (its model-dependent
  limits, MoE and latent attention, are checked when the model is built:
  `sampler.quantized.check_model`)."""
  r = config.rollout
  if r.weight_quantization == "none":
    return
  require(not r.exact_logprobs, "rollout.exact_logprobs",
          f"exact rollouts report the trainer's own forward as μ, and a quantized sampler "
          f"(rollout.weight_quantization={r.weight_quantization!r}) draws from another model: "
          "set rollout.exact_logprobs=False or rollout.weight_quantization='none'")
  require(not (lora.enabled and lora.sampler_weights == "adapters"), "lora.sampler_weights",
          f"quantized rollouts (rollout.weight_quantization={r.weight_quantization!r}) quantize "
          "a plain model, and 'adapters' sends float adapters for the sampler's base: set "
          "lora.sampler_weights='merged', or quantize the base for trainer and sampler alike "
          "with lora.base_quantization and rollout.weight_quantization='none'")
  require(not config.model.scan_layers, "model.scan_layers",
          f"quantized rollouts (rollout.weight_quantization={r.weight_quantization!r}) need the "
          "loop layout: the scanned blocks are rebuilt inside the scan, where qwix cannot "
          "replace their kernels; set model.scan_layers=False")


def _validate_partial_rollouts(config, require) -> None:
  """Partial rollouts (`config.partial_rollouts`) and what they cannot be combined with yet."""
  p, r = config.partial_rollouts, config.rollout
  if not p.enabled:
    return
  off = "or set partial_rollouts.enabled=False"
  require(config.stage == "rl", "partial_rollouts.enabled",
          f"partial rollouts are RL rollouts; use stage='rl' {off}")
  require(not config.environment.name, "partial_rollouts.enabled",
          "multi-turn episodes (environment.name) are not continued across steps; set "
          "environment.name='' " + off)
  require(not r.exact_logprobs, "partial_rollouts.enabled",
          "exact rollouts verify each completion under one set of weights, and a continued "
          f"sample spans several; set rollout.exact_logprobs=False {off}")
  require(not config.dynamic_sampling.enabled, "partial_rollouts.enabled",
          "DAPO's dynamic sampling refills a batch by sampling more prompts, which rounds do "
          f"not (groups with equal rewards are trained on); set dynamic_sampling.enabled=False "
          f"{off}")
  ahead = config.async_rollouts.enabled
  ahead = config.mesh.num_trainer_devices > 0 if ahead is None else ahead
  require(not ahead, "async_rollouts.enabled",
          "partial rollouts sample each step's round right before it (the rounds are what "
          "removes the wait for the longest completion), not batches ahead; set "
          f"async_rollouts.enabled=False {off}")
  require(p.groups_in_flight == 0 or p.groups_in_flight > r.num_prompts,
          "partial_rollouts.groups_in_flight",
          f"{p.groups_in_flight} groups in flight for {r.num_prompts} trained per step: a round "
          f"ends only when {r.num_prompts} complete, so with no more in flight it waits for "
          f"every one; set more than rollout.num_prompts (0 = twice as many)")


def sampler_cache_length(config) -> int:
  """Tokens per decode slot: the engine's max_prefill_length + max_decode_length (the longer of
  the rollouts' and the held-out evaluation's budgets, `build.build_engine`)."""
  r = config.rollout
  evaluation = config.get("eval", {}).get("max_new_tokens", 0) or 0
  return r.max_prefill_length + max(r.max_new_tokens, evaluation)


def _validate_paged_cache(config, require) -> None:
  """rollout.kv_page_size / kv_pages: a pool that holds at least one slot's whole length, on the
  engine backend (the paged cache is that engine's)."""
  r = config.rollout
  require(r.kv_pages == 0 or r.kv_page_size > 0, "rollout.kv_pages",
          f"{r.kv_pages} pages without a paged cache: set rollout.kv_page_size (e.g. 16), or "
          "rollout.kv_pages=0")
  require(r.kv_page_kernel == "auto" or r.kv_page_size > 0, "rollout.kv_page_kernel",
          f"{r.kv_page_kernel!r} reads a paged cache, and this run has none: set "
          "rollout.kv_page_size (e.g. 16), or leave rollout.kv_page_kernel='auto'")
  if not r.kv_page_size:
    return
  for field, on, what in (("rollout.exact_logprobs", r.exact_logprobs, "exact rollouts"),
                          ("environment.name", config.environment.name, "multi-turn episodes")):
    require(not (on and r.kv_pages), "rollout.kv_pages",
            f"{what} ({field}) do not preempt samples when the pool runs short; leave "
            "rollout.kv_pages=0 (room for every slot's whole length)")
  per_slot = -(-sampler_cache_length(config) // r.kv_page_size)
  require(r.kv_pages == 0 or r.kv_pages >= per_slot, "rollout.kv_pages",
          f"{r.kv_pages} pages cannot hold one slot's {sampler_cache_length(config)} cache "
          f"entries ({per_slot} pages of {r.kv_page_size}); raise it, or 0 for every slot's "
          "whole length")


def _validate_backend_capabilities(config, require) -> None:
  """Every field that asks the rollout backend for an optional capability
  (`sampler.api.CAPABILITY_FIELDS`) needs a backend whose registration declared it."""
  from reasoning_rl import registry  # pylint: disable=import-outside-toplevel  (imports JAX)

  name = config.rollout.backend
  declared = sampler_api.capabilities_of(name)
  for field, capability, what, off in sampler_api.required_capabilities(
      lambda dotted: _field(config, dotted)):
    if getattr(declared, capability):
      continue
    having = [other for other in registry.ROLLOUT_BACKENDS.names()
              if getattr(sampler_api.capabilities_of(other), capability)]
    fix = f"use rollout.backend={having[0]!r}" if having else "register a backend that does"
    require(False, field, f"needs a rollout backend that {what} (Capabilities.{capability}), "
            f"and rollout.backend={name!r} does not declare it: {fix}, or set {field}={off}")


def _validate_mesh(config, num_devices: int, num_slices: int) -> None:
  from reasoning_rl import sharding  # imports jax; validation of the rest of the config does not

  counts = sharding.slice_device_counts(config.mesh.num_trainer_devices, num_devices,
                                        field="config.mesh.num_trainer_devices")
  trainer_slices = sharding.slices_spanned(counts[0], num_devices, num_slices)
  trainer_shape = tuple(config.mesh.trainer)
  sizes = dict(zip(sharding.mesh_axes_of(trainer_shape), sharding.multi_slice_mesh_shape(
      trainer_shape, counts[0], trainer_slices, field="config.mesh.trainer")))
  split = {axis: sizes[axis] for axis in sharding.BATCH_MESH_AXES if axis in sizes}
  sharding.resolve_mesh_shape(tuple(config.mesh.sampler), counts[1], field="config.mesh.sampler")
  # The step's batch is split row-wise over the trainer mesh's data x fsdp (x expert) devices
  # (sharding.batch_sharding): a row count they do not divide fails in JAX only once the first
  # batch is placed, after the model load and the step-0 evaluation.
  if config.stage == "rl":
    field, rows = "rollout.num_prompts", batch_rows(config)
    what = f"num_prompts x num_samples = {rows} completions"
    if rows != config.rollout.num_prompts * config.rollout.num_samples:
      field, what = "agent.segment_rows", f"{rows} rows (completions + agent.segment_rows)"
  else:
    field, rows = "sft.batch_size", config.sft.batch_size
    what = f"{rows} examples"
  if rows % math.prod(split.values()):
    raise ConfigError(
        f"config.{field}={_field(config, field)!r}: the batch of {what} is split over the "
        f"trainer mesh's {' x '.join(split)} = {' x '.join(map(str, split.values()))} devices, "
        "which must divide it; change the batch or config.mesh.trainer")


def check_overrides(config: ml_collections.ConfigDict, overrides: dict[str, str]) -> None:
  """Checks `--config.a.b=value` overrides before flag parsing, for one clear error each.

  An unknown field or a value that does not parse as the field's type raises ConfigError naming
  the field (ml_collections would otherwise fail deep inside flag parsing).
  """
  for dotted, text in overrides.items():
    node = config
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        parent = ".".join(["config"] + parts[:depth])
        known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        raise ConfigError(f"config.{dotted}: unknown field; {parent} has {known}")
      node = node[part]
    expected = type(node)
    try:
      if expected is bool:
        if text.lower() not in ("true", "false", "1", "0"):
          raise ValueError(text)
      elif expected in (int, float):
        expected(text)
    except ValueError:
      raise ConfigError(f"config.{dotted}={text!r}: expected {expected.__name__}") from None


def config_args(argv: list[str]) -> tuple[str | None, dict[str, str]]:
  """(config file, {field: value}) from a launcher's command line, in either flag form:
  `--config=FILE --config.a.b=v` or `--config FILE --config.a.b v` (absl accepts both)."""
  path, overrides, args = None, {}, list(argv[1:])
  for index, arg in enumerate(args):
    if arg == "--":
      break
    if not (arg == "--config" or arg.startswith(("--config=", "--config."))):
      continue
    name, has_value, value = arg[2:].partition("=")
    if not has_value:
      following = args[index + 1] if index + 1 < len(args) else None
      if following is None or following.startswith("--"):
        if name == "config":
          raise ConfigError("--config: missing its file; pass --config=configs/NAME.py")
        value = "true"  # absl's bare boolean form, `--config.dry_run`
      else:
        value = following
    if name == "config":
      path = value
    else:
      overrides[name[len("config."):]] = value
  return path, overrides


# Fields whose type changed: what an older config file that sets them should say now.
RETYPED_FIELDS = {"remat": "config.algo.remat takes a name now: 'full' (was True) or 'none' "
                           "(was False), or 'save_matmuls'"}


def precheck_command_line(argv: list[str], *, full: bool = True) -> None:
  """One ConfigError for a missing config file, one that does not load, an unknown field or an
  unparsable value, before absl parses the flags (whose errors are tracebacks or multi-line).
  With `full` (train, evaluate) the config must hold every field of the schema; replay and the
  red team need only `rewards`."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel

  argument, overrides = config_args(argv)
  if argument is None:
    raise ConfigError("--config: missing; pass --config=configs/NAME.py")
  # FILE:VARIANT passes VARIANT to get_config (ml_collections' convention; recipes use it for
  # their debug-sized variant)
  path, *variant = argument.split(":", 1)
  if not pathlib.Path(path).is_file():
    raise ConfigError(f"--config={argument}: no such config file")
  spec = importlib.util.spec_from_file_location("_config_file", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as error:  # a syntax error, a missing module, anything the file raises
    raise ConfigError(f"--config={argument}: the file cannot be loaded: {_one_line(error)}; fix "
                      "it (python " + path + " shows the traceback)") from None
  if not hasattr(module, "get_config"):
    raise ConfigError(f"--config={argument}: the file defines no get_config()")
  try:
    config = module.get_config(*variant)
  except TypeError as error:  # ml_collections refuses a value of another type than the field's
    hint = next((text for name, text in RETYPED_FIELDS.items() if f"field '{name}'" in str(error)),
                "python launch/train.py --help lists each field's type")
    raise ConfigError(f"--config={argument}: {error}; {hint}") from None
  except ConfigError:  # the file's own one-line refusal (a recipe's unknown variant)
    raise
  except Exception as error:
    raise ConfigError(f"--config={argument}: get_config({', '.join(map(repr, variant))}) raised "
                      f"{_one_line(error)}") from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"--config={argument}: get_config() returned a {type(config).__name__}, "
                      "not an ml_collections.ConfigDict")
  if full:
    missing = [dotted for dotted in FIELDS if not _has_field(config, dotted)]
    if missing:
      raise ConfigError(f"--config={argument}: the config lacks {len(missing)} field(s) "
                        f"({', '.join(missing[:5])}{', …' if len(missing) > 5 else ''}); start "
                        "get_config() from reasoning_rl.config_schema.base_config(), as "
                        "configs/*.py do")
  check_overrides(config, overrides)


def _has_field(config: ml_collections.ConfigDict, dotted: str) -> bool:
  try:
    value_at(config, dotted)
    return True
  except (KeyError, AttributeError):
    return False


def _one_line(error: BaseException) -> str:
  """`Type: message` of an exception on one line (a SyntaxError with its file and line)."""
  if isinstance(error, SyntaxError):
    where = f" ({os.path.basename(error.filename or '?')}, line {error.lineno})"
    return f"{type(error).__name__}: {error.msg}{where}"
  text = " ".join(str(error).split())
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


HELP_FLAGS = ("--help", "-h", "-?", "--helpfull", "--helpshort")


def absl_flags_or_exit(argv: list[str]) -> list[str]:
  """absl's flag parsing for `app.run(main, flags_parser=...)`: an unknown flag or a bad value
  prints one line and exits 2 (absl's own parser prints two and exits 1)."""
  import sys  # pylint: disable=import-outside-toplevel

  from absl import flags  # pylint: disable=import-outside-toplevel

  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(ExitCode.BAD_INPUT)


def precheck_or_exit(argv: list[str], *, full: bool = True) -> None:
  """`precheck_command_line` for a launcher's `__main__`: a bad command line prints one line and
  exits 2 (the bad-config exit code)."""
  import sys  # pylint: disable=import-outside-toplevel

  if any(arg in HELP_FLAGS for arg in argv[1:]):
    print(help_text())  # absl then prints the launcher's usage and flags, and exits
    return
  try:
    precheck_command_line(argv, full=full)
  except ConfigError as error:
    print(f"error: ConfigError: {error}", file=sys.stderr)
    sys.exit(ExitCode.BAD_INPUT)
