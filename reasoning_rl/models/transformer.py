"""A Flax NNX decoder-only transformer covering Llama, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 and the
mixtures of experts Qwen3-MoE, Mixtral, OLMoE, GPT-OSS and DeepSeek-V3 (sparse layers:
`reasoning_rl.models.moe`; DeepSeek-V3's latent attention: `reasoning_rl.models.mla`).

The variants differ only by `ModelConfig` switches. Every parameter carries `logical_axes` metadata
(`vocab`, `embed`, `mlp`, `heads`, `kv_heads`, `head_dim`, `norm`); `reasoning_rl.sharding` maps those
names to mesh axes in one table.

Two entry points:
- `model(token_ids, attention_mask)` — a full (training / scoring) forward over a left- or
  right-padded batch (or packed rows, `hidden_states(segment_ids=)`); positions come from the mask,
  so a left-padded row computes exactly what the unpadded sequence would. Its attention is
  `reasoning_rl.kernels.training_attention`: a flash kernel on TPU / GPU, the XLA reference on CPU
  (`use_attention_kernel` overrides the choice).
- `model.decode(token_ids, positions, cache, write_index)` — the sampler's path: writes the new keys
  and values into a preallocated `KVCache` (prefill of a prompt, then one token at a time) and attends
  over everything cached with a position-based causal mask (`reasoning_rl.kernels.decode_attention`).

Two layouts of the block stack, the same computation (`scan_layers`):
- a loop (the default): `layers` is an `nnx.List` of blocks, parameter paths `layers/<i>/…`, and
  the forward is a Python loop, so the compiled program (and its compile time) grows with depth;
- scanned: `layers` is one `Block` whose parameters carry a leading `layers` axis, run by
  `jax.lax.scan`, so one block is traced and compiled whatever the depth (as MaxText and Tunix
  do). The KV cache is then one [L, …] array per k / v. `stack_layers` /
  `unstack_layers` convert between the two; files (HF, GGUF, PEFT) are read and written in the
  loop layout, the conversion happens at the edges.

The model holds no backend branches and no timing notes: what is chosen per backend lives in
`reasoning_rl.kernels`, the measurements behind layout choices in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from reasoning_rl import config_schema, kernels
from reasoning_rl.kernels import grouped_matmul
from reasoning_rl.models import cpu_products
from reasoning_rl.models import kv_pages
from reasoning_rl.models import mla as mla_lib
from reasoning_rl.models import primitives
from reasoning_rl.models import moe as moe_lib
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.primitives import (RMSNorm, apply_rope, param, project, rope_angles,
                                            rotate, scatter_cache, weight)
from reasoning_rl.sharding import constrain

REMAT_POLICIES = config_schema.REMAT_POLICIES  # declared with algo.remat, which names them


def remat_policy(remat) -> str:
  """The name of a rematerialisation setting: a policy name, or a bool (True = "full", the
  setting's older form)."""
  if remat is True:
    return "full"
  if remat is False or remat is None:
    return "none"
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat={remat!r}: use one of {REMAT_POLICIES} (or True / False)")
  return remat


def _checkpoint_policy(name: str):
  """`jax.checkpoint`'s policy for a remat name other than "none" (Chen et al. 2016).

  full: only each block's input is kept; the whole block is recomputed in the backward pass.
  save_matmuls: the outputs of matmuls without batch dimensions are kept, i.e. every projection
  (they contract flattened rows, `project`), while attention scores (batched over heads),
  norms and activations are recomputed: most of the recompute FLOPs saved for the memory of the
  projections' outputs (MaxText's "minimal" policy keeps the same set).
  """
  return None if name == "full" else jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def layer_period(config: ModelConfig) -> int:
  """The shortest p dividing the depth such that layer i and layer i + p are alike (same
  attention type): 1 for uniform models, 2 for Gemma 2's alternating local / global layers, 6 for
  Gemma 3's five local layers per global one when the depth is a multiple of 6 (270M: 18 layers;
  otherwise, e.g. 1B's 26, the whole depth — one scan step, correct but compiled unrolled).
  The scanned stack runs p blocks per scan step, so each keeps its window and RoPE base static.
  A MoE model's dense and sparse layers count as different kinds too (their parameters differ).
  """
  types = config.layer_types or ("full_attention",) * config.num_layers
  kinds = [(types[i], config.layer_is_sparse(i)) for i in range(config.num_layers)]
  for period in range(1, config.num_layers + 1):
    if config.num_layers % period == 0 and all(
        kinds[i] == kinds[i % period] for i in range(config.num_layers)):
      return period
  return config.num_layers


def rope_inverse_frequencies(config: ModelConfig,
                             layer_type: str = "full_attention") -> jax.Array:
  """RoPE inverse frequencies θ^(−2i/d) (Su et al. 2021), with optional context scaling, for the
  layers of `layer_type` (`ModelConfig.layer_rope`: Gemma 3's local layers have their own base).

  `llama3` scaling (Meta, Llama 3.1 report 2024): wavelengths longer than
  original_context/low_freq_factor are divided by `factor`, shorter than
  original_context/high_freq_factor are kept, and those in between interpolate smoothly.
  `linear` scaling (Chen et al. 2023, position interpolation) divides every frequency by `factor`.
  `yarn` (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
  §3.2 "NTK-by-parts"): frequency pairs that turn more than `beta_fast` times over the original
  context are kept, those turning fewer than `beta_slow` times are divided by `factor`, and a
  linear ramp over the pair index blends the two in between (`truncate`, default true, rounds
  the ramp's ends outwards to whole pairs); its attention temperature is
  `rope_attention_factor`.
  """
  dim = config.head_dim
  base, scaling = config.layer_rope(layer_type)
  inv_freq = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  if not scaling:
    return inv_freq
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind == "yarn":
    return _yarn_inverse_frequencies(inv_freq, base, dim, scaling, _yarn_factor(config, scaling))
  factor = float(scaling.get("factor", 1.0))
  if kind == "linear":
    return inv_freq / factor
  if kind == "llama3":
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelength >= old_context / high) & (wavelength <= old_context / low)
    return jnp.where(is_medium, smoothed, scaled)
  return inv_freq


def _yarn_factor(config: ModelConfig, scaling: dict) -> float:
  """YaRN's context extension s: `factor`, or when the config leaves it out, the ratio of the
  model's context to the pretraining one (as transformers reads DeepSeek-V3's configs)."""
  if scaling.get("factor") is not None:
    return float(scaling["factor"])
  return config.max_position_embeddings / float(scaling["original_max_position_embeddings"])


def _yarn_inverse_frequencies(inv_freq, base: float, dim: int, scaling: dict,
                              factor: float) -> jax.Array:
  """YaRN's NTK-by-parts frequencies (see `rope_inverse_frequencies`)."""
  context = float(scaling["original_max_position_embeddings"])
  beta_fast = float(scaling.get("beta_fast") or 32.0)
  beta_slow = float(scaling.get("beta_slow") or 1.0)

  def pair_turning(rotations):
    # the (fractional) pair index whose wavelength fits `rotations` times into the context
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = pair_turning(beta_fast), pair_turning(beta_slow)
  if scaling.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # a ramp of zero width would divide by zero
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
  # ramp 0: fast pairs, kept (extrapolated); ramp 1: slow pairs, interpolated by the factor
  return inv_freq / factor * ramp + inv_freq * (1.0 - ramp)


def rope_attention_factor(config: ModelConfig, layer_type: str = "full_attention") -> float:
  """The factor YaRN multiplies cos and sin by (so q·k by its square): the paper's attention
  temperature, √(1/t) = 0.1·ln(s) + 1 for an extension s (Peng et al. 2023, §3.4), or
  `attention_factor` when the config gives it, or DeepSeek-V3's ratio of two such terms with
  `mscale` / `mscale_all_dim`. 1 for every other RoPE."""
  _, scaling = config.layer_rope(layer_type)
  if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
    return 1.0
  if scaling.get("attention_factor") is not None:
    return float(scaling["attention_factor"])
  factor = _yarn_factor(config, scaling)

  def temperature(mscale=1.0):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

  mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
  if mscale and mscale_all_dim:
    return temperature(float(mscale)) / temperature(float(mscale_all_dim))
  return temperature()


@flax.struct.dataclass
class RopeTable:
  """What a layer rotates q and k with: inverse frequencies [D/2], the static factor on cos and
  sin (`rope_attention_factor`) and, once `at` has placed it, the forward's (cos, sin) [B, T, 1, D],
  computed once for all its layers."""

  inv_freq: jax.Array
  attention_factor: float = flax.struct.field(pytree_node=False, default=1.0)
  cos: jax.Array | None = None
  sin: jax.Array | None = None

  def at(self, positions: jax.Array) -> "RopeTable":
    """This table with the angles of positions [B, T]."""
    cos, sin = rope_angles(positions, self.inv_freq, self.attention_factor)
    return self.replace(cos=cos, sin=sin)

  def apply(self, x: jax.Array) -> jax.Array:
    """x [B, T, H, D] rotated by the angles `at` computed."""
    if self.cos is None:
      raise ValueError("RopeTable.apply needs the angles of the forward's positions: call "
                       "`at(positions)` first (Transformer.run_blocks does)")
    return rotate(x, self.cos, self.sin)


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer for B rows of up to S tokens.

  k[l]: [B, K, D, S] and v[l]: [B, K, S, D] (k, v a tuple of L arrays; one [L, …] array each for
  a scanned model, `stacked`). Heads before length, so attention over the cache reads it in place
  (a [B, S, K, D] layout made XLA transpose, i.e. copy, the whole cache at every decode step);
  keys with their length last, so a decode step's q·k, a sum over D, runs along the keys in
  vector lanes (over [B, K, S, D] it was a horizontal sum per key: 26-32 % of the attention's
  time more on an AVX2 CPU, 18 % on an AVX-512 one; benchmarks/RESULTS.md, "The keys cache
  stored length-last"). `KEYS_LENGTH_AXIS` and `VALUES_LENGTH_AXIS` name the S axis of one
  layer's buffer. pos [B, S] int32 is the position of each cached token, −1 where empty; the
  attention mask is derived from it, so rows may hold sequences of different lengths.
  K and D of k and of v are the config's `kv_cache_layout`: num_kv_heads × head_dim for both,
  or, for latent attention, one head of the latent (k) and one of the shared RoPE key (v).
  """

  KEYS_LENGTH_AXIS = primitives.KEYS_LENGTH_AXIS
  VALUES_LENGTH_AXIS = primitives.VALUES_LENGTH_AXIS

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  pos: jax.Array

  @staticmethod
  def buffer_shapes(config: ModelConfig, batch: int, max_len: int):
    """(shape of one layer's k buffer, of its v buffer)."""
    (k_heads, k_width), (v_heads, v_width) = config.kv_cache_layout()
    return (batch, k_heads, k_width, max_len), (batch, v_heads, max_len, v_width)

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *,
           stacked: bool = False) -> "KVCache":
    pos = jnp.full((batch, max_len), -1, jnp.int32)
    k_shape, v_shape = cls.buffer_shapes(config, batch, max_len)
    if stacked:
      layers = (config.num_layers,)
      return cls(k=jnp.zeros(layers + k_shape, dtype), v=jnp.zeros(layers + v_shape, dtype),
                 pos=pos)
    return cls(k=tuple(jnp.zeros(k_shape, dtype) for _ in range(config.num_layers)),
               v=tuple(jnp.zeros(v_shape, dtype) for _ in range(config.num_layers)), pos=pos)

  @property
  def stacked(self) -> bool:
    return not isinstance(self.k, tuple)

  @staticmethod
  def kv_axes(stacked: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Logical axes of a k array and of a v array (one layer's, or the stack's)."""
    layers = ("layers",) * stacked
    return (layers + ("batch", "kv_heads", "head_dim", "length"),
            layers + ("batch", "kv_heads", "length", "head_dim"))

  def map_layers(self, fn, *others: "KVCache") -> "KVCache":
    """The cache with k and v replaced by fn(a layer's buffer, the same layer's of each of
    `others`); pos is kept. On a stacked cache fn is vmapped over the layers axis: one batched
    operation, done in place where fn updates its buffer. Row selections and row updates (a
    sampler's slots, axis 0) read the same in either layout through it."""
    return self.map_length(lambda *buffers, axis: fn(*buffers), *others)

  def map_length(self, fn, *others: "KVCache") -> "KVCache":
    """`map_layers` for an fn that also takes the length axis of the buffer it is given
    (`axis=`): k and v hold their length on different axes."""
    def over(mine, theirs, axis):
      if self.stacked:
        return jax.vmap(lambda *a: fn(*a, axis=axis))(mine, *theirs)
      return tuple(fn(*layer, axis=axis) for layer in zip(mine, *theirs))
    return self.replace(k=over(self.k, [o.k for o in others], self.KEYS_LENGTH_AXIS),
                        v=over(self.v, [o.v for o in others], self.VALUES_LENGTH_AXIS))

  def first_entries(self, length: int, rows=None) -> "KVCache":
    """The cache's first `length` entries of every row (of `rows` only, given an index array)."""
    select = slice(None) if rows is None else rows
    return self.map_length(
        lambda a, axis: jax.lax.slice_in_dim(a[select], 0, length, axis=axis)).replace(
            pos=self.pos[select, :length])

  def with_first_entries(self, part: "KVCache", rows=None) -> "KVCache":
    """This cache with its first entries (of `rows` only) overwritten by `part`'s
    (`first_entries`' inverse)."""
    length = part.max_len
    select = slice(None) if rows is None else rows

    def put(a, b, axis):
      index = [select] + [slice(None)] * (a.ndim - 1)
      index[axis] = slice(0, length)
      return a.at[tuple(index)].set(b)
    return self.map_length(put, part).replace(pos=self.pos.at[select, :length].set(part.pos))

  @property
  def max_len(self) -> int:
    return self.pos.shape[1]

  def layer(self, index: int):
    """(k, v) of layer `index`, what `Attention` takes as its cache."""
    return self.k[index], self.v[index]

  def stack(self):
    """(k, v) of a stacked cache, what a scanned stack carries."""
    return self.k, self.v


def _scatter_rows(buffer: jax.Array, rows_index: jax.Array, values: jax.Array) -> jax.Array:
  """buffer[b, rows_index[b, t]] = values[b, t]; indices outside the buffer are dropped."""
  batch = jnp.arange(buffer.shape[0])[:, None]
  return buffer.at[batch, rows_index].set(values, mode="drop")


def _window(config: ModelConfig, layer_index: int) -> int | None:
  """The attention window of a layer (None: global attention)."""
  sliding = config.layer_types[layer_index] == "sliding_attention"
  return config.sliding_window if sliding else None


class Attention(nnx.Module):

  def __init__(self, config: ModelConfig, layer_index: int, *, param_dtype, rngs):
    c = config
    self.config = c
    self.window = _window(c, layer_index)
    self.kernel = "auto"  # training attention kernel; `Transformer.use_attention_kernel` sets it
    self.q_proj = param(rngs, (c.hidden_size, c.num_heads, c.head_dim), param_dtype,
                         ("embed", "heads", "head_dim"))
    self.k_proj = param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim), param_dtype,
                         ("embed", "kv_heads", "head_dim"))
    self.v_proj = param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim), param_dtype,
                         ("embed", "kv_heads", "head_dim"))
    self.o_proj = param(rngs, (c.num_heads, c.head_dim, c.hidden_size), param_dtype,
                         ("heads", "head_dim", "embed"))
    if c.attention_bias:
      self.q_bias = param(rngs, (c.num_heads, c.head_dim), param_dtype, ("heads", "head_dim"))
      self.k_bias = param(rngs, (c.num_kv_heads, c.head_dim), param_dtype,
                           ("kv_heads", "head_dim"))
      self.v_bias = param(rngs, (c.num_kv_heads, c.head_dim), param_dtype,
                           ("kv_heads", "head_dim"))
    if c.qk_norm:
      # Qwen3 scales by w; Gemma 3 by (1 + w) like its other norms (its checkpoints store w − 1).
      # OLMoE normalises each whole projection (every head together) instead of each head.
      q_width, k_width = c.head_dim, c.head_dim
      if not c.qk_norm_per_head:
        q_width, k_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
      self.q_norm = RMSNorm(q_width, eps=c.rms_norm_eps, plus_one=c.norm_plus_one,
                            param_dtype=param_dtype)
      self.k_norm = RMSNorm(k_width, eps=c.rms_norm_eps, plus_one=c.norm_plus_one,
                            param_dtype=param_dtype)
    if c.attention_output_bias:
      self.o_bias = param(rngs, (c.hidden_size,), param_dtype, ("embed",))
    if c.attention_sinks:
      # one logit per query head, always used in float32 (it joins the float32 softmax)
      self.sinks = param(rngs, (c.num_heads,), param_dtype, ("heads",))

  def project_qkv(self, x, rope):
    dtype = x.dtype
    q = project("td,dhk->thk", x, weight(self.q_proj, dtype))
    k = project("td,dhk->thk", x, weight(self.k_proj, dtype))
    v = project("td,dhk->thk", x, weight(self.v_proj, dtype))
    if self.config.attention_bias:
      q = q + self.q_bias[...].astype(dtype)
      k = k + self.k_bias[...].astype(dtype)
      v = v + self.v_bias[...].astype(dtype)
    if self.config.qk_norm and self.config.qk_norm_per_head:
      q, k = self.q_norm(q), self.k_norm(k)
    elif self.config.qk_norm:
      q = self.q_norm(q.reshape(*q.shape[:2], -1)).reshape(q.shape)
      k = self.k_norm(k.reshape(*k.shape[:2], -1)).reshape(k.shape)
    if self.config.clip_qkv is not None:
      clip = self.config.clip_qkv
      q, k, v = (jnp.clip(a, -clip, clip) for a in (q, k, v))
    return rope.apply(q), rope.apply(k), v

  def output(self, attended):
    out = project("thk,hkd->td", attended, weight(self.o_proj, attended.dtype))
    if self.config.attention_output_bias:
      out = out + self.o_bias[...].astype(out.dtype)
    return out

  def __call__(self, x, positions, key_positions, rope, cache_kv=None, write_index=None,
               segment_ids=None, layer=None):
    """Self-attention of x [B, T, D]; with `cache_kv` (a layer's `KVCache` buffers) the new k/v
    are written into it first (into layer `layer` of stacked [L, …] buffers, when given)."""
    q, k, v = self.project_qkv(x, rope)
    sinks = self.sinks[...].astype(jnp.float32) if self.config.attention_sinks else None
    options = dict(scale=self.config.attention_scale, softcap=self.config.attn_logit_softcap,
                   window=self.window, sinks=sinks)
    if cache_kv is not None and len(cache_kv) == 3:  # a paged cache (models/kv_pages.py)
      new_cache_kv = kv_pages.write(cache_kv, k, v, layer)
      (k_pool, offset), (v_pool, _) = (kv_pages.layer_view(pool, layer)
                                       for pool in new_cache_kv[:2])
      attended = kernels.paged_decode_attention(q, k_pool, v_pool, offset, new_cache_kv[2],
                                                positions, key_positions, **options)
      return self.output(attended), new_cache_kv
    if cache_kv is not None:
      slots = write_index[:, None] + jnp.arange(x.shape[1])[None, :]
      k_all = scatter_cache(cache_kv[0], slots, k.astype(cache_kv[0].dtype), layer,
                            length_axis=KVCache.KEYS_LENGTH_AXIS)
      v_all = scatter_cache(cache_kv[1], slots, v.astype(cache_kv[1].dtype), layer)
      new_cache_kv = (k_all, v_all)
      # Only the first key_positions.shape[1] cache slots are read (see `Transformer.decode`).
      read = key_positions.shape[1]
      k_layer, v_layer = k_all, v_all
      if layer is not None:
        k_layer = jax.lax.dynamic_index_in_dim(k_all, layer, 0, keepdims=False)
        v_layer = jax.lax.dynamic_index_in_dim(v_all, layer, 0, keepdims=False)
      k, v = (jax.lax.slice_in_dim(a, 0, read, axis=axis).astype(x.dtype)
              for a, axis in ((k_layer, KVCache.KEYS_LENGTH_AXIS),
                              (v_layer, KVCache.VALUES_LENGTH_AXIS)))
    else:
      new_cache_kv = None
    if cache_kv is not None:
      attended = kernels.decode_attention(q, k, v, positions, key_positions, **options)
    else:
      attended = kernels.training_attention(q, k, v, positions, key_positions, segment_ids,
                                            kernel=self.kernel, **options)
    return self.output(attended), new_cache_kv


class MLP(nnx.Module):
  """Gated MLP: down(act(gate(x)) · up(x)); SwiGLU (Shazeer 2020) or GeGLU for Gemma. Of width
  `intermediate_size` (default: the config's; a MoE layer's shared experts have their own)."""

  def __init__(self, config: ModelConfig, *, param_dtype, rngs, intermediate_size=None):
    d, f = config.hidden_size, intermediate_size or config.intermediate_size
    self.activation = config.activation
    self.gate_proj = param(rngs, (d, f), param_dtype, ("embed", "mlp"))
    self.up_proj = param(rngs, (d, f), param_dtype, ("embed", "mlp"))
    self.down_proj = param(rngs, (f, d), param_dtype, ("mlp", "embed"))

  def __call__(self, x):
    dtype = x.dtype
    gate = constrain(project("td,df->tf", x, weight(self.gate_proj, dtype)),
                     ("batch", "length", "mlp"))
    up = constrain(project("td,df->tf", x, weight(self.up_proj, dtype)),
                   ("batch", "length", "mlp"))
    if self.activation == "silu":
      hidden = jax.nn.silu(gate) * up
    else:
      hidden = jax.nn.gelu(gate, approximate=True) * up
    return project("tf,fd->td", hidden, weight(self.down_proj, dtype))


class Block(nnx.Module):
  """Pre-norm residual block; Gemma 2 and Gemma 3 add a norm after attention and after the MLP.
  The MLP of a MoE model's sparse layers is routed experts (`reasoning_rl.models.moe.MoE`, with
  its shared experts an `MLP`); the attention of a latent-attention model (DeepSeek-V3) is
  `reasoning_rl.models.mla.LatentAttention`."""

  def __init__(self, config: ModelConfig, layer_index: int, *, param_dtype, rngs):
    def norm():
      return RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                     plus_one=config.norm_plus_one, param_dtype=param_dtype)

    self.attn_norm = norm()
    attention = Attention if config.mla is None else mla_lib.LatentAttention
    self.attn = attention(config, layer_index, param_dtype=param_dtype, rngs=rngs)
    self.mlp_norm = norm()
    self.sparse = config.layer_is_sparse(layer_index)
    if self.sparse:
      shared = None
      if config.moe.num_shared_experts:
        width = config.moe.num_shared_experts * config.moe.intermediate_size
        shared = MLP(config, param_dtype=param_dtype, rngs=rngs, intermediate_size=width)
      self.mlp = moe_lib.MoE(config, param_dtype=param_dtype, rngs=rngs, shared_experts=shared)
    else:
      self.mlp = MLP(config, param_dtype=param_dtype, rngs=rngs)
    self.sandwich = config.sandwich_norms
    if self.sandwich:
      self.attn_post_norm = norm()
      self.mlp_post_norm = norm()

  def __call__(self, x, positions, key_positions, rope, cache_kv=None, write_index=None,
               segment_ids=None, layer=None, routing: "Routing | None" = None):
    """(x after the block, its layer's new (k, v) or None, its `RouterStats` or None)."""
    attn_out, new_cache_kv = self.attn(self.attn_norm(x), positions, key_positions, rope,
                                       cache_kv, write_index, segment_ids, layer)
    if self.sandwich:
      attn_out = self.attn_post_norm(attn_out)
    x = x + attn_out
    stats = None
    if self.sparse:
      routing = routing or Routing(token_mask=positions >= 0)
      mlp_out, stats = self.mlp(self.mlp_norm(x), routing.token_mask, routing.recorded,
                                routing.replay)
    else:
      mlp_out = self.mlp(self.mlp_norm(x))
    if self.sandwich:
      mlp_out = self.mlp_post_norm(mlp_out)
    return x + mlp_out, new_cache_kv, stats


@flax.struct.dataclass
class Routing:
  """What a forward tells its sparse layers besides x (MoE models only).

  token_mask [B, T]: the real tokens (router statistics count only these).
  recorded: [B, T, k] int32 of one layer inside a block, or [L_sparse, B, T, k] for the whole
    stack (`Transformer.run_blocks`): the experts a sampler chose; None when unknown.
  replay (static): route every token to `recorded` instead of the router's own top-k (R3).
  """

  token_mask: jax.Array
  recorded: jax.Array | None = None
  replay: bool = flax.struct.field(pytree_node=False, default=False)

  def for_layer(self, sparse_index) -> "Routing":
    if self.recorded is None:
      return self
    return self.replace(recorded=self.recorded[sparse_index])


def _stack_stats(stats: list) -> moe_lib.RouterStats | None:
  """Per-layer `RouterStats` stacked on a leading axis (None for no sparse layer)."""
  if not stats:
    return None
  return jax.tree.map(lambda *layers: jnp.stack(layers), *stats)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
  """Position of each token counted over real tokens only; −1 at padding.

  A left-padded row [0, 0, a, b, c] gets [−1, −1, 0, 1, 2], so it computes exactly what the unpadded
  sequence [a, b, c] computes; the negative marks padding keys as never attended.
  """
  mask = attention_mask.astype(jnp.int32)
  return jnp.where(mask > 0, jnp.cumsum(mask, axis=-1) - 1, -1)


class Transformer(nnx.Module):
  """Decoder-only language model; see the module docstring for the two entry points."""

  def __init__(self, config: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs, scan_layers: bool = False):
    c = config
    self.config = c
    self.dtype = jnp.dtype(dtype)
    self.param_dtype = jnp.dtype(param_dtype)
    self.embed = param(rngs, (c.vocab_size, c.hidden_size), param_dtype, ("vocab", "embed"))
    # Built block by block in both layouts, so a seed gives the same weights either way.
    blocks = [Block(c, i, param_dtype=param_dtype, rngs=rngs) for i in range(c.num_layers)]
    if scan_layers and len({block.sparse for block in blocks}) > 1:
      raise ValueError("scan_layers: this MoE model mixes dense and sparse layers, whose "
                       "parameters differ, and a scanned stack needs every layer alike; use "
                       "the loop layout (scan_layers=False)")
    self.scan_layers = scan_layers
    self.layers = _stack_blocks(blocks) if scan_layers else nnx.List(blocks)
    self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, plus_one=c.norm_plus_one,
                              param_dtype=param_dtype)
    if not c.tie_word_embeddings:
      self.lm_head = param(rngs, (c.hidden_size, c.vocab_size), param_dtype, ("embed", "vocab"))

  def use_grouped_matmul(self, implementation: str) -> "Transformer":
    """Computes the experts of sparse layers with `implementation` (one of
    `reasoning_rl.kernels.grouped_matmul.GROUPED_MATMULS`); a static choice in the graphdef."""
    grouped_matmul.resolve(implementation)  # validates the name
    for block in [self.layers] if self.scan_layers else self.layers:
      if block.sparse:
        block.mlp.grouped_matmul = implementation
    return self

  def use_attention_kernel(self, kernel: str) -> "Transformer":
    """Computes training attention with `kernel` (one of `reasoning_rl.kernels.TRAINING_KERNELS`;
    "auto", the default, picks the backend's). A static choice: it travels in the graphdef."""
    kernels.validate_kernel_name(kernel)
    for block in [self.layers] if self.scan_layers else self.layers:
      block.attn.kernel = kernel
    return self

  # ------------------------------------------------------------------------------- pieces

  def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
    x = jnp.take(self.embed[...], token_ids, axis=0).astype(self.dtype)
    if self.config.scale_embeddings:
      x = x * jnp.asarray(math.sqrt(self.config.hidden_size), self.dtype)
    return x

  def output_kernel(self) -> jax.Array:
    """[D, V] projection to the vocabulary (the transposed embedding when tied)."""
    if self.config.tie_word_embeddings:
      return self.embed[...].T
    return self.lm_head[...]

  def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [..., D] → logits [..., V] in float32 (soft-capped for Gemma 2)."""
    # Rows flattened into one axis, as in `project`: a plain matmul for the kernel's gradient.
    rows = hidden.reshape(-1, hidden.shape[-1])
    kernel = self.output_kernel().astype(hidden.dtype)
    if cpu_products.applies(rows, kernel):
      if self.config.tie_word_embeddings:  # the embedding's [D, V] transpose as data, which
        kernel = cpu_products.physical_transpose(kernel.T)  # XLA's bfloat16 kernels need
      logits = cpu_products.matmul(rows, kernel, jnp.float32)
    else:
      logits = jnp.dot(rows, kernel, preferred_element_type=jnp.float32)
    logits = logits.reshape(*hidden.shape[:-1], -1)
    cap = self.config.final_logit_softcap
    if cap:
      logits = jnp.tanh(logits / cap) * cap
    return logits

  # ------------------------------------------------------------------------------- the block stack

  def run_blocks(self, x, positions, key_positions, *, cache: KVCache | None = None,
                 write_index=None, remat: bool | str = False, segment_ids=None,
                 routing: Routing | None = None):
    """The stack of blocks over embedded x [B, T, D]: (x after the last block, (keys, values) of
    every layer written into `cache` or None without one, the sparse layers' `RouterStats`
    stacked on a leading axis or None for a dense model).

    Both entry points run their blocks here, so this one method holds every projection the model
    makes; `reasoning_rl.lora` intercepts it (qwix) to add adapters to the full forward and to
    decoding alike. `remat`: a name of REMAT_POLICIES or a bool (`remat_policy`). `routing`: the
    real tokens and any recorded experts (MoE models; default: real tokens are positions ≥ 0).
    """
    # One table per attention type: Gemma 3's local and global layers rotate with different bases.
    ropes = {kind: RopeTable(rope_inverse_frequencies(self.config, kind),
                             rope_attention_factor(self.config, kind)).at(positions)
             for kind in set(self.config.layer_types)}
    policy = remat_policy(remat)
    residual_axes = ("batch", "length", None)  # batch-sharded, full width (FSDP-style)
    x = constrain(x, residual_axes)
    if routing is None and self.config.moe is not None:
      routing = Routing(token_mask=positions >= 0)
    if self.scan_layers:
      return self._run_scanned(x, positions, key_positions, ropes, cache, write_index,
                               policy, segment_ids, routing)

    def run_block(block, x, cache_kv, rope, layer_routing):
      return block(x, positions, key_positions, rope, cache_kv, write_index, segment_ids,
                   routing=layer_routing)

    if policy != "none":
      run_block = nnx.remat(run_block, policy=_checkpoint_policy(policy))
    new_k, new_v, stats = [], [], []
    for layer, block in enumerate(self.layers):
      cache_kv = None if cache is None else cache.layer(layer)
      layer_routing = routing.for_layer(len(stats)) if block.sparse else None
      x, written, layer_stats = run_block(block, x, cache_kv,
                                          ropes[self.config.layer_types[layer]],
                                          layer_routing)
      x = constrain(x, residual_axes)
      if written is not None:
        new_k.append(written[0])
        new_v.append(written[1])
      if layer_stats is not None:
        stats.append(layer_stats)
    kv = None if cache is None else (tuple(new_k), tuple(new_v))
    return x, kv, _stack_stats(stats)

  def _run_scanned(self, x, positions, key_positions, ropes, cache, write_index, policy,
                   segment_ids, routing):
    """`run_blocks` of the scanned layout: one `jax.lax.scan` step per `layer_period` blocks.

    The stacked parameters are the scan's input, read one group of p layers per step; x and,
    when decoding, the whole stacked cache are its carry (each block writes its layer in place).
    The p blocks of a step are merged from the one block graph with their own static window, so
    Gemma 2's alternating local / global layers compile as two blocks, not as a traced switch
    (Gemma 3's as six, each local one with the local RoPE table, `ropes` by layer type).
    """
    config = self.config
    period = layer_period(config)
    groups = config.num_layers // period
    residual_axes = ("batch", "length", None)
    graphdef, state = nnx.split(self.layers)
    # With one layer per group the stack is scanned as it is: XLA:CPU gave the [L, 1, …] view a
    # layout that copies every weight each time it runs, once per decode step (inside the loop).
    grouped = state if period == 1 else jax.tree.map(
        lambda a: a.reshape(groups, period, *a.shape[1:]), state)

    def run_block(block_state, x, cache_kv, layer, layer_routing, window, rope):
      block = nnx.merge(graphdef, block_state)
      block.attn.window = window
      return block(x, positions, key_positions, rope, cache_kv, write_index, segment_ids,
                   layer, routing=layer_routing)

    runners = []
    for j in range(period):
      # Layer j of every group has layer j's type (`layer_period`), so its window and RoPE table.
      runner = functools.partial(run_block, window=_window(config, j),
                                 rope=ropes[config.layer_types[j]])
      if policy != "none":
        # prevent_cse=False: inside a scan the loop already keeps XLA from merging the
        # recomputation with the forward (jax.checkpoint's documentation)
        runner = jax.checkpoint(runner, policy=_checkpoint_policy(policy), prevent_cse=False)
      runners.append(runner)

    # Sparse layers per group, and where each of the group's layers sits among them.
    sparse = [config.layer_is_sparse(j) for j in range(period)]
    per_group = sum(sparse)

    def body(carry, inputs):
      x, cache_kv = carry
      group_state, group = inputs
      group_stats = []
      for j in range(period):
        layer = group * period + j
        layer_routing = None
        if sparse[j]:
          layer_routing = routing.for_layer(group * per_group + sum(sparse[:j]))
        layer_state = group_state if period == 1 else jax.tree.map(lambda a, j=j: a[j],
                                                                   group_state)
        x, written, layer_stats = runners[j](layer_state, x, cache_kv, layer, layer_routing)
        x = constrain(x, residual_axes)
        cache_kv = written
        if layer_stats is not None:
          group_stats.append(layer_stats)
      return (x, cache_kv), _stack_stats(group_stats)

    cache_kv = None if cache is None else cache.stack()
    (x, cache_kv), stats = jax.lax.scan(body, (x, cache_kv), (grouped, jnp.arange(groups)))
    if stats is not None:  # [groups, per_group, …] → [L_sparse, …], in layer order
      stats = jax.tree.map(lambda a: a.reshape(groups * per_group, *a.shape[2:]), stats)
    return x, None if cache_kv is None else cache_kv[:2], stats

  # ------------------------------------------------------------------------------- entry points

  def hidden_states(self, token_ids, attention_mask=None, *, positions=None,
                    remat: bool | str = False, segment_ids=None, recorded_experts=None,
                    replay_experts: bool = False, with_router_stats: bool = False):
    """Final-normed hidden states [B, T, D] of a full forward (no cache).

    MoE models: `recorded_experts` [B, T, L_sparse, k] (any integer type) are the experts a
    sampler chose for these tokens; `replay_experts` routes by them instead of the router's own
    top-k (routing replay, `reasoning_rl.models.moe`); `with_router_stats` returns (hidden, the
    `RouterStats` stacked over sparse layers, each field [L_sparse, …]).

    `segment_ids` [B, T] (0 = padding, 1, 2, … = the sequences of a packed row, each with its own
    `positions` from 0) confines attention to each sequence: a packed row computes for each of
    its sequences exactly what that sequence computes alone.

    With `remat` ("full" or True), each block is rematerialised in the backward pass (Chen et al.
    2016, "Training Deep Nets with Sublinear Memory Cost"): only block inputs are kept, and one
    block's activations (attention scores included) are recomputed at a time — about one extra
    forward for a memory cost of one layer instead of all of them; "save_matmuls" keeps the
    projections' outputs too (`_checkpoint_policy`).
    """
    if segment_ids is not None:
      if positions is None:
        raise ValueError("packed rows (segment_ids) need their per-sequence positions")
      attention_mask = (segment_ids > 0).astype(jnp.int32)
    elif attention_mask is None:
      attention_mask = jnp.ones(token_ids.shape, jnp.int32)
    if positions is None:
      positions = positions_from_mask(attention_mask)
    key_positions = jnp.where(attention_mask > 0, positions, -1)
    routing = self._routing(attention_mask > 0, recorded_experts, replay_experts)
    x, _, stats = self.run_blocks(self.embed_tokens(token_ids), positions, key_positions,
                                  remat=remat, segment_ids=segment_ids, routing=routing)
    hidden = self.final_norm(x)
    return (hidden, stats) if with_router_stats else hidden

  def _routing(self, token_mask, recorded_experts, replay: bool) -> Routing | None:
    """The forward's `Routing`; recorded_experts [B, T, L_sparse, k] become the layer-major
    int32 [L_sparse, B, T, k] the stack indexes by sparse layer."""
    if self.config.moe is None:
      if recorded_experts is not None or replay:
        raise ValueError("recorded experts / routing replay given to a dense model")
      return None
    if recorded_experts is not None:
      recorded_experts = jnp.moveaxis(recorded_experts.astype(jnp.int32), 2, 0)
    return Routing(token_mask=token_mask, recorded=recorded_experts, replay=replay)

  def __call__(self, token_ids, attention_mask=None, *, positions=None):
    """Logits [B, T, V] (float32) of a batch that may be left- or right-padded."""
    return self.logits_from_hidden(
        self.hidden_states(token_ids, attention_mask, positions=positions))

  def decode(self, token_ids, positions, cache: KVCache, write_index, *, return_hidden=False,
             key_length: int | None = None, with_router_stats: bool = False):
    """Runs T new tokens per row through the KV cache.

    token_ids, positions [B, T] (position −1 marks padding inside a bucketed prefill);
    write_index [B] is the cache slot of each row's first new token. Returns (logits [B, T, V],
    updated cache), or with `return_hidden` the final-normed hidden states [B, T, D] instead of
    logits (a prefill needs logits at one position only). Tokens are written at slots
    write_index + t, so a row's cache is contiguous.

    key_length (static): attend over cache slots [0, key_length) only, instead of the whole cache.
    The caller guarantees every key a query may see lies there (a sampler whose rows are shorter
    than the cache reads less of it); the result is the same up to float summation order, since
    the slots left out would be masked anyway.

    A paged cache (`kv_pages.PagedKVCache`, with the call's page tables) is written and read
    through its tables instead: write_index still counts a row's entries, which the tables map
    to pages; each row attends over the pages of its read table, gathered or read in place by a
    kernel (`kernels.paged_decode_attention`; key_length is then unused).

    with_router_stats (MoE models): a third result, the sparse layers' `RouterStats` of the new
    tokens (their `experts` are what a rollout records for routing replay).
    """
    if cache.stacked != self.scan_layers:
      raise ValueError(f"a {'stacked' if cache.stacked else 'per-layer'} KV cache for a model "
                       f"with scan_layers={self.scan_layers}: build it with KVCache.init("
                       f"..., stacked={self.scan_layers})")
    if isinstance(cache, kv_pages.PagedKVCache):  # every read through its page tables
      cache, key_positions = cache.addressed(write_index, token_ids.shape[1]).with_positions(
          positions)
      cache_pos = cache.pos
    else:
      slots = write_index[:, None] + jnp.arange(token_ids.shape[1])[None, :]
      cache_pos = _scatter_rows(cache.pos, slots, positions.astype(jnp.int32))
      key_positions = cache_pos if key_length is None else cache_pos[:, :key_length]
    x, (new_k, new_v), stats = self.run_blocks(
        self.embed_tokens(token_ids), positions, key_positions, cache=cache,
        write_index=write_index, routing=self._routing(positions >= 0, None, False))
    hidden = self.final_norm(x)
    new_cache = cache.replace(k=new_k, v=new_v, pos=cache_pos)
    if isinstance(cache, kv_pages.PagedKVCache):
      new_cache = new_cache.replace(address=None)
    out = hidden if return_hidden else self.logits_from_hidden(hidden)
    return (out, new_cache, stats) if with_router_stats else (out, new_cache)


def create_model(config: ModelConfig, *, seed: int = 0, dtype=jnp.float32,
                 param_dtype=jnp.float32, scan_layers: bool = False) -> Transformer:
  """A randomly initialised model (weights ~ N(0, 0.02²), norms neutral); the same weights in
  either layout of the block stack."""
  return Transformer(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(params=seed),
                     scan_layers=scan_layers)


def abstract_model(config: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                   scan_layers: bool = False):
  """The model's structure without allocating weights: (graphdef, abstract state)."""
  model = nnx.eval_shape(lambda: create_model(config, dtype=dtype, param_dtype=param_dtype,
                                              scan_layers=scan_layers))
  return nnx.split(model)


# ------------------------------------------------------------------------------- layouts


def _variables(state) -> list[nnx.Variable]:
  return jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _stack_blocks(blocks) -> Block:
  """One block whose every parameter (LoRA adapters included) is the layers' stacked on a new
  leading axis, logical axis `layers`. The layers must hold the same parameters."""
  states = [nnx.state(block) for block in blocks]
  structure = jax.tree.structure(states[0])
  for layer, state in enumerate(states):
    if jax.tree.structure(state) != structure:
      raise ValueError(
          f"scan_layers: layer {layer} holds other parameters than layer 0 "
          f"({sorted(str(p) for p, _ in nnx.to_flat_state(state))[:4]} …); a scanned stack needs "
          "every layer alike (with LoRA, target_modules must adapt every layer the same way)")
  stacked = jax.tree.map(lambda *values: jnp.stack(values), *states)
  for variable in _variables(stacked):
    variable.set_metadata("logical_axes", ("layers", *variable.get_metadata()["logical_axes"]))
  return nnx.merge(nnx.graphdef(blocks[0]), stacked)


def _with_layers(model: Transformer, layers, scan_layers: bool) -> Transformer:
  """A model sharing `model`'s other weights (no copy), with `layers` as its block stack."""
  graphdef, state = nnx.split(model)
  new = nnx.merge(graphdef, state)
  new.layers = layers
  new.scan_layers = scan_layers
  return new


def stack_layers(model: Transformer) -> Transformer:
  """The model in the scanned layout (see the module docstring): the same function, the same
  weights (shared with `model` outside the block stack, which the caller should drop); LoRA
  adapters and qwix's interception carry over. A scanned model is returned as is."""
  if model.scan_layers:
    return model
  return _with_layers(model, _stack_blocks(list(model.layers)), True)


def unstack_layers(model: Transformer) -> Transformer:
  """The model in the loop layout (inverse of `stack_layers`): parameter paths `layers/<i>/…`,
  what files and LoRA target names are written in. A loop model is returned as is."""
  if not model.scan_layers:
    return model
  graphdef, state = nnx.split(model.layers)
  blocks = []
  for layer in range(model.config.num_layers):
    layer_state = jax.tree.map(lambda a, layer=layer: a[layer], state)
    for variable in _variables(layer_state):
      variable.set_metadata("logical_axes", variable.get_metadata()["logical_axes"][1:])
    block = nnx.merge(graphdef, layer_state)
    block.attn.window = _window(model.config, layer)
    for path, node in nnx.iter_graph(block):
      if isinstance(node, nnx.Module) and hasattr(node, "qwix_path"):
        node.qwix_path = ("layers", layer, *path)  # qwix matches target_modules against it
    blocks.append(block)
  return _with_layers(model, nnx.List(blocks), False)


def logical_axes(state: nnx.State) -> nnx.State:
  """The `logical_axes` metadata of every parameter in a state, as a tree of tuples."""
  return jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state,
                      is_leaf=lambda v: isinstance(v, nnx.Variable))


__all__ = [
    "Attention", "Block", "KVCache", "MLP", "ModelConfig", "REMAT_POLICIES", "RMSNorm",
    "RopeTable", "Transformer", "abstract_model", "apply_rope", "create_model", "layer_period",
    "logical_axes", "positions_from_mask", "remat_policy", "rope_attention_factor",
    "rope_inverse_frequencies", "stack_layers", "unstack_layers",
]
