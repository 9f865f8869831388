"""What the step adds to a batch before its updates: π_old, the reference, PPO's GAE targets.

π_old is always the trainer's own recomputation with the parameters the batch arrives with: with
more than one update per batch (μ > 1 or num_mini_batches > 1) or ppo, `prepare_batch` computes
it once per batch, before the first update (whose ratio is therefore exactly 1); with a single
update, that update runs at exactly those parameters, so its own forward, held constant, is that
recomputation (no extra pass, `reasoning_rl.rl.update`). The sampler's log-probs stand in for it
only where they are the same numbers bit for bit (`StepConfig.old_logprobs_from_sampler`);
otherwise they only enter the importance weight exp(logp_old - logp_behavior).

ppo (Schulman et al. 2017): the step's value head gives the old values in the same forward, then
GAE(γ, λ) advantages (Schulman et al. 2016) from the sequence rewards, whitened over the batch,
and the value targets (`reasoning_rl.rl.value`).

Memory: the forwards (π_old, reference, ppo's old values) run one micro-batch at a time, the same
rows an update's micro-batch holds, and write into [B, T] arrays, so their activations peak at
one micro-batch's, as the update's do. Only GAE and the advantage whitening, which need the whole
batch's values, run on the assembled [B, T] arrays.
"""

from __future__ import annotations

import jax
from flax import nnx

from reasoning_rl import lora
from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import packing
from reasoning_rl.rl import routing as routing_lib
from reasoning_rl.rl import value as value_lib
from reasoning_rl.rl.batch_slices import merge_rows, skipping_empty, slice_major, split_rows
from reasoning_rl.rl.policy_forward import OLD_KEPT, PolicyForward
from reasoning_rl.rl.step_config import StepConfig, truncation_fields
from reasoning_rl.rl.train_state import TrainState


def prepare_batch(forward: PolicyForward, state: TrainState, batch):
  """The batch with π_old log-probs, reference log-probs and (ppo) GAE targets added, as
  the step's updates read them (module docstring)."""
  c = forward.config
  if c.algorithm != "sft":  # fails at trace time, before any compute, if the batch lacks them
    c.sampler_correction("behavior_logprobs" in batch)
  if packing.is_packed(batch):
    c.check_packed_slices(batch["tokens"].shape[1])
  else:
    c.check_batch_size(batch["completion_mask"].shape[0])
  from_sampler = old_logprobs_from_batch(c, batch)
  batch = dict(batch, **frozen_forwards(forward, state, batch, from_sampler))
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


def old_logprobs_from_batch(config: StepConfig, batch) -> bool:
  """π_old is the sampler's behavior_logprobs (`StepConfig.old_logprobs_from_sampler`)."""
  if not (config.old_logprobs_from_sampler and config.needs_old_logprobs):
    return False
  if "behavior_logprobs" not in batch:
    raise ConfigError("rollout.exact_logprobs: the step takes π_old from the sampler, but the "
                      "batch has no behavior_logprobs [B, T]: build it with "
                      "batching.build_batch(..., with_behavior_logprobs=True)")
  return True


def frozen_forwards(forward: PolicyForward, state: TrainState, batch, from_sampler: bool):
  """π_old log-probs, (ppo) old values and (β > 0) reference log-probs, [B, T] each, computed
  one micro-batch (the rows of one update's micro-batch) at a time; with `from_sampler`
  (`old_logprobs_from_batch`) π_old is the batch's, and only PPO's old values are computed."""
  c = forward.config
  # PPO still needs its old values from this forward; π_old itself then comes from the batch
  needs_old = c.needs_old_logprobs and not (from_sampler and c.algorithm != "ppo")
  model_inputs = (("tokens", "positions", "segment_ids", "head_index", "head_targets",
                   "token_index") if packing.is_packed(batch) else ("tokens", "attention_mask"))
  if routing_lib.RECORDED_EXPERTS in batch:
    model_inputs += (routing_lib.RECORDED_EXPERTS,)
  inputs = {k: batch[k] for k in (*model_inputs, "completion_mask")}
  if c.truncation(batch) is not None:  # π_old truncated like π_θ: each row's settings
    inputs.update({k: batch[k] for k in truncation_fields(batch)})

  def run(micro):
    out = {}
    if needs_old:
      logprobs, _, values, in_set = forward.policy_outputs(
          state.params, state.value_head, micro, state.frozen_params, with_membership=True)
      out["old_logprobs"] = logprobs
      if in_set is not None:  # which sampled tokens π_old's own kept set holds
        out[OLD_KEPT] = in_set
      if values is not None:
        out["old_values"] = values
    if c.beta > 0:
      if state.frozen_params is not None:  # LoRA: the base, i.e. zero adapters
        ref_model = forward.model(lora.zero_adapters(state.params), state.frozen_params)
      else:
        ref_model = nnx.merge(forward.graphdef, state.ref_params)
      out["ref_logprobs"], _ = forward.logprobs(ref_model, micro)
    return out

  if not (needs_old or c.beta > 0):
    return {}
  num_slices = c.num_mini_batches * c.num_micro_batches
  if packing.is_packed(batch):  # already in slices: [rows, S, ...] → [S, rows, ...]
    slices = slice_major(inputs)
    out = jax.lax.map(skipping_empty(run, jax.tree.map(lambda x: x[0], slices)), slices)
    out = slice_major(out)  # back to [rows, S, ...]
  elif num_slices == 1:
    out = run(inputs)
  else:  # lax.map runs the slices one after another: one slice's activations live at a time
    out = merge_rows(jax.lax.map(run, split_rows(inputs, num_slices)))
  return jax.tree.map(jax.lax.stop_gradient, out)
