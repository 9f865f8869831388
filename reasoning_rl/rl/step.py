"""The fused, jit-sharded RL training step: the composition of its parts into one program.

`TrainStep.__call__(state, batch) -> (state, stats)` is ONE compiled program on the trainer mesh
(`TrainStep.call_with_outputs` also returns what the step derived from the batch, `outputs`): it
computes the policy's completion log-probs and — when β > 0 — the frozen reference's, the policy
loss (`loss_type`: PPO's clipped surrogate, GSPO, CISPO or DPPO) with its KL term and importance
correction against the sampler (`reasoning_rl.rl.losses.policy_loss`), gradients accumulated over
micro-batches, and the optax updates: μ epochs over the batch, each a sequence of
`num_mini_batches` updates on disjoint slices of rows, all against the same π_old log-probs. State
buffers are donated, so parameters and optimizer moments are updated in place.

Its parts, one file each under reasoning_rl/rl/:
  step_config.py     `StepConfig`, the step's options, and the checks on them and on batches;
  train_state.py     `TrainState`, what the step carries from call to call;
  host_batch.py      the host arrays the step is fed (padded, or packed for its layout);
  policy_forward.py  the policy's forward: log-probs (π^W with `truncated_ratio`), values;
  prepare_batch.py   π_old, reference log-probs and ppo's GAE targets, before the updates;
  update.py          one optimizer update: micro-batch loss, accumulation, skip guard;
  batch_slices.py    how a batch is cut into mini- and micro-batches;
  optimizer.py       clipped AdamW and its learning-rate schedule;
  sampler_weights.py the weights handed to the sampler after a step.

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

π_old is the trainer's own recomputation at the parameters the batch arrives with, computed once
per batch before the first update where more than one update reads it (`reasoning_rl.rl.
prepare_batch`, which also says what its forwards hold in memory).

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

Updates per batch (the PPO recipe of Schulman et al. 2017: K epochs of minibatch SGD on the same
rollouts; GRPO's μ, Shao et al. 2024, arXiv:2402.03300, Algorithm 1): for each of μ epochs, for
mini-batch k = 0 … M-1 in that fixed order, one optimizer update on the rows k, k+M, k+2M, …
(strided, so every data-parallel device keeps a share of every mini-batch, as with micro-batches:
micro-batch j of mini-batch k holds rows k + M·j + M·m·s). Each update is a complete update on its
own slice: its loss normalizers (`losses.loss_normalizers`) are the mini-batch's, and its
micro-batch losses sum to the loss of that slice alone. B must be divisible by M·m.

Counters: `state.step` counts RL steps (batches), +1 per call; the learning-rate schedule counts
optimizer updates (`reasoning_rl.rl.optimizer`).

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
they arrive in (float32 master weights by default) while the model computes in its own dtype
(`update.py` says how gradients are summed, `policy_forward.py` how LoRA adapters are cast);
`sampler_weights` hands the sampler the weights cast to `compute_dtype`.

A non-finite loss or gradient norm skips an update, and an update over rows without a completion
token is not applied (`reasoning_rl.rl.update`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from reasoning_rl import lora
from reasoning_rl import sharding as sharding_lib
from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import packing
from reasoning_rl.rl import routing as routing_lib
from reasoning_rl.rl import stats as stats_lib
from reasoning_rl.rl.batch_slices import slice_major, split_rows
from reasoning_rl.rl.host_batch import host_batch_with_layout
from reasoning_rl.rl.optimizer import init_optimizer_state, make_optimizer
from reasoning_rl.rl.policy_forward import PolicyForward
from reasoning_rl.rl.prepare_batch import prepare_batch
from reasoning_rl.rl.sampler_weights import SamplerWeights
from reasoning_rl.rl.step_config import StepConfig
from reasoning_rl.rl.train_state import TrainState
from reasoning_rl.rl.update import no_stats, update_on_rows


class TrainStep:
  """Builds the initial state and the compiled step for one model graph on one mesh."""

  def __init__(self, graphdef, config: StepConfig, mesh=None, *, sampler_quantizer=None):
    """`sampler_quantizer`: the `sampler.quantized.WeightQuantizer` that makes the sampler's
    weights (`rollout.weight_quantization`), or None for float ones."""
    self.graphdef = graphdef
    self.config = config
    self.mesh = mesh
    self.forward = PolicyForward(graphdef, config)
    self.optimizer = make_optimizer(config)  # read when the state is made and the step traced
    self._compiled = None
    self._sampler_weights = SamplerWeights(config, sampler_quantizer)

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
    opt_state = init_optimizer_state(self.optimizer, trainable, self.mesh)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                       skipped_updates=jnp.zeros((), jnp.int32), value_head=value_head,
                       ref_params=ref_params if c.beta > 0 else None, frozen_params=frozen)
    if self.mesh is None:
      return state
    # Scalars (step counters, optimizer counts) and the value head: replicated on the mesh.
    replicated = NamedSharding(self.mesh, PartitionSpec())
    on_mesh = lambda x: isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self.mesh  # noqa
    return jax.tree.map(lambda x: x if on_mesh(x) else jax.device_put(x, replicated), state)

  def host_batch(self, batch: dict, pad_id: int = 0) -> dict:
    """The host arrays this step is fed: the padded batch as is, or (`packing`) packed for this
    step's M and m, with row counts that divide over the mesh's data × fsdp devices."""
    return self.host_batch_with_layout(batch, pad_id)[0]

  def host_batch_with_layout(self, batch: dict, pad_id: int = 0
                             ) -> tuple[dict, packing.PackedLayout | None]:
    """`host_batch` and, when it packed, the layout that maps the packed sequence slots back to
    the padded rows (`packing.unpack_sequences`, for per-sequence outputs); None when padded."""
    return host_batch_with_layout(self.config, batch, mesh=self.mesh, pad_id=pad_id)

  def state_shardings(self, state: TrainState):
    return jax.tree.map(lambda x: x.sharding, state)

  def full_params(self, state: TrainState):
    """The whole policy state (base + adapters with LoRA)."""
    if state.frozen_params is None:
      return state.params
    return lora.join(state.params, state.frozen_params)

  def sampler_weights(self, state: TrainState):
    """What the sampler receives after a step (`reasoning_rl.rl.sampler_weights`)."""
    return self._sampler_weights(state.params, state.frozen_params)

  # ------------------------------------------------------------------------ the step

  def _prepare(self, state: TrainState, batch):
    """The batch with what the updates read added (`prepare_batch.prepare_batch`)."""
    return prepare_batch(self.forward, state, batch)

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
    experts_per_token = self.forward.experts_per_token(state.params, state.frozen_params)
    if c.updates_per_step == 1:
      state, stats = update_on_rows(self.forward, self.optimizer, state, batch)
      stats = routing_lib.summarize_expert_load(stats, experts_per_token)
      return state.replace(step=state.step + 1), stats, outputs
    mini_batches = batch if packed else split_rows(batch, c.num_mini_batches)

    def update(carry, index):
      state, stats = carry
      state, new_stats = update_on_rows(self.forward, self.optimizer, state,
                                        jax.tree.map(lambda x: x[index], mini_batches))
      return (state, stats_lib.merge(stats, new_stats)), None

    # Update e·M + k works on mini-batch k in epoch e: μ passes over mini-batches 0 … M-1.
    order = jnp.tile(jnp.arange(c.num_mini_batches, dtype=jnp.int32), c.num_iterations)
    shapes = jax.eval_shape(lambda s: update((s, {}), order[0])[0][1], state)
    (state, stats), _ = jax.lax.scan(update, (state, no_stats(shapes)), order)
    stats = routing_lib.summarize_expert_load(stats, experts_per_token)
    return state.replace(step=state.step + 1), stats, outputs

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
