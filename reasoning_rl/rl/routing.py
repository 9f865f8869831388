"""The training step's side of mixture-of-experts routing: what its forwards are told about the
sampler's experts, the router's auxiliary losses, and the routing metrics.

Forwards (`forward_routing`): the policy forward (π_θ) and the frozen π_old forward read the
batch's `recorded_experts` (the sampler's choice for every token, laid out like `tokens`) and,
with `algo.routing_replay` (R3, Ma et al. 2025, arXiv:2510.11370), route by them; the policy
forward also reports its `RouterStats`. The KL reference routes by its own router: it is another
model, whose own distribution the KL term compares with.

Metrics (stats pairs, `reasoning_rl.rl.stats`):
- `routing/disagreement`: the share of (token, sparse layer) pairs whose top-k expert set under
  the trainer's router differs from the sampler's (only for batches that carry the sampler's);
  under replay this is what replay corrected, without it what the trainer computed differently.
- `routing/entropy`: the router distribution's mean entropy (nats).
- `routing/balance_loss`, `routing/z_loss`: the auxiliary losses (logged whether or not they
  are weighted into the loss).
- `routing/max_load_over_mean` and `routing/collapse` (`summarize_expert_load`, per step): over
  the step's real tokens, the largest ratio, over sparse layers, of the busiest expert's tokens to
  the mean per expert; and that ratio over its ceiling E/k (1: every token sent to the same k
  experts). The guard `guards.max_routing_collapse` reads the latter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reasoning_rl.models import moe as moe_lib
from reasoning_rl.rl.logprobs import RoutingInputs

RECORDED_EXPERTS = "recorded_experts"
# Per-expert token counts [L_sparse, E], summed over the step's forwards; turned into the two
# load metrics by `summarize_expert_load` before the step returns its stats.
_LOAD_KEY = "routing/expert_load"


def forward_routing(moe: bool, batch, *, replay: bool, with_stats: bool) -> RoutingInputs | None:
  """The `RoutingInputs` of a forward over `batch` (None for a dense model)."""
  if not moe:
    return None
  recorded = batch.get(RECORDED_EXPERTS)
  if replay and recorded is None:
    raise ValueError("algo.routing_replay needs the sampler's experts in the batch "
                     f"({RECORDED_EXPERTS}); the rollout records them for MoE models")
  return RoutingInputs(recorded=recorded, replay=replay, with_stats=with_stats)


def auxiliary_loss_and_stats(stats: moe_lib.RouterStats, *, balance_coef: float,
                             z_coef: float, recorded: bool):
  """(weighted auxiliary loss, stats dict) of one forward's `RouterStats` (stacked over sparse
  layers)."""
  balance = moe_lib.load_balancing_loss(stats)
  z_loss = moe_lib.router_z_loss(stats)
  one = jnp.ones((), jnp.int32)
  tokens = jnp.sum(stats.tokens)
  out = {
      "routing/entropy": (jnp.sum(stats.entropy_sum), tokens),
      "routing/balance_loss": (jax.lax.stop_gradient(balance), one),
      "routing/z_loss": (jax.lax.stop_gradient(z_loss), one),
      _LOAD_KEY: (jax.lax.stop_gradient(stats.load), one),
  }
  if recorded:
    out["routing/disagreement"] = (jnp.sum(stats.disagree_sum), tokens)
  loss = jnp.zeros((), jnp.float32)
  if balance_coef:
    loss = loss + balance_coef * balance
  if z_coef:
    loss = loss + z_coef * z_loss
  return loss, out


def summarize_expert_load(stats: dict, experts_per_token: int) -> dict:
  """`stats` with the summed per-expert load replaced by its two scalar metrics (module
  docstring); unchanged for a dense model."""
  if _LOAD_KEY not in stats:
    return stats
  stats = dict(stats)
  load, _ = stats.pop(_LOAD_KEY)  # [L_sparse, E]
  num_experts = load.shape[-1]
  mean = jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
  ratio = jnp.max(jnp.max(load, axis=-1) / mean)
  one = jnp.ones((), jnp.int32)
  stats["routing/max_load_over_mean"] = (ratio, one)
  stats["routing/collapse"] = (ratio * experts_per_token / num_experts, one)
  return stats
