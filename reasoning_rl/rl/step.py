"""The fused, jit-sharded RL training step.

`TrainStep.__call__(state, batch) -> (state, stats)` is ONE compiled program on the trainer mesh
(`TrainStep.call_with_outputs` also returns what the step derived from the batch, `outputs`): it
computes the policy's completion log-probs and — when β > 0 — the frozen reference's, the policy
loss (`loss_type`: PPO's clipped surrogate, GSPO or CISPO) with its KL term and importance
correction against the sampler (`reasoning_rl.rl.losses.policy_loss`), gradients accumulated over
micro-batches, and the optax updates: μ epochs over the batch, each a sequence of
`num_mini_batches` updates on disjoint slices of rows, all against the same π_old log-probs. State
buffers are donated, so parameters and optimizer moments are updated in place.

Three objectives share it:
- `grpo` (and every group estimator): advantages [B] come with the batch.
- `ppo` (Schulman et al. 2017) with a learned value head on the policy trunk: the step computes
  π_old log-probs and old values, GAE(γ, λ) advantages (Schulman et al. 2016) from the sequence
  rewards, and adds the clipped value loss (`reasoning_rl.rl.value`). The whitened per-token
  advantages every update used come back as `outputs["token_advantages"]`, in the batch's layout
  ([B, T] padded; packed: [N, S, T] sequence slots, `packing.unpack_sequences` maps them back), so
  the rollout records show what was trained on. The other objectives return no outputs: nothing
  more leaves the device.
- `sft`: supervised fine-tuning for the R1 recipe's SFT stages — next-token cross-entropy on the
  completion tokens only (the prompt is context, never a target), aggregated like the policy loss.

Batch layout (all leading dimension B, sharded over the mesh's data × fsdp axes):
  tokens, attention_mask [B, P + T] — prompt left-padded to P, completion right-padded to T;
  completion_mask [B, T]; advantages [B] (grpo) or rewards [B] (ppo);
  behavior_logprobs [B, T] — the sampler's log-probs; required when `is_correction` != "none"
  (optional otherwise: then only the sampler/trainer mismatch is reported);
  with `truncated_ratio`: sampling_temperature, sampling_top_p, sampling_min_p [B] float32 and
  sampling_top_k [B] int32, each row's sampling settings, and behavior_logprobs are then the
  sampler's log-probs under the distribution it drew from (its `sampling_logprobs`).
Or the packed layout of `reasoning_rl.rl.packing.pack_batch` (padding-free: sequences packed into
rows with segment ids, micro-batches of a fixed token budget, those past a mini-batch's packed rows
skipped, the vocabulary head only at completion tokens): the same mini-batches, so the same loss
and gradients as the padded batch it came from, with the padded batch's activation memory.

π_old is always the trainer's own recomputation with the parameters the batch arrives with: with
more than one update per batch (μ > 1 or num_mini_batches > 1) or ppo, `_prepare` computes it once
per batch, before the first update (whose ratio is therefore exactly 1); with a single update, that
update runs at exactly those parameters, so its own forward, held constant, is that recomputation
(no extra pass). The sampler's log-probs never stand in for π_old; they only enter the importance
weight exp(logp_old - logp_behavior).

Truncated ratio (`truncated_ratio`, docs/off_policy.md): the sampler draws from π^W, the model's
distribution after temperature and top-k / top-p / min-p, renormalised. With the switch on, every
log-prob the step computes for the ratio — π_θ and π_old — is log π^W, rebuilt on the trainer's
logits with each row's settings (`reasoning_rl.sampler.sampling.truncated_logprobs`), so the
ratio π_θ^W/π_old^W and the sampler weight π_old^W/μ^W compare distributions over the same
support: the importance ratio is exact (under the support condition of docs/off_policy.md) for
the policy the sampler actually runs. With it off, the full-softmax ratio is used; it is exact
only when the sampler draws from the model's own distribution (T = 1, no filters). The reference
log-probs (KL) and the entropy stay full-softmax. Stats: `mismatch/full/abs_log_diff` and
`mismatch/full/ratio/max` (|log π^full − log μ^W| and max π^full/μ^W, what the full-softmax
ratio assumes the sampler did against what it did) and `mismatch/truncated/...` (the same with
π^W), on the update's own forward (at π_old on the first update).

Memory: `_prepare`'s forwards (π_old, reference, ppo's old values) run one micro-batch at a time,
the same rows an update's micro-batch holds, and write into [B, T] arrays, so their activations
peak at one micro-batch's, as the update's do. Only GAE and the advantage whitening, which need
the whole batch's values, run on the assembled [B, T] arrays.

Updates per batch (the PPO recipe of Schulman et al. 2017: K epochs of minibatch SGD on the same
rollouts; GRPO's μ, Shao et al. 2024, arXiv:2402.03300, Algorithm 1): for each of μ epochs, for
mini-batch k = 0 … M-1 in that fixed order, one optimizer update on the rows k, k+M, k+2M, …
(strided, so every data-parallel device keeps a share of every mini-batch, as with micro-batches:
micro-batch j of mini-batch k holds rows k + M·j + M·m·s). Each update is a complete update on its
own slice: its loss normalizers (`losses.loss_normalizers`) are the mini-batch's, and its
micro-batch losses sum to the loss of that slice alone. B must be divisible by M·m.

Counters: `state.step` counts RL steps (batches), +1 per call. The learning-rate schedule counts
optimizer updates (optax's own count in the optimizer state, as TRL's trainer does), with
`warmup_steps` / `total_steps` given in RL steps and stretched by the μ·M updates per step, so a
schedule spans the same RL steps whatever μ and M are, and the rate also moves within a step.

Stats are merged over all μ·M updates (`reasoning_rl.rl.stats.merge`): `loss`, `grad_norm` and
`learning_rate` are means over updates (loss and grad norm over the applied ones), token stats such
as `clip_frac` or `ratio/max` cover every token of every update, and `skipped_update` is the
fraction of updates skipped. So with μ·M > 1, `clip_frac` mixes the first update (ratio 1, no
clipping) with later ones.

LoRA / QLoRA (`reasoning_rl.lora`, with `lora` set): `state.params` holds the adapters only, the
frozen base sits in `state.frozen_params`; gradients, AdamW moments and weight decay cover the
adapters alone, and with β > 0 the reference is the same model with zero adapters (the base
itself: no copy of the weights). Micro-batching, mini-batches, sharding and donation are as for
full fine-tuning.

Mixed precision (`reasoning_rl.precision`): the parameters and AdamW moments stay in the dtype
they arrive in (float32 master weights by default) while the model computes in its own dtype;
gradients are summed over micro-batches in float32 and the optimizer state keeps its dtypes from
update to update. `sampler_weights` hands the sampler the weights cast to `compute_dtype`. LoRA
adapters are float32 masters too, cast to `compute_dtype` where the forward pass reads them (the
model casts its own kernels; qwix's adapter product would otherwise promote the activations).

A non-finite loss or gradient norm skips the update (parameters and optimizer state unchanged) and
counts it in `state.skipped_updates` and the `skipped_update` stat; it is never applied. An update
over rows without a completion token (a batch left empty by dynamic sampling) is not applied
either, nor counted as skipped: AdamW would move the weights along its momentum with no data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from reasoning_rl import lora, precision, registry
from reasoning_rl import sharding as sharding_lib
from reasoning_rl.config_schema import sourced
from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import losses, packing
from reasoning_rl.rl import routing as routing_lib
from reasoning_rl.rl import stats as stats_lib
from reasoning_rl.rl import value as value_lib
from reasoning_rl.rl.logprobs import (TRUNCATION_FIELDS, completion_logprobs,
                                      packed_completion_logprobs)


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Options of the training step: a typed view of the config. Each field marked `sourced` IS the
  config field of that name (default from reasoning_rl/config_schema.py; `build.step_config`
  reads them all by that name, no copies); the five above them are derived from the stage, the
  rollout and the model.

  algorithm: "grpo" (advantages come with the batch), "ppo" (value head + GAE) or "sft"
    (cross-entropy on completion tokens; the batch needs no advantages).
  loss_type, beta, kl_estimator, epsilon_low, epsilon_high, dual_clip, loss_agg, entropy_coef,
    is_correction, is_threshold: as `reasoning_rl.rl.losses.policy_loss` (loss types: PPO,
    Schulman et al. 2017; GSPO, Zheng et al. 2025, arXiv:2507.18071; CISPO, MiniMax-M1,
    arXiv:2506.13585).
  max_completion_length: L of the Dr. GRPO aggregation (the generation budget); None = T.
  num_micro_batches: gradient accumulation within an update (m); also the size of the slices
    `_prepare`'s forwards run on.
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
    (module docstring, docs/off_policy.md); padded batches must then carry each row's sampling
    settings (`reasoning_rl.rl.batching.TRUNCATION_FIELDS`), packed ones each head position's
    (`packing.HEAD_TRUNCATION_FIELDS`, which `host_batch` writes). A run sets it only where the
    rollout warps (`config.rollout_rescales`): elsewhere π^W = π exactly, and the full softmax
    is cheaper (no sort of the vocabulary).
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
  num_micro_batches: int = sourced("algo.num_micro_batches", default=1)
  num_iterations: int = sourced("algo.num_iterations")
  num_mini_batches: int = sourced("algo.num_mini_batches")
  logprob_chunk: int = sourced("algo.logprob_chunk")
  remat: bool | str = sourced("algo.remat")
  packing: bool = sourced("algo.packing", default=False)
  packed_row_factor: int = sourced("algo.packed_row_factor")
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
    for choices, name in ((registry.LOSS_AGGREGATIONS, self.loss_agg),
                          (registry.KL_ESTIMATORS, self.kl_estimator),
                          (registry.LOSS_TYPES, self.loss_type),
                          (registry.IS_CORRECTIONS, self.is_correction)):
      choices.get(name)
    self._check_loss_type_and_correction()

  def _check_loss_type_and_correction(self):
    if not self.is_threshold > 0:
      raise ConfigError(f"config.algo.is_threshold={self.is_threshold!r} must be > 0 (the bound "
                        "C of the sampler importance weight)")
    if self.algorithm == "ppo" and self.loss_type == "gspo":
      raise ConfigError("config.algo.loss_type='gspo' needs one advantage per sequence, but "
                        "algorithm 'ppo' (GAE) gives one per token: use 'gspo-token'")
    if self.loss_type == "cispo" and self.dual_clip is not None:
      raise ConfigError(f"config.algo.dual_clip={self.dual_clip!r} does not apply to "
                        "config.algo.loss_type='cispo' (no ratio in its loss): set it to None")

  def sampler_correction(self, has_behavior_logprobs: bool) -> tuple[str, float]:
    """(mode, threshold C) of the importance correction for a batch with / without the sampler's
    log-probs (a batch without them while a correction is asked for is an error)."""
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


class TrainState(flax.struct.PyTreeNode):
  """Everything the step changes or reads, as pytrees (checkpointable as is)."""

  step: jax.Array
  params: Any  # nnx.State of the policy
  opt_state: Any
  skipped_updates: jax.Array
  value_head: Any = None  # {"kernel": [D], "bias": []} for ppo
  ref_params: Any = None  # frozen reference, only when beta > 0 (never with LoRA)
  frozen_params: Any = None  # LoRA: the frozen base (`params` then holds the adapters)


def learning_rate_schedule(config: StepConfig) -> optax.Schedule:
  """Linear warm-up to `learning_rate`, then cosine decay to `final_lr_fraction` of it.

  Indexed by optimizer updates; `warmup_steps` and `total_steps` are RL steps, each of
  `config.updates_per_step` updates (module docstring, "Counters").
  """
  per_step = config.updates_per_step
  warmup = config.warmup_steps * per_step
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else config.learning_rate,
      peak_value=config.learning_rate, warmup_steps=warmup,
      decay_steps=max(config.total_steps * per_step, warmup + 1),
      end_value=config.learning_rate * config.final_lr_fraction)


def applied_updates(opt_state) -> jax.Array:
  """Optimizer updates applied so far: the count the learning-rate schedule reads (skipped
  updates keep the old optimizer state, so they do not count)."""
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
  counts = [s.count for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
  if len(counts) != 1:
    raise ValueError(f"expected one schedule state in the optimizer state, found {len(counts)}")
  return counts[0]


def split_rows(tree, num_slices: int):
  """[B, ...] leaves → [num_slices, B / num_slices, ...]: slice i holds rows i, i+n, i+2n, …
  (strided, so a batch sharded over devices in row blocks keeps a share on every device)."""
  return jax.tree.map(
      lambda x: x.reshape(x.shape[0] // num_slices, num_slices, *x.shape[1:]).swapaxes(0, 1),
      tree)


def has_tokens(micro) -> jax.Array:
  """Whether a (packed) micro-batch holds any completion token."""
  return jnp.any(micro["completion_mask"] > 0)


def skipping_empty(forward, example):
  """`forward` of a packed micro-batch, or zeros (no compute, `lax.cond`) when it is empty."""
  shapes = jax.eval_shape(forward, example)
  nothing = lambda _: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  return lambda micro: jax.lax.cond(has_tokens(micro), forward, nothing, micro)


def slice_major(tree):
  """A packed batch's [rows, S, ...] leaves → [S, rows, ...] (one slice per leading index), and
  back."""
  return jax.tree.map(lambda x: x.swapaxes(0, 1), tree)


def merge_rows(tree):
  """Inverse of `split_rows`: [n, B / n, ...] → [B, ...] in the original row order."""
  return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)


def _no_stats(shapes) -> stats_lib.Stats:
  """The identity of `stats_lib.merge` for stats of these shapes (a scan's starting carry)."""
  out = {}
  for name, (value, count) in shapes.items():
    start = {"min": jnp.inf, "max": -jnp.inf, "sum": 0}[stats_lib.reduction_kind(name)]
    out[name] = (jnp.full(value.shape, start, value.dtype), jnp.zeros(count.shape, count.dtype))
  return out


def truncation_fields(batch) -> tuple[str, ...]:
  """Where a batch holds its sampling settings: per row (padded) or per head position (packed)."""
  return packing.HEAD_TRUNCATION_FIELDS if packing.is_packed(batch) else TRUNCATION_FIELDS


def _settings_to_pack(batch: dict, truncated_ratio: bool) -> dict:
  """The padded batch, for packing, with its sampling settings only where the step truncates
  (`truncated_ratio`, which a run turns on only under a rollout that warps). The choice follows
  the config, never the rows: a batch of a run always has the same arrays, or the compiled step
  would refuse the next one (a batch of fully masked rows, where dynamic sampling came up short,
  has no settings to read)."""
  if truncated_ratio or not all(name in batch for name in TRUNCATION_FIELDS):
    return batch
  return {k: v for k, v in batch.items() if k not in TRUNCATION_FIELDS}


def make_optimizer(config: StepConfig) -> optax.GradientTransformation:
  """Clipped AdamW over the trainable tree. Model variables that are not parameters (a
  `models.primitives.Buffer`, e.g. DeepSeek-V3's router selection bias) get a zero update:
  neither the gradient nor AdamW's weight decay moves them."""
  return optax.chain(
      optax.clip_by_global_norm(config.max_grad_norm),
      optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2,
                  eps=config.eps, weight_decay=config.weight_decay),
      optax.masked(optax.set_to_zero(), _not_parameters))


def _not_parameters(tree):
  """True at every model variable that is not an `nnx.Param` (the value head's plain arrays and
  every parameter, LoRA adapters included, are False)."""
  return jax.tree.map(lambda v: isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param),
                      tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


class TrainStep:
  """Builds the initial state and the compiled step for one model graph on one mesh."""

  def __init__(self, graphdef, config: StepConfig, mesh=None):
    self.graphdef = graphdef
    self.config = config
    self.mesh = mesh
    self.optimizer = make_optimizer(config)
    self._compiled = None
    self._to_sampler = None

  # ------------------------------------------------------------------------ state

  def init_state(self, params, *, ref_params=None) -> TrainState:
    """The step's state. Takes ownership of `params`: the step donates them, so keep no other
    reference to these buffers (copy first if the caller needs the initial weights, e.g. as the
    reference). With a mesh, parameters are placed on their partition-rule shardings."""
    c = self.config
    frozen = None
    if c.trains_adapters:

      params, frozen = lora.split_adapters(params)
      ref_params = None  # the reference is the base: zero adapters on the frozen weights
    elif c.beta > 0 and ref_params is None:
      raise ConfigError("beta > 0 needs the frozen reference: pass ref_params (a copy of the "
                        "initial policy parameters)")
    if self.mesh is not None:
      params = sharding_lib.reshard(params, sharding_lib.param_shardings(params, self.mesh))
      if frozen is not None:
        frozen = sharding_lib.reshard(frozen, sharding_lib.param_shardings(frozen, self.mesh))
      if ref_params is not None:
        ref_params = sharding_lib.reshard(
            ref_params, sharding_lib.param_shardings(ref_params, self.mesh))
    value_head = None
    trainable = {"policy": params}
    if c.algorithm == "ppo":
      width = (frozen if frozen is not None else params)["final_norm"]["scale"].shape[0]
      value_head = {"kernel": jnp.zeros((width,), jnp.float32), "bias": jnp.zeros((), jnp.float32)}
      trainable["value_head"] = value_head
    opt_state = self._init_optimizer(trainable)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                       skipped_updates=jnp.zeros((), jnp.int32), value_head=value_head,
                       ref_params=ref_params if c.beta > 0 else None, frozen_params=frozen)
    if self.mesh is None:
      return state
    # Scalars (step counters, optimizer counts) and the value head: replicated on the mesh.
    replicated = NamedSharding(self.mesh, PartitionSpec())
    on_mesh = lambda x: isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self.mesh  # noqa
    return jax.tree.map(lambda x: x if on_mesh(x) else jax.device_put(x, replicated), state)

  def _init_optimizer(self, trainable):
    """AdamW's state, each moment sharded like the parameter it belongs to.

    A plain `jit(optimizer.init)` puts the zeros it creates (they depend on no input's values)
    on one device, and the state would then be replicated on every device of the mesh: two full
    copies of the model per device instead of two shards of it.
    """
    if self.mesh is None:
      return jax.jit(self.optimizer.init)(trainable)
    replicated = NamedSharding(self.mesh, PartitionSpec())
    shardings = jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, NamedSharding)
        and x.sharding.mesh == self.mesh else replicated, trainable)
    abstract = jax.eval_shape(self.optimizer.init, trainable)
    out_shardings = optax.tree_utils.tree_map_params(
        self.optimizer, lambda _, sharding: sharding, abstract, shardings,
        transform_non_params=lambda _: replicated)
    return jax.jit(self.optimizer.init, out_shardings=out_shardings)(trainable)

  def host_batch(self, batch: dict, pad_id: int = 0) -> dict:
    """The host arrays this step is fed: the padded batch as is, or (`packing`) packed for this
    step's M and m, with row counts that divide over the mesh's data × fsdp devices."""
    return self.host_batch_with_layout(batch, pad_id)[0]

  def host_batch_with_layout(self, batch: dict, pad_id: int = 0
                             ) -> tuple[dict, packing.PackedLayout | None]:
    """`host_batch` and, when it packed, the layout that maps the packed sequence slots back to
    the padded rows (`packing.unpack_sequences`, for per-sequence outputs); None when padded."""
    if not self.config.packing:
      return batch, None
    batch = _settings_to_pack(batch, self.config.truncated_ratio
                              and self.config.algorithm != "sft")
    devices = 1
    if self.mesh is not None:
      devices = sharding_lib.batch_devices(self.mesh)
    c = self.config
    # The head projects as many positions at once as a padded micro-batch's chunk holds
    # (rows × min(logprob_chunk, completion length)): the same logits memory, and matmuls as
    # large. (A chunk longer than the completions would project positions no padded step does.)
    rows, width = batch["completion_mask"].shape
    padded_rows = rows // (c.num_mini_batches * c.num_micro_batches)
    return packing.pack_batch(batch, num_mini_batches=c.num_mini_batches,
                              num_micro_batches=c.num_micro_batches,
                              row_factor=c.packed_row_factor, row_groups=devices,
                              head_chunk=min(c.logprob_chunk, width)
                              * max(1, padded_rows // devices),
                              pad_id=pad_id)

  def state_shardings(self, state: TrainState):
    return jax.tree.map(lambda x: x.sharding, state)

  # ------------------------------------------------------------------------ the step

  def model(self, params, frozen_params=None):
    """The policy as a module: the full state, or (LoRA) the adapters on the frozen base."""
    if frozen_params is None:
      return nnx.merge(self.graphdef, params)
    if self.config.compute_dtype is not None:
      params = precision.cast_floating(params, self.config.compute_dtype)
    return nnx.merge(self.graphdef, frozen_params, params)

  def full_params(self, state: TrainState):
    """The whole policy state (base + adapters with LoRA)."""
    if state.frozen_params is None:
      return state.params

    return lora.join(state.params, state.frozen_params)

  def sampler_weights(self, state: TrainState):
    """What the sampler receives after a step: all parameters, cast to `compute_dtype` (a new
    copy on the trainer's devices; the master weights stay as they are); with LoRA the adapters
    alone (`lora.sampler_weights='adapters'`, the sampler keeps its copy of the base) or the plain
    model's weights with the adapters folded in ('merged'), also in `compute_dtype`."""
    c = self.config
    merges = c.trains_adapters and c.lora.sampler_weights == "merged"
    if not merges and (c.compute_dtype is None
                       or not precision.needs_cast(state.params, c.compute_dtype)):
      return state.params  # nothing to cast: the sampler copies the parameters themselves
    if self._to_sampler is None:
      self._to_sampler = jax.jit(self._sampler_copy)
    return self._to_sampler(state.params, state.frozen_params)

  def _sampler_copy(self, params, frozen_params):
    """The sampler's weights from the trainer's (traced by `sampler_weights`' jit)."""
    if self.config.trains_adapters and self.config.lora.sampler_weights == "merged":

      params = lora.merge_into_base(params, frozen_params, self.config.lora)
    if self.config.compute_dtype is None:
      return params
    return precision.cast_floating(params, self.config.compute_dtype)

  def _logprobs(self, model, micro, *, return_hidden=False, remat=False, truncation=None,
                routing=None):
    """Completion log-probs and entropies [N, T] of a padded or a packed micro-batch (with
    `truncation`, its sampling settings: log π^W, entropy, then the full-softmax log-probs;
    MoE models: `routing`, a `logprobs.RoutingInputs`)."""
    if packing.is_packed(micro):  # its head chunks come with it (`TrainStep.host_batch`)
      return packed_completion_logprobs(model, micro, return_hidden=return_hidden, remat=remat,
                                        truncation=truncation, routing=routing)
    return completion_logprobs(model, micro["tokens"], micro["attention_mask"],
                               micro["completion_mask"].shape[1],
                               chunk_size=self.config.logprob_chunk,
                               return_hidden=return_hidden, remat=remat, truncation=truncation,
                               routing=routing)

  def _policy_outputs(self, params, value_head, batch, frozen_params=None, *,
                      with_full=False, with_router_stats=False):
    """(logprobs, entropy, values or None) of the policy; the log-probs are π^W's with
    `truncated_ratio` (`StepConfig.truncation`). `with_full` appends the full-softmax log-probs
    (the same array when nothing is truncated), `with_router_stats` the forward's `RouterStats`
    (None for a dense model). A MoE policy replays the batch's recorded experts with
    `routing_replay` (`reasoning_rl.rl.routing`)."""
    model = self.model(params, frozen_params)
    truncation = self.config.truncation(batch)
    routing = routing_lib.forward_routing(
        model.config.moe is not None, batch, replay=self.config.routing_replay,
        with_stats=with_router_stats)
    out = self._logprobs(model, batch, return_hidden=value_head is not None,
                         remat=self.config.remat, truncation=truncation, routing=routing)
    router_stats = None
    if routing is not None and with_router_stats:
      out, router_stats = out[:-1], out[-1]
    logprobs, entropy = out[0], out[1]
    full = out[2] if truncation is not None else logprobs
    values = None
    if value_head is not None:
      values = out[-1].astype(jnp.float32) @ value_head["kernel"] + value_head["bias"]
    result = (logprobs, entropy, values) + ((full,) if with_full else ())
    return result + ((router_stats,) if with_router_stats else ())

  def _micro_loss(self, trainable, micro, normalizers, frozen_params=None):
    """Loss of one micro-batch. Without `old_logprobs` in the batch (μ = 1, GRPO), π_old is the
    current policy, so its log-probs are this forward's own, held constant (module docstring)."""
    c = self.config
    logprobs, entropy, values, full_logprobs, router_stats = self._policy_outputs(
        trainable["policy"], trainable.get("value_head"), micro, frozen_params, with_full=True,
        with_router_stats=True)
    router_loss, router_metrics = 0.0, {}
    if router_stats is not None:
      router_loss, router_metrics = routing_lib.auxiliary_loss_and_stats(
          router_stats, balance_coef=c.moe_load_balance_coef, z_coef=c.moe_router_z_coef,
          recorded=routing_lib.RECORDED_EXPERTS in micro)
    if c.algorithm == "sft":
      mask = micro["completion_mask"]
      loss = losses.aggregate_loss(-logprobs, mask, c.loss_agg,
                                   max_completion_length=c.max_completion_length, **normalizers)
      return loss + router_loss, {"nll": stats_lib.mean_stat(-logprobs, mask > 0),
                                  "entropy": stats_lib.mean_stat(entropy, mask > 0),
                                  **router_metrics}
    old_logprobs = micro.get("old_logprobs", jax.lax.stop_gradient(logprobs))
    behavior_logprobs = micro.get("behavior_logprobs")
    is_correction, is_threshold = c.sampler_correction(behavior_logprobs is not None)
    loss, stats = losses.policy_loss(
        logprobs, old_logprobs, micro["advantages"], micro["completion_mask"],
        loss_type=c.loss_type, ref_logprobs=micro.get("ref_logprobs"), beta=c.beta,
        kl_logprobs=full_logprobs, kl_estimator=c.kl_estimator, epsilon_low=c.epsilon_low,
        epsilon_high=c.epsilon_high,
        dual_clip=c.dual_clip, loss_agg=c.loss_agg, behavior_logprobs=behavior_logprobs,
        is_correction=is_correction, is_threshold=is_threshold, entropy=entropy,
        entropy_coef=c.entropy_coef, max_completion_length=c.max_completion_length,
        **normalizers)
    if c.truncated_ratio and behavior_logprobs is not None:
      stats = dict(stats, **losses.truncation_mismatch_stats(
          jax.lax.stop_gradient(full_logprobs), jax.lax.stop_gradient(logprobs),
          behavior_logprobs, micro["completion_mask"]))
    if values is not None:
      v_loss, v_stats = value_lib.value_loss(
          values, micro["old_values"], micro["returns"], micro["completion_mask"],
          clip_epsilon=c.value_clip, loss_agg=c.loss_agg,
          max_completion_length=c.max_completion_length, **normalizers)
      loss = loss + c.vf_coef * v_loss
      stats = stats_lib.merge(stats, v_stats)
    return loss + router_loss, dict(stats, **router_metrics)

  def _needs_old_logprobs(self) -> bool:
    c = self.config
    return c.algorithm != "sft" and (c.updates_per_step > 1 or c.algorithm == "ppo")

  def _old_logprobs_from_batch(self, batch) -> bool:
    """π_old is the sampler's behavior_logprobs (`StepConfig.old_logprobs_from_sampler`)."""
    if not (self.config.old_logprobs_from_sampler and self._needs_old_logprobs()):
      return False
    if "behavior_logprobs" not in batch:
      raise ConfigError("rollout.exact_logprobs: the step takes π_old from the sampler, but the "
                        "batch has no behavior_logprobs [B, T]: build it with "
                        "batching.build_batch(..., with_behavior_logprobs=True)")
    return True

  def _frozen_forwards(self, state: TrainState, batch, from_sampler: bool):
    """π_old log-probs, (ppo) old values and (β > 0) reference log-probs, [B, T] each, computed
    one micro-batch (the rows of one update's micro-batch) at a time; with `from_sampler`
    (`_old_logprobs_from_batch`) π_old is the batch's, and only PPO's old values are computed."""
    c = self.config
    # PPO still needs its old values from this forward; π_old itself then comes from the batch
    needs_old = self._needs_old_logprobs() and not (from_sampler and c.algorithm != "ppo")
    model_inputs = (("tokens", "positions", "segment_ids", "head_index", "head_targets",
                     "token_index") if packing.is_packed(batch) else ("tokens", "attention_mask"))
    if routing_lib.RECORDED_EXPERTS in batch:
      model_inputs += (routing_lib.RECORDED_EXPERTS,)
    inputs = {k: batch[k] for k in (*model_inputs, "completion_mask")}
    if c.truncation(batch) is not None:  # π_old truncated like π_θ: each row's settings
      inputs.update({k: batch[k] for k in truncation_fields(batch)})

    def forward(micro):
      out = {}
      if needs_old:
        logprobs, _, values = self._policy_outputs(state.params, state.value_head, micro,
                                                   state.frozen_params)
        out["old_logprobs"] = logprobs
        if values is not None:
          out["old_values"] = values
      if c.beta > 0:
        if state.frozen_params is not None:  # LoRA: the base, i.e. zero adapters

          ref_model = self.model(lora.zero_adapters(state.params), state.frozen_params)
        else:
          ref_model = nnx.merge(self.graphdef, state.ref_params)
        out["ref_logprobs"], _ = self._logprobs(ref_model, micro)
      return out

    if not (needs_old or c.beta > 0):
      return {}
    num_slices = c.num_mini_batches * c.num_micro_batches
    if packing.is_packed(batch):  # already in slices: [rows, S, ...] → [S, rows, ...]
      slices = slice_major(inputs)
      out = jax.lax.map(skipping_empty(forward, jax.tree.map(lambda x: x[0], slices)), slices)
      out = slice_major(out)  # back to [rows, S, ...]
    elif num_slices == 1:
      out = forward(inputs)
    else:  # lax.map runs the slices one after another: one slice's activations live at a time
      out = merge_rows(jax.lax.map(forward, split_rows(inputs, num_slices)))
    return jax.tree.map(jax.lax.stop_gradient, out)

  def _prepare(self, state: TrainState, batch):
    """Adds π_old log-probs, reference log-probs and (ppo) GAE targets to the batch."""
    c = self.config
    if c.algorithm != "sft":  # fails at trace time, before any compute, if the batch lacks them
      c.sampler_correction("behavior_logprobs" in batch)
    if packing.is_packed(batch):
      c.check_packed_slices(batch["tokens"].shape[1])
    else:
      c.check_batch_size(batch["completion_mask"].shape[0])
    from_sampler = self._old_logprobs_from_batch(batch)
    batch = dict(batch, **self._frozen_forwards(state, batch, from_sampler))
    if from_sampler:
      batch["old_logprobs"] = batch["behavior_logprobs"]
    if c.algorithm == "ppo":
      # GAE per sequence and whitening over every sequence: on [B, T], whatever the layout.
      shape = batch["completion_mask"].shape
      flat = lambda x: x.reshape(-1, *x.shape[len(shape) - 1:])
      mask = flat(batch["completion_mask"])
      token_rewards = value_lib.sequence_rewards_to_tokens(
          batch["rewards"].reshape(-1), mask)
      advantages, returns = value_lib.gae_advantages(
          token_rewards, flat(batch["old_values"]), mask, gamma=c.gamma, lam=c.gae_lambda)
      batch["advantages"] = value_lib.masked_whiten(advantages, mask).reshape(shape)
      batch["returns"] = returns.reshape(shape)
    return batch

  def _update(self, state: TrainState, batch, normalizers):
    """One optimizer update over `batch` (one mini-batch; micro-batched gradient accumulation)."""
    c = self.config
    trainable = {"policy": state.params}
    if state.value_head is not None:
      trainable["value_head"] = state.value_head
    grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

    def micro_grads(micro):
      return grad_fn(trainable, micro, normalizers, state.frozen_params)

    m = c.num_micro_batches
    packed = packing.is_packed(batch)
    if m == 1:
      (loss, stats), grads = micro_grads(
          jax.tree.map(lambda x: x[0], batch) if packed else batch)
    else:
      # Packed: the m micro-batches are the leading axis already. Padded: strided rows, so every
      # device keeps a share of each micro-batch.
      micro_batches = batch if packed else split_rows(batch, m)

      def accumulate(carry, micro):
        loss_sum, grads_sum, stats_sum = carry
        (loss, stats), grads = micro_grads(micro)
        # float32 sums whatever the weights' dtype: m bfloat16 additions would round each
        # micro-batch's share (precision.py)
        return (loss_sum + loss,
                jax.tree.map(lambda total, g: total + g.astype(total.dtype), grads_sum, grads),
                stats_lib.merge(stats_sum, stats)), None

      # Every micro-batch inside one loop, from a zero carry (0 + g is exactly g): a micro-batch
      # computed outside the loop is independent of it, and XLA's scheduler may then run its
      # forward next to the loop's, keeping two micro-batches' activations alive (measured:
      # with 2 micro-batches the step held as much as with 1).
      (loss_shape, stats_shape), grads_shape = jax.eval_shape(
          micro_grads, jax.tree.map(lambda x: x[0], micro_batches))
      start = (jnp.zeros(loss_shape.shape, loss_shape.dtype),
               jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.promote_types(g.dtype, jnp.float32)),
                            grads_shape),
               _no_stats(stats_shape))
      if packed:
        # Packed micro-batches fill from the first; those past the mini-batch's packed rows hold
        # nothing and are not run at all: a loop of as many trips as micro-batches with tokens.
        # (Not a lax.cond per micro-batch: its branches hand back a fresh gradient-sized buffer
        # to add to the carry, where the loop body accumulates in place.)
        used = jnp.sum(jnp.any(micro_batches["completion_mask"] > 0, axis=(1, 2)))

        def body(index, carry):
          micro = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False),
                               micro_batches)
          return accumulate(carry, micro)[0]

        loss, grads, stats = jax.lax.fori_loop(0, used, body, start)
      else:
        (loss, grads, stats), _ = jax.lax.scan(accumulate, start, micro_batches)

    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # An update over no completion token (dynamic sampling came back with no group of mixed
    # rewards) is not applied either: AdamW would still move every weight along its momentum.
    applied = finite & jnp.any(batch["completion_mask"] > 0)
    safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
    updates, new_opt_state = self.optimizer.update(safe_grads, state.opt_state, trainable)
    # float32 gradients meeting bfloat16 moments promote them: keep each leaf's dtype (the
    # state's dtypes are fixed for the compiled, donated step)
    new_opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_opt_state,
                                 state.opt_state)
    new_trainable = optax.apply_updates(trainable, updates)  # in each parameter's dtype
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(applied, a, b), new, old)  # noqa
    new_state = state.replace(
        params=keep(new_trainable["policy"], state.params),
        value_head=(keep(new_trainable["value_head"], state.value_head)
                    if state.value_head is not None else None),
        opt_state=keep(new_opt_state, state.opt_state),
        skipped_updates=state.skipped_updates + (~finite).astype(jnp.int32))
    one = jnp.ones((), jnp.int32)
    stats = dict(stats)
    stats["loss"] = (jnp.where(finite, loss, 0.0), finite.astype(jnp.int32))
    stats["grad_norm"] = (jnp.where(finite, grad_norm, 0.0), finite.astype(jnp.int32))
    stats["skipped_update"] = ((~finite).astype(jnp.float32), one)
    learning_rate = learning_rate_schedule(c)(applied_updates(state.opt_state))
    stats["learning_rate"] = (jnp.asarray(learning_rate, jnp.float32), one)
    return new_state, stats

  def _update_on(self, state: TrainState, rows):
    """A full update on `rows` alone: the loss normalizers are theirs (module docstring)."""
    return self._update(state, rows, losses.loss_normalizers(rows["completion_mask"]))

  def _step(self, state: TrainState, batch):
    """(state, stats, outputs) of one RL step; `outputs` (module docstring) is empty but for ppo,
    so the other objectives' programs hand nothing more back to the host."""
    c = self.config
    packed = packing.is_packed(batch)
    batch = self._prepare(state, batch)
    # The advantages every update of this step reads, in the batch's own layout.
    outputs = {"token_advantages": batch["advantages"]} if c.algorithm == "ppo" else {}
    if packed:  # [S, ...] slices → [M, m, ...]: mini-batch k's micro-batches
      batch = jax.tree.map(
          lambda x: x.reshape(c.num_mini_batches, c.num_micro_batches, *x.shape[1:]),
          slice_major(batch))
      if c.updates_per_step == 1:
        batch = jax.tree.map(lambda x: x[0], batch)
    experts_per_token = self._experts_per_token(state)
    if c.updates_per_step == 1:
      state, stats = self._update_on(state, batch)
      stats = routing_lib.summarize_expert_load(stats, experts_per_token)
      return state.replace(step=state.step + 1), stats, outputs
    mini_batches = batch if packed else split_rows(batch, c.num_mini_batches)

    def update(carry, index):
      state, stats = carry
      state, new_stats = self._update_on(state, jax.tree.map(lambda x: x[index], mini_batches))
      return (state, stats_lib.merge(stats, new_stats)), None

    # Update e·M + k works on mini-batch k in epoch e: μ passes over mini-batches 0 … M-1.
    order = jnp.tile(jnp.arange(c.num_mini_batches, dtype=jnp.int32), c.num_iterations)
    shapes = jax.eval_shape(lambda s: update((s, {}), order[0])[0][1], state)
    (state, stats), _ = jax.lax.scan(update, (state, _no_stats(shapes)), order)
    stats = routing_lib.summarize_expert_load(stats, experts_per_token)
    return state.replace(step=state.step + 1), stats, outputs

  def _experts_per_token(self, state: TrainState) -> int:
    """k of the policy's sparse layers (0 for a dense model), read off its static config."""
    model = nnx.merge(self.graphdef, state.params) if state.frozen_params is None else \
        self.model(state.params, state.frozen_params)
    return model.config.moe.experts_per_token if model.config.moe is not None else 0

  def _step_on_mesh(self, state: TrainState, batch):
    """`_step` traced under the trainer mesh, so the model's activation pins
    (`sharding.constrain`) apply."""
    if self.mesh is None:
      return self._step(state, batch)
    with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
      return self._step(state, batch)

  def compile(self, state: TrainState, batch_example):
    """jit with explicit in/out shardings on the trainer mesh (state donated)."""
    state_shardings = self.state_shardings(state)
    if self.mesh is not None:
      batch_shardings = jax.tree.map(
          lambda x: sharding_lib.batch_sharding(self.mesh, x.ndim), batch_example)
      replicated = NamedSharding(self.mesh, PartitionSpec())
      # outputs replicated like the stats: every process of a multi-process run can read them
      out = (state_shardings, replicated, replicated)
    else:
      batch_shardings = None
      out = (state_shardings, None, None)
    self._compiled = jax.jit(self._step_on_mesh, in_shardings=(state_shardings, batch_shardings),
                             out_shardings=out, donate_argnums=(0,))
    return self._compiled

  def __call__(self, state: TrainState, batch):
    """(new state, stats) of one step on `batch`."""
    return self.call_with_outputs(state, batch)[:2]

  def call_with_outputs(self, state: TrainState, batch):
    """(new state, stats, outputs): `outputs` as the module docstring says (ppo's
    `token_advantages`, still on the device; {} for the other objectives)."""
    if self._compiled is None:
      self.compile(state, batch)
    if self.mesh is not None:
      batch = jax.device_put(
          batch, jax.tree.map(lambda x: sharding_lib.batch_sharding(self.mesh, x.ndim), batch))
    return self._compiled(state, batch)
