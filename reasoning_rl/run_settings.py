"""What a config implies, computed from the config alone (nothing is loaded or built): the
random model's architecture, whether rollouts run ahead and how stale they may be, the sampler
correction, and the training step's static configuration. The builder (`build.py`) and the
planner (`memory_plan.py`, `planning.py`) read these, so neither imports the other for them.
"""

from __future__ import annotations

import ml_collections

from reasoning_rl import config as config_lib
from reasoning_rl import config_schema, step_layout
from reasoning_rl.errors import ConfigError


def random_model_config(config: ml_collections.ConfigDict):
  """(ModelConfig, tokenizer) of the random model that `model.random` + `model.tokenizer` name."""
  # in the function: models/'s package init imports JAX, and this module must load without it
  # (config validation and the dry run read it)
  from reasoning_rl.data.debug_vocab import load_named_tokenizer
  from reasoning_rl.models.config import ModelConfig, MoEConfig

  tokenizer = load_named_tokenizer(config.model.tokenizer)
  shape = dict(config.model.random)
  if shape.get("moe") is not None:  # routed experts: MoEConfig's fields, every layer sparse
    moe = dict(shape["moe"])         # unless sparse_layers says otherwise
    moe.setdefault("sparse_layers", (True,) * shape.get("num_layers", 2))
    shape["moe"] = MoEConfig(**moe)
  return ModelConfig(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                     eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                     **shape), tokenizer


def rollout_staleness(config: ml_collections.ConfigDict) -> int:
  """k: how many policy versions a trained batch may lag (0 = synchronous rollouts)."""
  return config.async_rollouts.max_staleness if rollouts_ahead(config) else 0


def rollouts_ahead(config: ml_collections.ConfigDict) -> bool:
  """`async_rollouts.enabled`, or when unset (None), whether the run has a sampler slice of its
  own: split slices overlap sampling with training by default, shared devices cannot."""
  enabled = config.async_rollouts.enabled
  if enabled is None:
    return config.mesh.num_trainer_devices > 0
  return bool(enabled)


def sampler_correction(config: ml_collections.ConfigDict) -> str:
  """`algo.is_correction`, except that asynchronous, partial and quantized rollouts always
  correct (token-truncate): their tokens come from older policies than the one trained, or
  (`rollout.weight_quantization`) from a quantized copy of it, which is another policy at every
  step (docs/off_policy.md, "Quantized rollouts")."""
  lagging = rollout_staleness(config) > 0 or partial_rollouts(config)
  quantized = config.stage == "rl" and config.rollout.weight_quantization != "none"
  if config.algo.is_correction == "none" and (lagging or quantized):
    return "token-truncate"
  return config.algo.is_correction


def partial_rollouts(config: ml_collections.ConfigDict) -> bool:
  """Whether steps sample in rounds that carry unfinished samples over (`loop.partial_rollouts`)."""
  return config.stage == "rl" and bool(config.partial_rollouts.enabled)


def step_config(config: ml_collections.ConfigDict):
  """The training step's static configuration (`reasoning_rl.rl.step_config.StepConfig`): its sourced
  fields read from the config by name, the rest derived here."""
  # in the function: both import JAX, which this module's other readers must not load
  from reasoning_rl.lora import LoraSettings
  from reasoning_rl.rl.step_config import StepConfig

  a = config.algo
  if step_layout.is_open(config):
    raise ConfigError(
        f"config.algo.packing={a.packing!r} / num_micro_batches={a.num_micro_batches!r} / "
        f"shared_prompts={a.shared_prompts!r} / packed_row_factor={a.packed_row_factor!r}: "
        "chosen for the machine at start-up; call reasoning_rl.memory_plan.resolve_layout(config) "
        "(build() does) before the step's configuration, or set the four fields")
  lora_settings = LoraSettings.from_config(config)
  return StepConfig(**config_schema.values_of(
      StepConfig, config,
      algorithm="sft" if config.stage != "rl" else ("ppo" if a.name == "ppo" else "grpo"),
      # without packed RL rows these two are never read and may stay open
      shared_prompts=bool(a.shared_prompts), packed_row_factor=max(a.packed_row_factor, 1),
      max_completion_length=config.rollout.max_new_tokens,
      lora=lora_settings if lora_settings.enabled else None,
      compute_dtype=config.model.dtype,
      is_correction=sampler_correction(config),
      # the rebuild costs memory and time (a top-k over the vocabulary per position) and changes
      # nothing when the rollouts sample the model as is
      truncated_ratio=a.truncated_ratio and config_lib.rollout_rescales(config),
      # exact rollouts record the canonical forward's experts, which the trainer replays
      # (sampler/exact.py); a dense model ignores the switch
      routing_replay=a.routing_replay or (config.stage == "rl" and config.rollout.exact_logprobs),
      # π_old = μ only when the batch was sampled with the weights being trained
      old_logprobs_from_sampler=(config.stage == "rl" and config.rollout.exact_logprobs
                                 and rollout_staleness(config) == 0
                                 and not partial_rollouts(config))))
