"""The training step's options (`StepConfig`) and the checks on them and on the batches it meets.

Construction refuses the combinations the step cannot run, each with one error naming the config
field and the fix; the batch checks (`check_batch_size`, `check_packed_slices`,
`sampler_correction`, `truncation`) run while the step is traced, before any compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from reasoning_rl import registries
from reasoning_rl.config_schema import sourced
from reasoning_rl.errors import ConfigError
# losses registers the built-in loss aggregations, KL estimators, loss types and importance
# corrections that the choices below are looked up in (the catalogue, reasoning_rl.registry,
# imports this package, so importing it here would close a cycle)
from reasoning_rl.rl import losses  # noqa: F401  pylint: disable=unused-import
from reasoning_rl.rl import packing
from reasoning_rl.rl.batching import TRUNCATION_FIELDS
from reasoning_rl.rl.off_policy import NO_DUAL_CLIP


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Options of the training step: a typed view of the config. Each field marked `sourced` IS the
  config field of that name (default from reasoning_rl/config_schema.py;
  `run_settings.step_config` reads them all by that name, no copies); the six above them are
  derived from the stage, the rollout and the model.

  algorithm: "grpo" (advantages come with the batch), "ppo" (value head + GAE) or "sft"
    (cross-entropy on completion tokens; the batch needs no advantages).
  loss_type, beta, kl_estimator, epsilon_low, epsilon_high, dual_clip, loss_agg, entropy_coef,
    is_correction, is_threshold: as `reasoning_rl.rl.losses.policy_loss` (loss types: PPO,
    Schulman et al. 2017; GSPO, Zheng et al. 2025, arXiv:2507.18071; CISPO, MiniMax-M1,
    arXiv:2506.13585; DPPO, Qi et al. 2026, arXiv:2602.04879).
  is_threshold_low, icepop_low, icepop_high, rejection, rejection_geo_low, rejection_geo_high,
    rejection_k3_threshold: the bounds of the off-policy corrections and the sequence rejection
    (`reasoning_rl.rl.off_policy`, docs/off_policy.md).
  max_completion_length: L of the Dr. GRPO aggregation (the generation budget); None = T.
  num_micro_batches: gradient accumulation within an update (m); also the size of the slices
    `prepare_batch`'s forwards run on (`reasoning_rl.rl.prepare_batch`).
  num_iterations: μ, epochs over each rollout batch against fixed π_old (GRPO's μ).
  num_mini_batches: M, optimizer updates per epoch, each on a disjoint 1/M of the rows; μ·M
    updates per batch in all. B must be divisible by M·m.
  logprob_chunk: time steps projected to the vocabulary at once (memory / speed trade-off).
  remat: what the backward pass recomputes, a name of `models.transformer.REMAT_POLICIES` (none,
    full: each block from its input, save_matmuls: all but the projections' outputs) or a bool
    (True = full): memory of one layer instead of all layers, for about one extra forward.
  packing: `TrainStep.host_batch` packs padded batches (`reasoning_rl.rl.packing`); the step
    itself takes either layout. packed_row_factor: k, packed rows k padded rows long.
  learning_rate, warmup_steps, total_steps, weight_decay, b1, b2, eps, max_grad_norm:
    AdamW (Loshchilov & Hutter 2019) with linear warm-up then cosine decay to
    `final_lr_fraction`·lr, after clipping the global gradient norm.
  vf_coef, value_clip, gamma, gae_lambda: PPO value loss weight, value clip ε_v, GAE γ and λ.
  routing_replay, moe_load_balance_coef, moe_router_z_coef: mixture-of-experts models: replay
    the batch's `recorded_experts` in the π_θ and π_old forwards (R3), and the weights of the
    router's auxiliary losses (`reasoning_rl.models.moe`); the routing metrics
    (`routing_metrics`) are logged for every MoE model.
  compute_dtype: the model's compute dtype: the sampler decodes with weights cast to it, and
    LoRA adapters (float32 masters) are cast to it for the forward pass; None = no casts.
  truncated_ratio: π_θ and π_old are the sampler's truncated, renormalised distribution π^W
    (`reasoning_rl.rl.step`'s docstring, docs/off_policy.md); padded batches must then carry
    each row's sampling settings (`reasoning_rl.rl.batching.TRUNCATION_FIELDS`), packed ones each
    head position's (`packing.HEAD_TRUNCATION_FIELDS`, which `host_batch` writes). A run sets it
    only where the rollout warps (`config.rollout_rescales`): elsewhere π^W = π exactly, and the
    full softmax is cheaper (no sort of the vocabulary).
  old_logprobs_from_sampler: the batch's behavior_logprobs are π_old itself, bit for bit
    (`rollout.exact_logprobs` with synchronous rollouts: the sampler reported the canonical
    forward's log-probs at these very weights, `reasoning_rl.sampler.exact`), so where the step
    needs π_old (μ·M > 1, PPO) it takes them instead of recomputing them.
  """

  # Not config fields: set by `build.step_config` from the stage, the rollout and the model.
  algorithm: str = "grpo"
  max_completion_length: int | None = None
  lora: Any = None  # reasoning_rl.lora.LoraSettings when training adapters; None = all weights
  compute_dtype: str | None = None
  truncated_ratio: bool = False  # config.algo.truncated_ratio, applied when the rollout warps
  old_logprobs_from_sampler: bool = False  # rollout.exact_logprobs with synchronous rollouts
  # The config's own fields, same names and defaults (reasoning_rl/config_schema.py).
  loss_type: str = sourced("algo.loss_type")
  beta: float = sourced("beta")
  kl_estimator: str = sourced("algo.kl_estimator")
  epsilon_low: float = sourced("algo.epsilon_low")
  epsilon_high: float = sourced("algo.epsilon_high")
  dual_clip: float | None = sourced("algo.dual_clip")
  loss_agg: str = sourced("algo.loss_agg")
  entropy_coef: float = sourced("algo.entropy_coef")
  is_correction: str = sourced("algo.is_correction")
  is_threshold: float = sourced("algo.is_threshold")
  is_threshold_low: float = sourced("algo.is_threshold_low")
  icepop_low: float = sourced("algo.icepop_low")
  icepop_high: float = sourced("algo.icepop_high")
  rejection: str = sourced("algo.rejection")
  rejection_geo_low: float = sourced("algo.rejection_geo_low")
  rejection_geo_high: float = sourced("algo.rejection_geo_high")
  rejection_k3_threshold: float = sourced("algo.rejection_k3_threshold")
  num_micro_batches: int = sourced("algo.num_micro_batches", default=1)
  num_iterations: int = sourced("algo.num_iterations")
  num_mini_batches: int = sourced("algo.num_mini_batches")
  logprob_chunk: int = sourced("algo.logprob_chunk")
  remat: bool | str = sourced("algo.remat")
  packing: bool = sourced("algo.packing", default=False)
  packed_row_factor: int = sourced("algo.packed_row_factor", default=1)
  shared_prompts: bool = sourced("algo.shared_prompts", default=False)
  learning_rate: float = sourced("optim.learning_rate")
  warmup_steps: int = sourced("optim.warmup_steps")
  total_steps: int = sourced("total_steps")
  final_lr_fraction: float = sourced("optim.final_lr_fraction")
  weight_decay: float = sourced("optim.weight_decay")
  b1: float = sourced("optim.b1")
  b2: float = sourced("optim.b2")
  eps: float = sourced("optim.eps")
  max_grad_norm: float = sourced("optim.max_grad_norm")
  vf_coef: float = sourced("algo.vf_coef")
  value_clip: float = sourced("algo.value_clip")
  gamma: float = sourced("algo.gamma")
  gae_lambda: float = sourced("algo.gae_lambda")
  routing_replay: bool = sourced("algo.routing_replay")
  moe_load_balance_coef: float = sourced("algo.moe_load_balance_coef")
  moe_router_z_coef: float = sourced("algo.moe_router_z_coef")

  def __post_init__(self):
    if self.algorithm not in ("grpo", "ppo", "sft"):
      raise ConfigError(f"algorithm={self.algorithm!r}: use 'grpo', 'ppo' or 'sft'")
    for name in ("num_micro_batches", "num_iterations", "num_mini_batches", "logprob_chunk",
                 "packed_row_factor",
                 "total_steps"):
      if getattr(self, name) < 1:
        raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
    for choices, name in ((registries.LOSS_AGGREGATIONS, self.loss_agg),
                          (registries.KL_ESTIMATORS, self.kl_estimator),
                          (registries.LOSS_TYPES, self.loss_type),
                          (registries.IS_CORRECTIONS, self.is_correction),
                          (registries.OFF_POLICY_REJECTIONS, self.rejection)):
      choices.get(name)
    self._check_loss_type_and_correction()

  def _check_loss_type_and_correction(self):
    if not self.is_threshold > 0:
      raise ConfigError(f"config.algo.is_threshold={self.is_threshold!r} must be > 0 (the bound "
                        "C of the sampler importance weight)")
    if not 0 <= self.is_threshold_low < self.is_threshold:
      raise ConfigError(f"config.algo.is_threshold_low={self.is_threshold_low!r} must be in [0, "
                        f"config.algo.is_threshold={self.is_threshold!r}): the floor of the "
                        "truncated weight lies below its ceiling")
    if not 0 <= self.icepop_low < self.icepop_high:
      raise ConfigError(f"config.algo.icepop_low={self.icepop_low!r} must be in [0, "
                        f"config.algo.icepop_high={self.icepop_high!r}): IcePop keeps the band "
                        "[low, high] (Ring-1T: 0.5, 5)")
    if not 0 < self.rejection_geo_low <= 1 <= self.rejection_geo_high:
      raise ConfigError(f"config.algo.rejection_geo_low={self.rejection_geo_low!r} must be in "
                        "(0, 1] and config.algo.rejection_geo_high="
                        f"{self.rejection_geo_high!r} >= 1 (a band around ratio 1)")
    if not self.rejection_k3_threshold > 0:
      raise ConfigError(f"config.algo.rejection_k3_threshold={self.rejection_k3_threshold!r} "
                        "must be > 0")
    if self.algorithm == "ppo" and self.loss_type == "gspo":
      raise ConfigError("config.algo.loss_type='gspo' needs one advantage per sequence, but "
                        "algorithm 'ppo' (GAE) gives one per token: use 'gspo-token'")
    if self.loss_type in NO_DUAL_CLIP and self.dual_clip is not None:
      raise ConfigError(f"config.algo.dual_clip={self.dual_clip!r} does not apply to "
                        f"config.algo.loss_type={self.loss_type!r} (no clipped ratio in its "
                        "loss): set it to None")

  def sampler_correction(self, has_behavior_logprobs: bool) -> tuple[str, float]:
    """(mode, threshold C) of the importance correction for a batch with / without the sampler's
    log-probs (a batch without them while a correction or a rejection is asked for is an
    error)."""
    if self.rejection != "none" and not has_behavior_logprobs:
      raise ConfigError(
          f"config.algo.rejection={self.rejection!r} needs the sampler's log-probs, but the "
          "batch has no behavior_logprobs [B, T]: the trainer must attach them whenever "
          "rejection != 'none'")
    if self.is_correction != "none":
      if not has_behavior_logprobs:
        raise ConfigError(
            f"config.algo.is_correction={self.is_correction!r} needs the sampler's log-probs, "
            "but the batch has no behavior_logprobs [B, T]: the trainer must attach them "
            "whenever is_correction != 'none'")
      return self.is_correction, self.is_threshold
    return "none", self.is_threshold

  def truncation(self, batch) -> tuple | None:
    """The sampling settings the log-probs are truncated with, or None (full softmax): with
    `truncated_ratio`, a padded batch must carry each row's, a packed one each head position's
    (`host_batch`); a packed batch without them is read with the full softmax."""
    if not self.truncated_ratio or self.algorithm == "sft":
      return None
    fields = truncation_fields(batch)
    missing = [name for name in fields if name not in batch]
    if missing and packing.is_packed(batch):
      return None
    if missing:
      raise ConfigError(
          f"config.algo.truncated_ratio=True needs each row's sampling settings, but the batch "
          f"has no {', '.join(missing)} [B]: build it with batching.build_batch(..., "
          "truncation=True), or set algo.truncated_ratio=False")
    return tuple(batch[name] for name in fields)

  @property
  def trains_adapters(self) -> bool:
    return self.lora is not None and self.lora.enabled

  @property
  def updates_per_step(self) -> int:
    """Optimizer updates per rollout batch: μ epochs × M mini-batches."""
    return self.num_iterations * self.num_mini_batches

  @property
  def needs_old_logprobs(self) -> bool:
    """Whether the updates read π_old log-probs other than their own forward's: with more than
    one update per batch, or ppo (its old values come from the same forward)."""
    return self.algorithm != "sft" and (self.updates_per_step > 1 or self.algorithm == "ppo")

  def check_packed_slices(self, num_slices: int):
    """A packed batch comes in M·m slices (`reasoning_rl.rl.packing.pack_batch`)."""
    expected = self.num_mini_batches * self.num_micro_batches
    if num_slices != expected:
      raise ConfigError(
          f"the packed batch has {num_slices} slices but the step makes config.algo."
          f"num_mini_batches × num_micro_batches = {expected}: pack it with the step's M and m")

  def check_batch_size(self, batch_size: int):
    """The batch must split into M mini-batches of m micro-batches of whole rows."""
    slices = self.num_mini_batches * self.num_micro_batches
    if batch_size % slices:
      raise ConfigError(
          f"config.algo.num_mini_batches={self.num_mini_batches} × "
          f"config.algo.num_micro_batches={self.num_micro_batches} = {slices} must divide the "
          f"batch of {batch_size} rows (prompts × samples): change either so that it does")


def truncation_fields(batch) -> tuple[str, ...]:
  """Where a batch holds its sampling settings: per row (padded) or per head position (packed)."""
  return packing.HEAD_TRUNCATION_FIELDS if packing.is_packed(batch) else TRUNCATION_FIELDS
