"""The policy's forward pass as the step runs it: completion log-probs, entropies, PPO's values.

One forward serves a padded or a packed micro-batch (`reasoning_rl.rl.packing`), the full model
or LoRA adapters on their frozen base, a dense or a mixture-of-experts model.

Truncated ratio (`StepConfig.truncated_ratio`, docs/off_policy.md): the sampler draws from π^W,
the model's distribution after temperature and top-k / top-p / min-p, renormalised. With the
switch on, the log-probs this forward returns for the ratio are log π^W, rebuilt on the trainer's
logits with each row's settings (`reasoning_rl.sampler.sampling.truncated_logprobs`); the
full-softmax log-probs come alongside for the KL term and the mismatch stats.

LoRA adapters are float32 masters, cast to `compute_dtype` where the forward reads them (the
model casts its own kernels; qwix's adapter product would otherwise promote the activations).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from reasoning_rl import precision
from reasoning_rl.rl import packing
from reasoning_rl.rl import routing as routing_lib
from reasoning_rl.rl.logprobs import completion_logprobs, packed_completion_logprobs
from reasoning_rl.rl.step_config import StepConfig

# The batch key under which `prepare_batch` leaves π_old's kept-set membership of each sampled
# token (truncated ratio, μ·M > 1), for the updates to find the tokens that left it.
OLD_KEPT = "old_target_kept"


class PolicyForward:
  """The forward passes of one model graph under one `StepConfig`."""

  def __init__(self, graphdef, config: StepConfig):
    self.graphdef = graphdef
    self.config = config

  def model(self, params, frozen_params=None):
    """The policy as a module: the full state, or (LoRA) the adapters on the frozen base."""
    if frozen_params is None:
      return nnx.merge(self.graphdef, params)
    if self.config.compute_dtype is not None:
      params = precision.cast_floating(params, self.config.compute_dtype)
    return nnx.merge(self.graphdef, frozen_params, params)

  def logprobs(self, model, micro, *, return_hidden=False, remat=False, truncation=None,
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

  def policy_outputs(self, params, value_head, batch, frozen_params=None, *,
                     with_full=False, with_router_stats=False, with_membership=False):
    """(logprobs, entropy, values or None) of the policy; the log-probs are π^W's with
    `truncated_ratio` (`StepConfig.truncation`). `with_full` appends the full-softmax log-probs
    (the same array when nothing is truncated), `with_membership` whether each token lies in the
    kept set of this forward's truncation ([B, T] 1.0 / 0.0; None when nothing is truncated),
    `with_router_stats` the forward's `RouterStats` (None for a dense model). A MoE policy replays the batch's recorded experts with
    `routing_replay` (`reasoning_rl.rl.routing`)."""
    model = self.model(params, frozen_params)
    truncation = self.config.truncation(batch)
    routing = routing_lib.forward_routing(
        model.config.moe is not None, batch, replay=self.config.routing_replay,
        with_stats=with_router_stats)
    out = self.logprobs(model, batch, return_hidden=value_head is not None,
                        remat=self.config.remat, truncation=truncation, routing=routing)
    router_stats = None
    if routing is not None and with_router_stats:
      out, router_stats = out[:-1], out[-1]
    logprobs, entropy = out[0], out[1]
    full = out[2] if truncation is not None else logprobs
    membership = out[3] if truncation is not None else None
    values = None
    if value_head is not None:
      values = out[-1].astype(jnp.float32) @ value_head["kernel"] + value_head["bias"]
    result = (logprobs, entropy, values) + ((full,) if with_full else ())
    result += (membership,) if with_membership else ()
    return result + ((router_stats,) if with_router_stats else ())

  def experts_per_token(self, params, frozen_params=None) -> int:
    """k of the policy's sparse layers (0 for a dense model), read off its static config."""
    model = self.model(params, frozen_params)
    return model.config.moe.experts_per_token if model.config.moe is not None else 0
