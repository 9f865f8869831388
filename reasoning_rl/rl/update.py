"""One optimizer update of the training step: the micro-batch loss, its gradients accumulated over
micro-batches, the optax update, and the guard that skips an update that must not be applied.

Each update is a complete update on its own slice of rows (one mini-batch): its loss normalizers
(`losses.loss_normalizers`) are the slice's, and its micro-batch losses sum to the loss of that
slice alone. The objectives (`StepConfig.algorithm`): grpo and ppo, the policy loss of
`reasoning_rl.rl.losses.policy_loss` (`loss_type`: PPO's clipped surrogate, GSPO or CISPO) with
its KL term and importance correction against the sampler, plus ppo's clipped value loss
(`reasoning_rl.rl.value`); sft, next-token cross-entropy on the completion tokens only (the prompt
is context, never a target), aggregated like the policy loss. MoE models add the router's
auxiliary losses (`reasoning_rl.rl.routing`).

Mixed precision (`reasoning_rl.precision`): gradients are summed over micro-batches in float32
and the optimizer state keeps its dtypes from update to update; the parameters are updated in
their own dtype.

A non-finite loss or gradient norm skips the update (parameters and optimizer state unchanged) and
counts it in `state.skipped_updates` and the `skipped_update` stat; it is never applied. An update
over rows without a completion token (a batch left empty by dynamic sampling) is not applied
either, nor counted as skipped: AdamW would move the weights along its momentum with no data.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from reasoning_rl.rl import losses, packing
from reasoning_rl.rl import routing as routing_lib
from reasoning_rl.rl import stats as stats_lib
from reasoning_rl.rl import value as value_lib
from reasoning_rl.rl.batch_slices import split_rows
from reasoning_rl.rl.optimizer import applied_updates, learning_rate_schedule
from reasoning_rl.rl.policy_forward import OLD_KEPT, PolicyForward
from reasoning_rl.rl.train_state import TrainState


def update_on_rows(forward: PolicyForward, optimizer: optax.GradientTransformation,
                   state: TrainState, rows):
  """A full update on `rows` alone: the loss normalizers are theirs (module docstring)."""
  return optimizer_update(forward, optimizer, state, rows,
                          losses.loss_normalizers(rows["completion_mask"]))


def optimizer_update(forward: PolicyForward, optimizer: optax.GradientTransformation,
                     state: TrainState, batch, normalizers):
  """One optimizer update over `batch` (one mini-batch; micro-batched gradient accumulation)."""
  c = forward.config
  trainable = {"policy": state.params}
  if state.value_head is not None:
    trainable["value_head"] = state.value_head
  grad_fn = jax.value_and_grad(functools.partial(micro_loss, forward), has_aux=True)

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
             no_stats(stats_shape))
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
  updates, new_opt_state = optimizer.update(safe_grads, state.opt_state, trainable)
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


def micro_loss(forward: PolicyForward, trainable, micro, normalizers, frozen_params=None):
  """Loss of one micro-batch. Without `old_logprobs` in the batch (μ = 1, GRPO), π_old is the
  current policy, so its log-probs are this forward's own, held constant (`prepare_batch`)."""
  c = forward.config
  logprobs, entropy, values, full_logprobs, in_set, router_stats = forward.policy_outputs(
      trainable["policy"], trainable.get("value_head"), micro, frozen_params, with_full=True,
      with_membership=True, with_router_stats=True)
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
  # A token in π_old's kept set (by the trainer's own rebuild) that is not in π_θ's has left it:
  # π_θ^W(y) = 0. One the rebuild put outside at θ_old too is numerics, and stays kept.
  left = None
  if in_set is not None and OLD_KEPT in micro:
    left = (micro[OLD_KEPT] > 0) & (in_set <= 0)
  loss, stats = losses.policy_loss(
      logprobs, old_logprobs, micro["advantages"], micro["completion_mask"],
      loss_type=c.loss_type, ref_logprobs=micro.get("ref_logprobs"), beta=c.beta,
      kl_logprobs=full_logprobs, kl_estimator=c.kl_estimator, epsilon_low=c.epsilon_low,
      epsilon_high=c.epsilon_high,
      dual_clip=c.dual_clip, loss_agg=c.loss_agg, behavior_logprobs=behavior_logprobs,
      is_correction=is_correction, is_threshold=is_threshold,
      is_threshold_low=c.is_threshold_low, icepop_low=c.icepop_low, icepop_high=c.icepop_high,
      rejection=c.rejection, rejection_geo_low=c.rejection_geo_low,
      rejection_geo_high=c.rejection_geo_high, rejection_k3_threshold=c.rejection_k3_threshold,
      left_kept_set=left, entropy=entropy,
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


def no_stats(shapes) -> stats_lib.Stats:
  """The identity of `stats_lib.merge` for stats of these shapes (a scan's starting carry)."""
  out = {}
  for name, (value, count) in shapes.items():
    start = {"min": jnp.inf, "max": -jnp.inf, "sum": 0}[stats_lib.reduction_kind(name)]
    out[name] = (jnp.full(value.shape, start, value.dtype), jnp.zeros(count.shape, count.dtype))
  return out
