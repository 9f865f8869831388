"""A Flax NNX decoder-only transformer covering Llama, Qwen2, Qwen3, Gemma and Gemma 2.

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

The model holds no backend branches and no timing notes: what is chosen per backend lives in
`reasoning_rl.kernels`, the measurements behind layout choices in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from reasoning_rl import kernels
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.sharding import constrain

def _weight(param, dtype):
  """A projection's kernel in the compute dtype. Through flax's promote_dtype because qwix
  intercepts it: a quantized base (QLoRA) is passed on as is, for qwix's matmul to consume."""
  return dtypes.promote_dtype((param[...],), dtype=dtype)[0]


def _project(spec: str, x, kernel):
  """x [B, T, …] through a projection kernel: one `jnp.einsum(spec, …)` over the B·T rows
  flattened into one axis (`spec` names that axis t), the result reshaped back to [B, T, …].

  Why flat rows: with B and T as two axes, the kernel's gradient contracts two axes of the
  activations, and XLA:CPU lays the [B, T, F] operand out transposed for it, a strided copy of the
  MLP's widest activation per projection; with one row axis the contraction is a plain matmul
  (benchmarks/RESULTS.md, "Training step: projections over flattened rows"). It stays a
  `jnp.einsum` with the kernel as its second operand, the call qwix intercepts to add LoRA
  adapters."""
  batch, length = x.shape[:2]
  out = jnp.einsum(spec, x.reshape(batch * length, *x.shape[2:]), kernel)
  return out.reshape(batch, length, *out.shape[1:])


def _param(rngs: nnx.Rngs | None, shape, dtype, axes, init: str = "normal", std: float = 0.02):
  if init == "zeros":
    value = jnp.zeros(shape, dtype)
  elif init == "ones":
    value = jnp.ones(shape, dtype)
  else:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
  """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32.

  y = x / sqrt(mean(x²) + eps) · w, or · (1 + w) for Gemma (whose checkpoints store w − 1).
  """

  def __init__(self, dim: int, *, eps: float, plus_one: bool, param_dtype, axes=("norm",)):
    self.eps = eps
    self.plus_one = plus_one
    self.scale = _param(None, (dim,), param_dtype, axes, init="zeros" if plus_one else "ones")

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.plus_one:
      return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
    return normed.astype(x.dtype) * self.scale[...].astype(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> jax.Array:
  """RoPE inverse frequencies θ^(−2i/d) (Su et al. 2021), with optional context scaling.

  `llama3` scaling (Meta, Llama 3.1 report 2024): wavelengths longer than
  original_context/low_freq_factor are divided by `factor`, shorter than
  original_context/high_freq_factor are kept, and those in between interpolate smoothly.
  `linear` scaling (Chen et al. 2023, position interpolation) divides every frequency by `factor`.
  """
  dim = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  scaling = config.rope_scaling
  if not scaling:
    return inv_freq
  kind = scaling.get("rope_type", scaling.get("type"))
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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotates x [B, T, H, D] by its positions [B, T], halves layout (first half · second half)."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer for B rows of up to S tokens.

  k[l], v[l]: [B, K, S, D] — heads before length, so attention over the cache is a batched matmul
  that reads the cache in place (a [B, S, K, D] layout made XLA transpose, i.e. copy, the whole
  cache at every decode step). pos [B, S] int32 is the position of each cached token, −1 where
  empty; the attention mask is derived from it, so rows may hold sequences of different lengths.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  pos: jax.Array

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return cls(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
               pos=jnp.full((batch, max_len), -1, jnp.int32))

  @property
  def max_len(self) -> int:
    return self.pos.shape[1]


def _scatter_rows(buffer: jax.Array, rows_index: jax.Array, values: jax.Array) -> jax.Array:
  """buffer[b, rows_index[b, t]] = values[b, t]; indices outside the buffer are dropped."""
  batch = jnp.arange(buffer.shape[0])[:, None]
  return buffer.at[batch, rows_index].set(values, mode="drop")


def _scatter_cache(buffer: jax.Array, rows_index: jax.Array, values: jax.Array) -> jax.Array:
  """buffer [B, K, S, D] at [b, :, rows_index[b, t]] = values [B, T, K, D]; drops outside."""
  batch = jnp.arange(buffer.shape[0])[:, None, None]
  heads = jnp.arange(buffer.shape[1])[None, :, None]
  return buffer.at[batch, heads, rows_index[:, None, :]].set(values.swapaxes(1, 2), mode="drop")


class Attention(nnx.Module):

  def __init__(self, config: ModelConfig, layer_index: int, *, param_dtype, rngs):
    c = config
    self.config = c
    self.window = c.sliding_window if c.layer_types[layer_index] == "sliding_attention" else None
    self.kernel = "auto"  # training attention kernel; `Transformer.use_attention_kernel` sets it
    self.q_proj = _param(rngs, (c.hidden_size, c.num_heads, c.head_dim), param_dtype,
                         ("embed", "heads", "head_dim"))
    self.k_proj = _param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim), param_dtype,
                         ("embed", "kv_heads", "head_dim"))
    self.v_proj = _param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim), param_dtype,
                         ("embed", "kv_heads", "head_dim"))
    self.o_proj = _param(rngs, (c.num_heads, c.head_dim, c.hidden_size), param_dtype,
                         ("heads", "head_dim", "embed"))
    if c.attention_bias:
      self.q_bias = _param(rngs, (c.num_heads, c.head_dim), param_dtype, ("heads", "head_dim"))
      self.k_bias = _param(rngs, (c.num_kv_heads, c.head_dim), param_dtype,
                           ("kv_heads", "head_dim"))
      self.v_bias = _param(rngs, (c.num_kv_heads, c.head_dim), param_dtype,
                           ("kv_heads", "head_dim"))
    if c.qk_norm:
      self.q_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, plus_one=False,
                            param_dtype=param_dtype)
      self.k_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, plus_one=False,
                            param_dtype=param_dtype)

  def project_qkv(self, x, positions, inv_freq):
    dtype = x.dtype
    q = _project("td,dhk->thk", x, _weight(self.q_proj, dtype))
    k = _project("td,dhk->thk", x, _weight(self.k_proj, dtype))
    v = _project("td,dhk->thk", x, _weight(self.v_proj, dtype))
    if self.config.attention_bias:
      q = q + self.q_bias[...].astype(dtype)
      k = k + self.k_bias[...].astype(dtype)
      v = v + self.v_bias[...].astype(dtype)
    if self.config.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

  def output(self, attended):
    return _project("thk,hkd->td", attended, _weight(self.o_proj, attended.dtype))

  def __call__(self, x, positions, key_positions, inv_freq, cache_kv=None, write_index=None,
               segment_ids=None):
    """Self-attention of x [B, T, D]; with `cache_kv` the new k/v are written into it first."""
    q, k, v = self.project_qkv(x, positions, inv_freq)
    if cache_kv is not None:
      slots = write_index[:, None] + jnp.arange(x.shape[1])[None, :]
      k_all = _scatter_cache(cache_kv[0], slots, k.astype(cache_kv[0].dtype))
      v_all = _scatter_cache(cache_kv[1], slots, v.astype(cache_kv[1].dtype))
      new_cache_kv = (k_all, v_all)
      # Only the first key_positions.shape[1] cache slots are read (see `Transformer.decode`).
      read = key_positions.shape[1]
      k, v = k_all[:, :, :read].astype(x.dtype), v_all[:, :, :read].astype(x.dtype)
    else:
      new_cache_kv = None
    options = dict(scale=self.config.attention_scale, softcap=self.config.attn_logit_softcap,
                   window=self.window)
    if cache_kv is not None:
      attended = kernels.decode_attention(q, k, v, positions, key_positions, **options)
    else:
      attended = kernels.training_attention(q, k, v, positions, key_positions, segment_ids,
                                            kernel=self.kernel, **options)
    return self.output(attended), new_cache_kv


class MLP(nnx.Module):
  """Gated MLP: down(act(gate(x)) · up(x)); SwiGLU (Shazeer 2020) or GeGLU for Gemma."""

  def __init__(self, config: ModelConfig, *, param_dtype, rngs):
    d, f = config.hidden_size, config.intermediate_size
    self.activation = config.activation
    self.gate_proj = _param(rngs, (d, f), param_dtype, ("embed", "mlp"))
    self.up_proj = _param(rngs, (d, f), param_dtype, ("embed", "mlp"))
    self.down_proj = _param(rngs, (f, d), param_dtype, ("mlp", "embed"))

  def __call__(self, x):
    dtype = x.dtype
    gate = constrain(_project("td,df->tf", x, _weight(self.gate_proj, dtype)),
                     ("batch", "length", "mlp"))
    up = constrain(_project("td,df->tf", x, _weight(self.up_proj, dtype)),
                   ("batch", "length", "mlp"))
    if self.activation == "silu":
      hidden = jax.nn.silu(gate) * up
    else:
      hidden = jax.nn.gelu(gate, approximate=True) * up
    return _project("tf,fd->td", hidden, _weight(self.down_proj, dtype))


class Block(nnx.Module):
  """Pre-norm residual block; Gemma 2 adds a norm after attention and after the MLP."""

  def __init__(self, config: ModelConfig, layer_index: int, *, param_dtype, rngs):
    def norm():
      return RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                     plus_one=config.norm_plus_one, param_dtype=param_dtype)

    self.attn_norm = norm()
    self.attn = Attention(config, layer_index, param_dtype=param_dtype, rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = MLP(config, param_dtype=param_dtype, rngs=rngs)
    self.sandwich = config.sandwich_norms
    if self.sandwich:
      self.attn_post_norm = norm()
      self.mlp_post_norm = norm()

  def __call__(self, x, positions, key_positions, inv_freq, cache_kv=None, write_index=None,
               segment_ids=None):
    attn_out, new_cache_kv = self.attn(self.attn_norm(x), positions, key_positions, inv_freq,
                                       cache_kv, write_index, segment_ids)
    if self.sandwich:
      attn_out = self.attn_post_norm(attn_out)
    x = x + attn_out
    mlp_out = self.mlp(self.mlp_norm(x))
    if self.sandwich:
      mlp_out = self.mlp_post_norm(mlp_out)
    return x + mlp_out, new_cache_kv


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
               rngs: nnx.Rngs):
    c = config
    self.config = c
    self.dtype = jnp.dtype(dtype)
    self.param_dtype = jnp.dtype(param_dtype)
    self.embed = _param(rngs, (c.vocab_size, c.hidden_size), param_dtype, ("vocab", "embed"))
    self.layers = nnx.List(
        [Block(c, i, param_dtype=param_dtype, rngs=rngs) for i in range(c.num_layers)])
    self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, plus_one=c.norm_plus_one,
                              param_dtype=param_dtype)
    if not c.tie_word_embeddings:
      self.lm_head = _param(rngs, (c.hidden_size, c.vocab_size), param_dtype, ("embed", "vocab"))

  def use_attention_kernel(self, kernel: str) -> "Transformer":
    """Computes training attention with `kernel` (one of `reasoning_rl.kernels.TRAINING_KERNELS`;
    "auto", the default, picks the backend's). A static choice: it travels in the graphdef."""
    kernels.validate_kernel_name(kernel)
    for block in self.layers:
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
    # Rows flattened into one axis, as in `_project`: a plain matmul for the kernel's gradient.
    rows = hidden.reshape(-1, hidden.shape[-1])
    logits = jnp.dot(rows, self.output_kernel().astype(hidden.dtype),
                     preferred_element_type=jnp.float32).reshape(*hidden.shape[:-1], -1)
    cap = self.config.final_logit_softcap
    if cap:
      logits = jnp.tanh(logits / cap) * cap
    return logits

  # ------------------------------------------------------------------------------- the block stack

  def run_blocks(self, x, positions, key_positions, *, cache: KVCache | None = None,
                 write_index=None, remat: bool = False, segment_ids=None):
    """The stack of blocks over embedded x [B, T, D]: (x after the last block, (keys, values) of
    every layer written into `cache`, or None without one).

    Both entry points run their blocks here, so this one method holds every projection the model
    makes; `reasoning_rl.lora` intercepts it (qwix) to add adapters to the full forward and to
    decoding alike.
    """
    inv_freq = rope_inverse_frequencies(self.config)

    def run_block(block, x, cache_kv):
      return block(x, positions, key_positions, inv_freq, cache_kv, write_index, segment_ids)

    if remat:
      run_block = nnx.remat(run_block)
    residual_axes = ("batch", "length", None)  # batch-sharded, full width (FSDP-style)
    x = constrain(x, residual_axes)
    new_k, new_v = [], []
    for layer, block in enumerate(self.layers):
      cache_kv = None if cache is None else (cache.k[layer], cache.v[layer])
      x, written = run_block(block, x, cache_kv)
      x = constrain(x, residual_axes)
      if written is not None:
        new_k.append(written[0])
        new_v.append(written[1])
    return x, (None if cache is None else (tuple(new_k), tuple(new_v)))

  # ------------------------------------------------------------------------------- entry points

  def hidden_states(self, token_ids, attention_mask=None, *, positions=None, remat=False,
                    segment_ids=None):
    """Final-normed hidden states [B, T, D] of a full forward (no cache).

    `segment_ids` [B, T] (0 = padding, 1, 2, … = the sequences of a packed row, each with its own
    `positions` from 0) confines attention to each sequence: a packed row computes for each of
    its sequences exactly what that sequence computes alone.

    With `remat`, each block is rematerialised in the backward pass (Chen et al. 2016, "Training
    Deep Nets with Sublinear Memory Cost"): only block inputs are kept, and one block's
    activations (attention scores included) are recomputed at a time — about one extra forward
    for a memory cost of one layer instead of all of them.
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
    x, _ = self.run_blocks(self.embed_tokens(token_ids), positions, key_positions, remat=remat,
                           segment_ids=segment_ids)
    return self.final_norm(x)

  def __call__(self, token_ids, attention_mask=None, *, positions=None):
    """Logits [B, T, V] (float32) of a batch that may be left- or right-padded."""
    return self.logits_from_hidden(
        self.hidden_states(token_ids, attention_mask, positions=positions))

  def decode(self, token_ids, positions, cache: KVCache, write_index, *, return_hidden=False,
             key_length: int | None = None):
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
    """
    slots = write_index[:, None] + jnp.arange(token_ids.shape[1])[None, :]
    cache_pos = _scatter_rows(cache.pos, slots, positions.astype(jnp.int32))
    key_positions = cache_pos if key_length is None else cache_pos[:, :key_length]
    x, (new_k, new_v) = self.run_blocks(self.embed_tokens(token_ids), positions, key_positions,
                                        cache=cache, write_index=write_index)
    hidden = self.final_norm(x)
    new_cache = KVCache(k=new_k, v=new_v, pos=cache_pos)
    if return_hidden:
      return hidden, new_cache
    return self.logits_from_hidden(hidden), new_cache


def create_model(config: ModelConfig, *, seed: int = 0, dtype=jnp.float32,
                 param_dtype=jnp.float32) -> Transformer:
  """A randomly initialised model (weights ~ N(0, 0.02²), norms neutral)."""
  return Transformer(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(params=seed))


def abstract_model(config: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32):
  """The model's structure without allocating weights: (graphdef, abstract state)."""
  model = nnx.eval_shape(lambda: create_model(config, dtype=dtype, param_dtype=param_dtype))
  return nnx.split(model)


def logical_axes(state: nnx.State) -> nnx.State:
  """The `logical_axes` metadata of every parameter in a state, as a tree of tuples."""
  return jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state,
                      is_leaf=lambda v: isinstance(v, nnx.Variable))


__all__ = [
    "Attention", "Block", "KVCache", "MLP", "ModelConfig", "RMSNorm", "Transformer",
    "abstract_model", "apply_rope", "create_model", "logical_axes",
    "positions_from_mask", "rope_inverse_frequencies",
]
