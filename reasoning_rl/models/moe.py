"""Routed experts: the sparse MLP of the mixture-of-experts families (config: `MoEConfig`).

A token's router logits z = x·W_r (float32, whatever the compute dtype: routing is a discrete
choice, and bfloat16 logits flip near-ties between two forwards of the same weights) give scores
s = softmax(z); the token is sent to the k experts of highest score (Shazeer et al. 2017; GShard,
Lepikhin et al. 2020) and the layer returns Σ_i w_i · expert_i(x), with w_i = s_i, renormalised
over the chosen k when `normalize_top_k` (Mixtral, Jiang et al. 2024). Experts are SwiGLU MLPs
whose weights are stacked on a leading `expert` axis.

DeepSeek-V3's router (`MoEConfig`, technical report §2.1.2) scores with s = sigmoid(z) and chooses
by s + b, b its selection bias (a `Buffer`: set by the checkpoint, never trained), among the
experts of the `groups_per_token` groups whose two best s + b sum highest; the weights are the
unbiased s_i of the chosen experts, renormalised, times `routed_scale`; and its shared experts (one
SwiGLU MLP every token passes through) are added to the routed output.

Dispatch is dropless (MegaBlocks, Gale et al. 2023): the N·k (token, expert) pairs are sorted by
expert and each expert multiplies its contiguous rows in one grouped matmul
(`reasoning_rl.kernels.grouped_matmul`); nothing is dropped for capacity, so a token's output is a
function of the token alone — the property routing-exact rollouts rely on.

Routing replay (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers", R3): given the experts the sampler chose (`recorded`), `replay=True` sends
each token to those experts instead of its own top-k, while the weights w_i still come from this
forward's router (so the router keeps its gradient). Whether replaying or not, the layer reports
how many tokens' own top-k set differs from the recorded one (routing disagreement).

Every layer also reports, as sums over real tokens (`RouterStats`; padding excluded), what the
trainer logs and the optional auxiliary losses need: tokens per expert, the router's mean
probabilities, its entropy and the squared log-partition of the z-loss. (Sigmoid scores are not a
distribution; their probabilities are the scores normalised to sum 1, the form DeepSeek-V3's
sequence-wise balance loss takes, report eq. 17-20.)
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from reasoning_rl.kernels.grouped_matmul import grouped_matmul
from reasoning_rl.models.config import ModelConfig, MoEConfig
from reasoning_rl.models.primitives import buffer, param, weight


@flax.struct.dataclass
class RouterStats:
  """One sparse layer's routing of a batch (stacked over sparse layers by the model: a leading
  axis of length `MoEConfig.num_sparse_layers` on every field).

  experts: [B, T, k] int32, the experts each token was sent to (the replayed ones under replay).
  own_experts: [B, T, k] int32, this forward's own top-k choice (equal to `experts` unless
    replaying).
  load: [E] float32, real tokens sent to each expert (a token counts once per chosen expert).
  prob_sum: [E] float32, Σ over real tokens of the router's probabilities
    (`router_probabilities`; differentiable).
  entropy_sum: Σ over real tokens of the router distribution's entropy (nats).
  z_sum: Σ over real tokens of logsumexp(z)² (ST-MoE's router z-loss, Zoph et al. 2022, eq. 5).
  disagree_sum: real tokens whose own top-k set differs from the recorded one (0 without one).
  tokens: the number of real tokens.
  """

  experts: jax.Array
  own_experts: jax.Array
  load: jax.Array
  prob_sum: jax.Array
  entropy_sum: jax.Array
  z_sum: jax.Array
  disagree_sum: jax.Array
  tokens: jax.Array


def router_scores(logits: jax.Array, moe: MoEConfig) -> jax.Array:
  """Scores [..., E] of float32 router logits (`MoEConfig.scoring`); the chosen experts'
  weights are taken from these."""
  if moe.scoring == "sigmoid":
    return jax.nn.sigmoid(logits)
  return jax.nn.softmax(logits, axis=-1)


def router_probabilities(scores: jax.Array, moe: MoEConfig) -> jax.Array:
  """The router's distribution over experts [..., E]: softmax scores as they are, sigmoid scores
  normalised to sum 1 (what the statistics and auxiliary losses read)."""
  if moe.scoring == "sigmoid":
    return scores / jnp.sum(scores, axis=-1, keepdims=True)
  return scores


def top_k_experts(scores: jax.Array, k: int) -> jax.Array:
  """The k experts of highest score, [..., k] int32, best first (ties: lower index first)."""
  return jax.lax.top_k(scores, k)[1].astype(jnp.int32)


def choose_experts(scores: jax.Array, moe: MoEConfig, bias: jax.Array | None = None) -> jax.Array:
  """A token's own choice [..., k] int32: the top k of scores + bias (bias: the selection bias,
  or None), among the experts of its `groups_per_token` best groups when routing is
  group-limited (a group's rank: the sum of its two best biased scores, as DeepSeek-V3 ranks
  them)."""
  choice = scores if bias is None else scores + bias.astype(scores.dtype)
  if moe.group_limited:
    grouped = choice.reshape(*choice.shape[:-1], moe.num_groups, -1)
    group_rank = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., G]
    best = jax.lax.top_k(group_rank, moe.groups_per_token)[1]
    kept = jnp.sum(jax.nn.one_hot(best, moe.num_groups, dtype=jnp.int32), axis=-2) > 0
    choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
  return top_k_experts(choice, moe.experts_per_token)


def expert_weights(scores: jax.Array, experts: jax.Array, moe: MoEConfig) -> jax.Array:
  """w [..., k]: the chosen experts' scores, renormalised to sum 1 when `normalize_top_k`, times
  `routed_scale`."""
  chosen = jnp.take_along_axis(scores, experts, axis=-1)
  if moe.normalize_top_k:
    chosen = chosen / jnp.sum(chosen, axis=-1, keepdims=True)
  if moe.routed_scale != 1.0:
    chosen = chosen * moe.routed_scale
  return chosen


def same_sets(a: jax.Array, b: jax.Array) -> jax.Array:
  """[...] bool: whether the expert sets a [..., k] and b [..., k] are equal (order ignored)."""
  return jnp.all(jnp.sort(a, axis=-1) == jnp.sort(b, axis=-1), axis=-1)


class MoE(nnx.Module):
  """Router + E stacked SwiGLU experts of one sparse layer (module docstring), and the layer's
  shared experts when it has some: `shared_experts`, an MLP module the caller builds (of width
  num_shared_experts · intermediate_size), whose output is added to the routed one."""

  def __init__(self, config: ModelConfig, *, param_dtype, rngs, shared_experts=None):
    moe = config.moe
    d, f, e = config.hidden_size, moe.intermediate_size, moe.num_experts
    if (shared_experts is not None) != (moe.num_shared_experts > 0):
      raise ValueError(f"num_shared_experts={moe.num_shared_experts}: pass their MLP exactly "
                       "when the config has some")
    self.moe = moe
    self.activation = config.activation
    self.router = param(rngs, (d, e), param_dtype, ("embed", None))
    if moe.selection_bias:
      # float32 whatever the weights' dtype, as transformers keeps it: it decides near-ties
      self.selection_bias = buffer((e,), jnp.float32, (None,))
    self.gate_proj = param(rngs, (e, d, f), param_dtype, ("expert", "embed", "mlp"))
    self.up_proj = param(rngs, (e, d, f), param_dtype, ("expert", "embed", "mlp"))
    self.down_proj = param(rngs, (e, f, d), param_dtype, ("expert", "mlp", "embed"))
    self.shared_experts = shared_experts
    self.grouped_matmul = "auto"  # static: `Transformer.use_grouped_matmul` sets it

  def router_logits(self, x: jax.Array) -> jax.Array:
    """[B, T, E] float32 (see the module docstring for why float32)."""
    return jnp.einsum("btd,de->bte", x.astype(jnp.float32),
                      self.router[...].astype(jnp.float32))

  def experts(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """Σ_i w_i · expert_i(x) for x [N, D], experts / weights [N, k]: dropless dispatch."""
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # the N·k (token, expert) pairs, by expert
    rows = x[order // k]
    sizes = jnp.bincount(flat, length=self.moe.num_experts)
    dtype = x.dtype

    def matmul(lhs, kernel):
      return grouped_matmul(lhs, weight(kernel, dtype), sizes,
                            implementation=self.grouped_matmul)

    gate, up = matmul(rows, self.gate_proj), matmul(rows, self.up_proj)
    if self.activation == "silu":
      hidden = jax.nn.silu(gate) * up
    else:
      hidden = jax.nn.gelu(gate, approximate=True) * up
    out = matmul(hidden, self.down_proj)
    # Back to (token, slot) order by the inverse permutation (a gather: deterministic, and its
    # gradient is a gather too), then each token's k outputs summed in slot order.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    per_slot = out[inverse].reshape(tokens, k, -1)
    return jnp.sum(per_slot * weights[..., None].astype(dtype), axis=1)

  def __call__(self, x: jax.Array, token_mask: jax.Array, recorded: jax.Array | None = None,
               replay: bool = False) -> tuple[jax.Array, RouterStats]:
    """x [B, T, D] → (output [B, T, D], this layer's `RouterStats`).

    token_mask [B, T]: real tokens (statistics count only these). recorded [B, T, k]: the
    experts a sampler chose for these tokens; with `replay` they are used instead of this
    forward's own choice.
    """
    moe = self.moe
    batch, length, width = x.shape
    logits = self.router_logits(x)
    scores = router_scores(logits, moe)
    own = choose_experts(scores, moe, self.selection_bias[...] if moe.selection_bias else None)
    if replay and recorded is None:
      raise ValueError("routing replay needs the recorded experts of every sparse layer")
    experts = recorded.astype(jnp.int32) if replay else own
    weights = expert_weights(scores, experts, moe)
    out = self.experts(x.reshape(batch * length, width), experts.reshape(batch * length, -1),
                       weights.reshape(batch * length, -1)).reshape(batch, length, width)
    if self.shared_experts is not None:
      out = out + self.shared_experts(x)
    return out, _stats(logits, scores, experts, own, recorded, token_mask, moe)


def _stats(logits, scores, experts, own, recorded, token_mask, moe: MoEConfig) -> RouterStats:
  real = token_mask.astype(jnp.float32)
  chosen = jax.nn.one_hot(experts, moe.num_experts, dtype=jnp.float32).sum(-2)  # [B, T, E]
  probs = router_probabilities(scores, moe)
  entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
  log_partition = jax.nn.logsumexp(logits, axis=-1)
  if recorded is None:
    disagree = jnp.zeros((), jnp.float32)
  else:
    differs = ~same_sets(own, recorded.astype(jnp.int32))
    disagree = jnp.sum(jnp.where(differs, real, 0.0))
  return RouterStats(
      experts=experts, own_experts=own,
      load=jnp.einsum("bte,bt->e", jax.lax.stop_gradient(chosen), real),
      prob_sum=jnp.einsum("bte,bt->e", probs, real),
      entropy_sum=jnp.sum(entropy * real), z_sum=jnp.sum(jnp.square(log_partition) * real),
      disagree_sum=disagree, tokens=jnp.sum(real))


def load_balancing_loss(stats: RouterStats) -> jax.Array:
  """Mean over sparse layers of E · Σ_i f_i · P_i (Switch Transformer, Fedus et al. 2021, eq. 4;
  with top-k, f_i = the fraction of the N·k token slots sent to expert i), where P_i is the mean
  router probability of expert i; 1 when routing is uniform. Differentiable through P_i.
  `stats` stacked over sparse layers."""
  tokens = jnp.maximum(stats.tokens, 1.0)[:, None]
  num_experts = stats.load.shape[-1]
  k = stats.experts.shape[-1]
  fraction = stats.load / (tokens * k)
  mean_prob = stats.prob_sum / tokens
  return jnp.mean(num_experts * jnp.sum(fraction * mean_prob, axis=-1))


def router_z_loss(stats: RouterStats) -> jax.Array:
  """Mean over sparse layers of the mean over tokens of logsumexp(z)² (Zoph et al. 2022, ST-MoE,
  eq. 5): keeps router logits small. `stats` stacked over sparse layers."""
  return jnp.mean(stats.z_sum / jnp.maximum(stats.tokens, 1.0))
