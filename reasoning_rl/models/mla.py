"""Multi-head latent attention (MLA; DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and
Efficient Mixture-of-Experts Language Model", §2.1), the attention of DeepSeek-V3 (config:
`MLAConfig`, `ModelConfig.mla`).

Per token x, with H heads:
- queries: q = x·W_q, or through a low-rank bottleneck q = RMSNorm(x·W_qa)·W_qb
  (`q_lora_rank`); each head's q splits into q_nope (qk_nope_head_dim) and q_rope
  (qk_rope_head_dim), and q_rope is rotated (RoPE);
- the latent: x·W_kva gives c (kv_lora_rank) and one key k_rope (qk_rope_head_dim) shared by all
  heads, rotated ("decoupled RoPE"); c_kv = RMSNorm(c);
- keys and values of head h are rebuilt from the latent: [k_nope_h, v_h] = c_kv·W_kvb[h], and
  k_h = [k_nope_h, k_rope];
- attention of [q_nope, q_rope] against k_h with scale (qk_nope + qk_rope)^(−1/2) (× mscale² under
  YaRN, below), values v_h (v_head_dim), then the output projection.

The full forward (training, scoring) computes exactly that: keys and values of every head, then
`kernels.training_attention` (v padded with zeros to the query width: one head width for q, k
and v, as the kernels take them; cut back after).

The sampler's cache holds what the keys and values are rebuilt from, not them: c_kv in the k
buffer ([B, 1, kv_lora_rank, S]: length-last, as every keys buffer) and the rotated k_rope in
the v buffer ([B, 1, S, qk_rope_head_dim]) — `ModelConfig.kv_cache_layout`, kv_lora_rank +
qk_rope_head_dim numbers per token and layer where caching the rebuilt keys and values would take
H · (qk_nope + qk_rope + v_head_dim) (DeepSeek-V3: 576 against 40960). Cached attention runs in the
absorbed form (the paper's §2.1.2 remark that W_UK folds into the queries and W_UV into the
output): q_nope·k_nope_h = (q_nope·W_kvb[h]_k^T)·c_kv, so each head's query is carried into
the latent space once and scored against the cached c_kv directly, plus q_rope·k_rope; the
probabilities weight c_kv and the result goes through W_kvb[h]_v. The same function as the full
forward up to float summation order (tests/test_model_parity.py checks decoding against it). The
paged cache (`models/kv_pages.py`) holds the same two buffers in pages and is read by gathering a
layer's pages (the TPU paged-attention kernel computes grouped-query attention only).

YaRN (Peng et al. 2023): DeepSeek-V3's config scales RoPE with YaRN and multiplies the softmax
scale by mscale(factor, mscale_all_dim)², mscale(s, m) = 0.1·m·ln(s) + 1 for s > 1
(`softmax_scale`, as transformers' DeepseekV3Attention does). YaRN's rotary frequencies and its
attention factor (mscale / mscale_all_dim, by which transformers multiplies cos and sin, so in
MLA q_rope and k_rope only) belong with the RoPE tables (`rope_inverse_frequencies`), not here;
DeepSeek-V3's published configs set mscale = mscale_all_dim, which makes that factor 1.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from reasoning_rl import kernels
from reasoning_rl.kernels import reference
from reasoning_rl.models import kv_pages, primitives
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.primitives import RMSNorm, param, project, scatter_cache, weight

# The bottleneck norms' epsilon: DeepSeek's (and transformers') q_a / kv_a norms are built with
# their default 1e-6, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float) -> float:
  """YaRN's attention temperature term 0.1 · mscale · ln(factor) + 1 (1 when not extending)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
  """qk_head_dim^(−1/2) (qk_nope + qk_rope), times mscale(factor, mscale_all_dim)² when the RoPE
  scaling sets `mscale_all_dim` (DeepSeek-V3's YaRN configs)."""
  scale = qk_head_dim ** -0.5
  scaling = rope_scaling or {}
  if scaling.get("mscale_all_dim"):
    scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
  return scale


def absorbed_attention(q_nope, q_rope, latent, rope_keys, kv_b, q_pos, k_pos, *,
                       scale: float) -> jax.Array:
  """Latent attention over a cache, in the absorbed form (module docstring).

  q_nope [B, T, H, n], q_rope [B, T, H, e]: the new tokens' queries (q_rope rotated); latent
  [B, S, r] and rope_keys [B, S, e]: the cache's c_kv and rotated shared keys; kv_b [r, H, n + v]
  the latent's expansion; q_pos [B, T], k_pos [B, S] positions (−1: padding / empty), masked as
  `kernels.reference.allowed` masks them. Returns the heads' outputs [B, T, H, v]. Scores and
  softmax in float32.
  """
  nope = q_nope.shape[-1]
  absorbed = jnp.einsum("bthn,rhn->bthr", q_nope, kv_b[..., :nope])
  scores = (jnp.einsum("bthr,bsr->bhts", absorbed, latent, preferred_element_type=jnp.float32)
            + jnp.einsum("bthe,bse->bhts", q_rope, rope_keys,
                         preferred_element_type=jnp.float32)) * scale
  mask = reference.allowed(q_pos, k_pos, window=None)
  scores = jnp.where(mask[:, None], scores, reference.MASKED_SCORE)
  probs = jax.nn.softmax(scores, axis=-1).astype(latent.dtype)
  mixed = jnp.einsum("bhts,bsr->bthr", probs, latent)
  return jnp.einsum("bthr,rhv->bthv", mixed, kv_b[..., nope:])


class LatentAttention(nnx.Module):
  """MLA in place of `transformer.Attention`, with the same call (module docstring)."""

  def __init__(self, config: ModelConfig, layer_index: int, *, param_dtype, rngs):
    del layer_index  # every layer alike (no sliding window: ModelConfig refuses one)
    c, m = config, config.mla
    d, heads = c.hidden_size, c.num_heads
    self.config = c
    self.window = None  # what the scanned stack sets on every attention module
    self.kernel = "auto"  # training attention kernel; `Transformer.use_attention_kernel` sets it
    self.scale = softmax_scale(m.qk_head_dim, c.rope_scaling)

    def norm(width):
      return RMSNorm(width, eps=LATENT_NORM_EPS, plus_one=False, param_dtype=param_dtype)

    if m.q_lora_rank is None:
      self.q_proj = param(rngs, (d, heads, m.qk_head_dim), param_dtype,
                          ("embed", "heads", "head_dim"))
    else:
      self.q_a_proj = param(rngs, (d, m.q_lora_rank), param_dtype, ("embed", None))
      self.q_a_norm = norm(m.q_lora_rank)
      self.q_b_proj = param(rngs, (m.q_lora_rank, heads, m.qk_head_dim), param_dtype,
                            (None, "heads", "head_dim"))
    self.kv_a_proj = param(rngs, (d, m.kv_lora_rank + m.qk_rope_head_dim), param_dtype,
                           ("embed", None))
    self.kv_a_norm = norm(m.kv_lora_rank)
    self.kv_b_proj = param(rngs, (m.kv_lora_rank, heads, m.qk_nope_head_dim + m.v_head_dim),
                           param_dtype, (None, "heads", "head_dim"))
    self.o_proj = param(rngs, (heads, m.v_head_dim, d), param_dtype,
                        ("heads", "head_dim", "embed"))

  def _rope(self, x, rope):
    """x [B, T, heads, e] rotated by the layer's `transformer.RopeTable` (its YaRN attention
    factor scales these rotated parts only: q_nope and the latent are not rotated). An
    interleaved checkpoint pairs (x0, x1), (x2, x3), …: its even dimensions then its odd ones
    are the halves `primitives.rotate` rotates (the same dot products, as queries and keys are
    laid out alike)."""
    if self.config.mla.rope_interleave:
      x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return rope.apply(x)

  def queries(self, x, rope):
    """(q_nope [B, T, H, n], rotated q_rope [B, T, H, e])."""
    dtype = x.dtype
    if self.config.mla.q_lora_rank is None:
      q = project("td,dhk->thk", x, weight(self.q_proj, dtype))
    else:
      bottleneck = self.q_a_norm(project("td,dr->tr", x, weight(self.q_a_proj, dtype)))
      q = project("tr,rhk->thk", bottleneck, weight(self.q_b_proj, dtype))
    nope = self.config.mla.qk_nope_head_dim
    return q[..., :nope], self._rope(q[..., nope:], rope)

  def latent(self, x, rope):
    """(c_kv [B, T, r] normed, the rotated shared key k_rope [B, T, e]): what the cache holds."""
    rank = self.config.mla.kv_lora_rank
    compressed = project("td,dr->tr", x, weight(self.kv_a_proj, x.dtype))
    rope_key = self._rope(compressed[:, :, None, rank:], rope)[:, :, 0]
    return self.kv_a_norm(compressed[..., :rank]), rope_key

  def expanded_attention(self, q_nope, q_rope, latent, rope_key, positions, key_positions,
                         segment_ids):
    """The full forward's attention: every head's keys and values rebuilt from the latent."""
    m = self.config.mla
    kv = project("tr,rhk->thk", latent, weight(self.kv_b_proj, latent.dtype))
    shared = jnp.broadcast_to(rope_key[:, :, None, :], (*kv.shape[:3], m.qk_rope_head_dim))
    k = jnp.concatenate([kv[..., :m.qk_nope_head_dim], shared], axis=-1)
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    v = kv[..., m.qk_nope_head_dim:]
    width = max(m.qk_head_dim, m.v_head_dim)  # one head width for q, k, v (zeros add nothing)
    q, k, v = (jnp.pad(a, ((0, 0),) * 3 + ((0, width - a.shape[-1]),)) for a in (q, k, v))
    attended = kernels.training_attention(q, k, v, positions, key_positions, segment_ids,
                                          kernel=self.kernel, scale=self.scale, softcap=None,
                                          window=None)
    return attended[..., :m.v_head_dim]

  def _cache(self, cache_kv, latent, rope_key, write_index, key_positions, layer):
    """(the cache with this call's latents written, the layer's cached latents [B, S, r] and
    shared keys [B, S, e] the queries read): contiguous buffers [B, 1, S, ·] (stacked [L, …]
    with `layer`), or a paged pool with its address (3 entries)."""
    new, shared = latent[:, :, None, :], rope_key[:, :, None, :]
    if len(cache_kv) == 3:  # a paged cache (models/kv_pages.py): the rows' pages gathered
      cache_kv = kv_pages.write(cache_kv, new, shared, layer)
      read_table = cache_kv[2].read_table
      views = []
      for pool in cache_kv[:2]:
        pages, offset = kv_pages.layer_view(pool, layer)
        table = jnp.where(read_table >= 0, read_table + offset, -1)
        views.append(kv_pages.read_pages(pages, table)[:, 0])
      return cache_kv, views[0], views[1]
    slots = write_index[:, None] + jnp.arange(latent.shape[1])[None, :]
    axes = (primitives.KEYS_LENGTH_AXIS, primitives.VALUES_LENGTH_AXIS)
    cache_kv = tuple(scatter_cache(buffer, slots, values.astype(buffer.dtype), layer,
                                   length_axis=axis)
                     for buffer, values, axis in zip(cache_kv, (new, shared), axes))
    read = key_positions.shape[1]  # the first key_length slots (see `Transformer.decode`)
    views = []
    for buffer, axis in zip(cache_kv, axes):
      if layer is not None:
        buffer = jax.lax.dynamic_index_in_dim(buffer, layer, 0, keepdims=False)
      view = jax.lax.slice_in_dim(buffer, 0, read, axis=axis)[:, 0]
      # the latent is stored length-last like every keys buffer: a transpose the products fold in
      views.append(view.swapaxes(1, 2) if axis == primitives.KEYS_LENGTH_AXIS else view)
    return cache_kv, views[0], views[1]

  def __call__(self, x, positions, key_positions, rope, cache_kv=None, write_index=None,
               segment_ids=None, layer=None):
    """Self-attention of x [B, T, D]: (output [B, T, D], the cache with this call's latents
    written, or None without one)."""
    q_nope, q_rope = self.queries(x, rope)
    latent, rope_key = self.latent(x, rope)
    if cache_kv is None:
      attended = self.expanded_attention(q_nope, q_rope, latent, rope_key, positions,
                                         key_positions, segment_ids)
      new_cache_kv = None
    else:
      new_cache_kv, cached, cached_keys = self._cache(cache_kv, latent, rope_key, write_index,
                                                      key_positions, layer)
      attended = absorbed_attention(
          q_nope, q_rope, cached.astype(x.dtype), cached_keys.astype(x.dtype),
          weight(self.kv_b_proj, x.dtype), positions, key_positions, scale=self.scale)
    out = project("thk,hkd->td", attended, weight(self.o_proj, attended.dtype))
    return out, new_cache_kv


__all__ = ["LATENT_NORM_EPS", "LatentAttention", "absorbed_attention", "softmax_scale",
           "yarn_mscale"]
