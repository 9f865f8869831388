"""Routed experts: the sparse MLP of the mixture-of-experts families (config: `MoEConfig`).

A token's router logits z = x·W_r (float32, whatever the compute dtype: routing is a discrete
choice, and bfloat16 logits flip near-ties between two forwards of the same weights) give scores
s = softmax(z); the token is sent to the k experts of highest score (Shazeer et al. 2017; GShard,
Lepikhin et al. 2020) and the layer returns Σ_i w_i · expert_i(x), with w_i = s_i, renormalised
over the chosen k when `normalize_top_k` (Mixtral, Jiang et al. 2024). Experts are SwiGLU MLPs
whose weights are stacked on a leading `expert` axis.

GPT-OSS's variant (OpenAI 2025 model card): the router adds a bias to its logits and weights the
top k by a softmax over their logits (the renormalised softmax above, the same numbers); each
expert adds biases after its projections and applies a clamped SwiGLU,
(clip(up, −l, l) + 1) · g · σ(α·g) with g = min(gate, l) (`MoEConfig.swiglu_limit` l,
`swiglu_alpha` α). Its gate and up projections are one [E, D, 2F] kernel whose even columns are
the gate and odd ones the up projection, as its checkpoints store them (`gate_up_proj`), so that
tensor maps to ours as it stands.

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

Expert parallelism: traced under a mesh with an `expert` axis (`reasoning_rl.sharding`), where
the experts and the batch are both split over that axis, the layer runs per device
(`jax.shard_map`): each device gathers the tokens of its `expert` group (all-gather), computes
its own experts for the tokens routed to them (the rest of the rows are skipped), and the partial
outputs are summed back onto the devices that own the tokens (reduce-scatter). Every token still
goes to every expert it chose, so the result is the single-device one up to the order of the k
additions.

Every layer also reports, as sums over real tokens (`RouterStats`; padding excluded), what the
trainer logs and the optional auxiliary losses need: tokens per expert, the router's mean
probabilities, its entropy and the squared log-partition of the z-loss. (Sigmoid scores are not a
distribution; their probabilities are the scores normalised to sum 1, the form DeepSeek-V3's
sequence-wise balance loss takes, report eq. 17-20.)
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec

from reasoning_rl import sharding
from reasoning_rl.kernels import grouped_matmul as gm
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
  input_sum: [D] float32, Σ over real tokens of the router's input (its mean is the direction
    sparse upcycling takes out of a fresh router, `reasoning_rl.models.upcycle`).
  """

  experts: jax.Array
  own_experts: jax.Array
  load: jax.Array
  prob_sum: jax.Array
  entropy_sum: jax.Array
  z_sum: jax.Array
  disagree_sum: jax.Array
  tokens: jax.Array
  input_sum: jax.Array


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


def fuses_gate_up(config: ModelConfig) -> bool:
  """Whether the experts hold gate and up as one interleaved kernel (GPT-OSS's layout, module
  docstring) rather than two."""
  return config.model_type == "gpt_oss"


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, limit: float, alpha: float) -> jax.Array:
  """GPT-OSS's expert activation: (clip(up, −limit, limit) + 1) · g · σ(alpha · g), with
  g = min(gate, limit)."""
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1) * (gate * jax.nn.sigmoid(alpha * gate))


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
    self.fused = fuses_gate_up(config)
    self.router = param(rngs, (d, e), param_dtype, ("embed", None))
    if self.fused:
      self.gate_up_proj = param(rngs, (e, d, 2 * f), param_dtype, ("expert", "embed", "mlp"))
    else:
      self.gate_proj = param(rngs, (e, d, f), param_dtype, ("expert", "embed", "mlp"))
      self.up_proj = param(rngs, (e, d, f), param_dtype, ("expert", "embed", "mlp"))
    self.down_proj = param(rngs, (e, f, d), param_dtype, ("expert", "mlp", "embed"))
    if moe.router_bias:
      self.router_bias = param(rngs, (e,), param_dtype, (None,))
    if moe.expert_bias:  # fused layout only (ModelConfig checks): interleaved as the kernel
      self.gate_up_bias = param(rngs, (e, 2 * f), param_dtype, ("expert", "mlp"))
      self.down_bias = param(rngs, (e, d), param_dtype, ("expert", "embed"))
    if moe.selection_bias:
      # float32 whatever the weights' dtype, as transformers keeps it: it decides near-ties
      self.selection_bias = buffer((e,), jnp.float32, (None,))
    self.shared_experts = shared_experts
    self.grouped_matmul = "auto"  # static: `Transformer.use_grouped_matmul` sets it

  def router_logits(self, x: jax.Array) -> jax.Array:
    """[B, T, E] float32 (see the module docstring for why float32). The router's weight is the
    einsum's first operand: qwix's LoRA (`reasoning_rl.lora`) adapts the weights that are second
    operands, and an adapter here would re-route tokens; LoRA on a MoE model adapts attention
    (and dense MLPs), while routers and experts stay frozen."""
    logits = jnp.einsum("de,btd->bte", self.router[...].astype(jnp.float32),
                        x.astype(jnp.float32))
    if self.moe.router_bias:
      logits = logits + self.router_bias[...].astype(jnp.float32)
    return logits

  def expert_kernels(self, dtype) -> dict[str, jax.Array]:
    """The experts' weights (and biases) in the compute dtype, by role: "gate" and "up", or
    "gate_up" (GPT-OSS's interleaved kernel), "down", and "gate_up_bias" / "down_bias" where the
    family has them; each with the leading expert axis."""
    kernels = {"down": weight(self.down_proj, dtype)}
    if self.fused:
      kernels["gate_up"] = weight(self.gate_up_proj, dtype)
    else:
      kernels["gate"], kernels["up"] = weight(self.gate_proj, dtype), weight(self.up_proj, dtype)
    if self.moe.expert_bias:
      kernels["gate_up_bias"] = self.gate_up_bias[...].astype(dtype)
      kernels["down_bias"] = self.down_bias[...].astype(dtype)
    return kernels

  def experts(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """Σ_i w_i · expert_i(x) for x [N, D], experts / weights [N, k]: dropless dispatch, per
    device under a mesh with an `expert` axis (module docstring)."""
    swiglu = None
    if self.moe.swiglu_limit is not None:
      swiglu = (self.moe.swiglu_limit, self.moe.swiglu_alpha)
    options = dict(activation=self.activation, swiglu=swiglu,
                   implementation=self.grouped_matmul)
    kernels = self.expert_kernels(x.dtype)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.shape.get("expert", 1) > 1:
      return _expert_parallel(x, experts, weights, kernels, mesh, **options)
    return dispatch(x, experts, weights, kernels, **options)

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
    stats = _stats(logits, scores, experts, own, recorded, token_mask, moe)
    input_sum = jnp.einsum("btd,bt->d", jax.lax.stop_gradient(x).astype(jnp.float32),
                           token_mask.astype(jnp.float32))
    return out, stats.replace(input_sum=input_sum)


def dispatch(x: jax.Array, experts: jax.Array, weights: jax.Array, kernels: dict, *,
             activation: str, implementation: str, swiglu: tuple[float, float] | None = None,
             first_expert=0) -> jax.Array:
  """Σ_i w_i · expert_i(x) over the experts held in `kernels` (`MoE.expert_kernels`: experts
  first_expert … first_expert + E_held − 1): x [N, D], experts and weights [N, k]. A (token,
  expert) pair whose expert is not held contributes nothing and is not computed: the pairs are
  sorted by expert, the held ones first, and the held experts run their contiguous rows
  (`expert_mlp`; rows past them are left out, their outputs masked). `swiglu`: GPT-OSS's
  (limit, alpha) of `clamped_swiglu`, else the family's `activation`."""
  tokens, k = experts.shape
  held = kernels["down"].shape[0]
  local = experts.reshape(-1) - first_expert
  mine = (local >= 0) & (local < held)
  key = jnp.where(mine, local, held)
  order = jnp.argsort(key, stable=True)  # the N·k (token, expert) pairs, by expert
  sizes = jnp.bincount(jnp.where(mine, local, 0), weights=mine.astype(jnp.int32), length=held)
  out = expert_mlp(x[order // k], kernels, sizes, activation=activation, swiglu=swiglu,
                   implementation=implementation)
  # Back to (token, slot) order by the inverse permutation (a gather: deterministic, and its
  # gradient is a gather too), then each token's k outputs summed in slot order.
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  per_slot = out[inverse].reshape(tokens, k, -1)
  slot_weights = jnp.where(mine.reshape(tokens, k), weights, 0).astype(x.dtype)
  per_slot = jnp.where(mine.reshape(tokens, k)[..., None], per_slot, 0)
  return jnp.sum(per_slot * slot_weights[..., None], axis=1)


def expert_mlp(rows: jax.Array, kernels: dict, sizes: jax.Array, *, activation: str,
               swiglu, implementation: str) -> jax.Array:
  """Each expert's MLP on its rows: rows [M, D] sorted by expert, `sizes` [E_held] rows each
  (rows past them: unspecified outputs). The tiled implementation runs the whole MLP tile by
  tile (`_tiled_expert_mlp`); the others make one grouped matmul per projection."""
  options = dict(fused="gate_up" in kernels, activation=activation, swiglu=swiglu)
  if gm.resolve(implementation) == "tiled":
    return _tiled_expert_mlp(rows, kernels, sizes, gm.TILE_ROWS, _freeze(options))
  held = sizes.shape[0]
  row_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows.shape[0]),
                                            side="right"), held - 1)

  def project(lhs, name):
    out = gm.grouped_matmul(lhs, kernels[name], sizes, implementation=implementation)
    bias = kernels.get(name + "_bias")
    return out if bias is None else out + bias[row_expert]

  return _expert_forward(rows, project, **options)


def _expert_forward(rows, project, *, fused: bool, activation: str, swiglu) -> jax.Array:
  """An expert MLP on `rows`, each projection made by project(lhs, kernel name): gate and up
  (GPT-OSS: one interleaved gate_up, gate in the even columns), the activation, down."""
  if fused:
    gate_up = project(rows, "gate_up")
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
  else:
    gate, up = project(rows, "gate"), project(rows, "up")
  if swiglu is not None:
    hidden = clamped_swiglu(gate, up, limit=swiglu[0], alpha=swiglu[1])
  elif activation == "silu":
    hidden = jax.nn.silu(gate) * up
  else:
    hidden = jax.nn.gelu(gate, approximate=True) * up
  return project(hidden, "down")


def _one_expert(block, kernels, options):
  """One expert's MLP on a tile of its rows; `kernels` holds that expert's slices."""
  def project(lhs, name):
    out = jnp.dot(lhs, kernels[name], preferred_element_type=jnp.float32).astype(lhs.dtype)
    bias = kernels.get(name + "_bias")
    return out if bias is None else out + bias

  return _expert_forward(block, project, **options)


def _freeze(options: dict) -> tuple:
  return tuple(sorted(options.items()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tiled_expert_mlp(rows, kernels, sizes, tile_rows: int, options):
  """`expert_mlp` tile by tile (`grouped_matmul.TileLayout`): the rows are laid into tiles once,
  every live tile runs its expert's whole MLP (dead tiles: zeros), and the outputs come back to
  row order once. Its gradient (`_tiled_backward`) recomputes each tile's MLP and takes its VJP,
  adding the tile's weight gradients into one accumulator in place, so a layer keeps only its
  input rows for the backward pass (per projection, the rows' gathered copies and [tiles, …]
  products had held gigabytes of a MoE SmolLM2 step)."""
  options = dict(options)
  layout = gm.TileLayout.of(rows.shape[0], sizes, tile_rows)

  def one_tile(args):
    block, group, live = args
    return jax.lax.cond(live, lambda: _one_expert(block, _slice(kernels, group), options),
                        lambda: jnp.zeros_like(block))

  out = jax.lax.map(one_tile, (layout.tiles(rows), layout.tile_group, layout.live))
  return layout.rows(out)


def _slice(kernels: dict, group) -> dict:
  return {name: kernel[group] for name, kernel in kernels.items()}


def _tiled_forward(rows, kernels, sizes, tile_rows, options):
  return _tiled_expert_mlp(rows, kernels, sizes, tile_rows, options), (rows, kernels, sizes)


def _tiled_backward(tile_rows, options, residuals, out_grad):
  rows, kernels, sizes = residuals
  options = dict(options)
  layout = gm.TileLayout.of(rows.shape[0], sizes, tile_rows)

  def one_tile(total, args):
    block, grad, group, live = args

    def backward():
      _, vjp = jax.vjp(lambda b, w: _one_expert(b, w, options), block, _slice(kernels, group))
      block_grad, kernel_grads = vjp(grad)
      return (jax.tree.map(lambda acc, g: acc.at[group].add(g.astype(acc.dtype)), total,
                           kernel_grads), block_grad)

    return jax.lax.cond(live, backward, lambda: (total, jnp.zeros_like(block)))

  start = jax.tree.map(lambda kernel: jnp.zeros(kernel.shape, jnp.float32), kernels)
  totals, block_grads = jax.lax.scan(
      one_tile, start, (layout.tiles(rows), layout.tiles(out_grad), layout.tile_group,
                        layout.live))
  kernel_grads = jax.tree.map(lambda g, kernel: g.astype(kernel.dtype), totals, kernels)
  return layout.rows(block_grads), kernel_grads, None


_tiled_expert_mlp.defvjp(_tiled_forward, _tiled_backward)


def _expert_parallel(x, experts, weights, kernels, mesh, **options):
  """`dispatch` with the experts split over the mesh's `expert` axis (module docstring)."""
  row_spec = sharding.logical_to_spec(("batch", None), x.shape, mesh)
  row_axes = row_spec[0] if isinstance(row_spec[0], tuple) else (row_spec[0],)
  gathered = "expert" in row_axes  # tokens split over expert too: gather, then scatter back
  expert_specs = {name: PartitionSpec("expert", *(None,) * (kernel.ndim - 1))
                  for name, kernel in kernels.items()}

  def per_device(x, experts, weights, kernels):
    if gathered:
      x, experts, weights = (jax.lax.all_gather(a, "expert", axis=0, tiled=True)
                             for a in (x, experts, weights))
    first = jax.lax.axis_index("expert") * kernels["down"].shape[0]
    partial = dispatch(x, experts, weights, kernels, first_expert=first, **options)
    if gathered:
      return jax.lax.psum_scatter(partial, "expert", scatter_dimension=0, tiled=True)
    return jax.lax.psum(partial, "expert")

  rows = PartitionSpec(row_spec[0], None)
  return jax.shard_map(per_device, mesh=mesh, in_specs=(rows, rows, rows, expert_specs),
                       out_specs=rows, check_vma=False)(x, experts, weights, kernels)


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
      disagree_sum=disagree, tokens=jnp.sum(real), input_sum=jnp.zeros((), jnp.float32))


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
