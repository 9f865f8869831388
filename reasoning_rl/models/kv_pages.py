"""A KV cache in fixed-size pages, read and written through page tables (the sampler's paged
cache, `reasoning_rl.sampler.paged`).

The pool: k, v per layer [K, P, page_size, D] (one [K, L, P, page_size, D] array each for a
scanned model; K and D of each from `ModelConfig.kv_cache_layout`) and pos [P, page_size], the
position of each entry (−1: empty). Heads lead, as in
the layout of JAX's Pallas TPU paged-attention kernel, so a layer's pool is that kernel's operand
as it stands (a stacked pool's layers fold into its page axis without a copy: layer l's page p is
page l·P + p of the [K, L·P, page_size, D] view, `layer_view`).

A decode call comes with two page tables [B, n]: row b's cache entries j·page_size …
(j+1)·page_size − 1 are in page read_table[b, j] (−1: none yet, read as empty), and its new
entries go to write_table[b, j] (P: nowhere; a page other rows share is read-only). Each layer
writes its new keys and values into their pages (`write`), then attends over its rows' pages
(`kernels.paged_decode_attention`): either gathered into the contiguous [B, K, n·page_size, D]
layout, one layer's copy at a time (where gathering every layer's before the call would hold a
second cache), or read in place by the kernel.

A row's entries are contiguous from entry 0 and an entry's position is its index (the engine
writes a prompt from entry 0 and each token at its position), so `PageAddress.lengths`, the
entries a row holds once the call's tokens are written, is what the kernel masks by.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from reasoning_rl.kernels.paged import read_pages


@flax.struct.dataclass
class PageAddress:
  """Where a call's new tokens go and which pages its rows read: pages, offsets [B, T] of each
  new token (page P: not written) and the read table [B, n]."""

  pages: jax.Array
  offsets: jax.Array
  read_table: jax.Array
  lengths: jax.Array  # [B] entries each row holds after the call's writes
  kernel: str = flax.struct.field(pytree_node=False, default="gather")  # kernels.PAGED_KERNELS
  mesh: object = flax.struct.field(pytree_node=False, default=None)  # the pool's, for a kernel


@flax.struct.dataclass
class PagedKVCache:
  """The page pool, with the page tables of the call that uses it (None outside a call)."""

  k: tuple | jax.Array
  v: tuple | jax.Array
  pos: jax.Array
  read_table: jax.Array | None = None
  write_table: jax.Array | None = None
  address: PageAddress | None = None  # set by `Transformer.decode` for its blocks
  # How the attention reads the pool (`kernels.PAGED_KERNELS`), and the mesh it lives on (a
  # kernel runs per device under it): the engine's static choice, carried to every layer.
  kernel: str = flax.struct.field(pytree_node=False, default="gather")
  mesh: object = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def init(cls, config, num_pages: int, page_size: int, dtype, *,
           stacked: bool) -> "PagedKVCache":
    pos = jnp.full((num_pages, page_size), -1, jnp.int32)
    layers = (config.num_layers,) if stacked else ()
    # heads and width of k and of v: the config's `kv_cache_layout` (latent attention caches
    # other things in each)
    k_shape, v_shape = ((heads, *layers, num_pages, page_size, width)
                        for heads, width in config.kv_cache_layout())
    if stacked:
      return cls(k=jnp.zeros(k_shape, dtype), v=jnp.zeros(v_shape, dtype), pos=pos)
    return cls(k=tuple(jnp.zeros(k_shape, dtype) for _ in range(config.num_layers)),
               v=tuple(jnp.zeros(v_shape, dtype) for _ in range(config.num_layers)), pos=pos)

  @property
  def stacked(self) -> bool:
    return not isinstance(self.k, tuple)

  @property
  def num_pages(self) -> int:
    return self.pos.shape[0]

  @property
  def page_size(self) -> int:
    return self.pos.shape[1]

  @property
  def max_len(self) -> int:
    """Entries a row of the current call reads (its read table's pages)."""
    return self.read_table.shape[1] * self.page_size

  def pool(self) -> "PagedKVCache":
    """The pool alone (tables and address dropped), as the engine keeps it between calls."""
    return PagedKVCache(k=self.k, v=self.v, pos=self.pos, kernel=self.kernel, mesh=self.mesh)

  def layer(self, index: int):
    """(k, v, address) of layer `index`, what `Attention` takes as its cache."""
    return self.k[index], self.v[index], self.address

  def stack(self):
    """(k, v, address) of a stacked pool, what a scanned stack carries."""
    return self.k, self.v, self.address

  def addressed(self, write_index: jax.Array, num_tokens: int) -> "PagedKVCache":
    """The cache with the `PageAddress` of num_tokens new tokens per row at cache entries
    write_index[b] + t, and the positions of those entries (from `positions`) still to set."""
    slots = write_index[:, None] + jnp.arange(num_tokens)[None, :]
    n = self.write_table.shape[1]
    index = slots // self.page_size
    pages = jnp.take_along_axis(self.write_table, jnp.minimum(index, n - 1), axis=1)
    return self.replace(address=PageAddress(
        pages=jnp.where(index < n, pages, self.num_pages), offsets=slots % self.page_size,
        read_table=self.read_table, lengths=write_index + num_tokens, kernel=self.kernel,
        mesh=self.mesh))

  def with_positions(self, positions: jax.Array) -> tuple["PagedKVCache", jax.Array]:
    """(the cache with the new tokens' positions written, the key positions [B, n·page_size]
    its rows read)."""
    a = self.address
    pos = self.pos.at[a.pages, a.offsets].set(positions.astype(jnp.int32), mode="drop")
    return self.replace(pos=pos), read_positions(pos, a.read_table)


def read_positions(pos: jax.Array, table: jax.Array) -> jax.Array:
  """Positions [B, n·page_size] of the entries of page table `table` (−1 for a −1 page)."""
  rows, n = table.shape
  picked = jnp.where(table[:, :, None] >= 0, pos[jnp.maximum(table, 0)], -1)
  return picked.reshape(rows, n * pos.shape[1])


def write(cache_kv, k: jax.Array, v: jax.Array, layer=None):
  """`Attention`'s paged cache step: the new k, v [B, T, K, D] written at their addresses into
  layer `layer` of the pools (`layer` None: the pools are one layer's). Returns
  (k pool, v pool, address)."""
  k_pool, v_pool, a = cache_kv
  heads = jnp.arange(k.shape[2])[None, None, :]
  index = (heads, a.pages[:, :, None], a.offsets[:, :, None])
  if layer is not None:
    index = (heads, layer, *index[1:])
  k_pool = k_pool.at[index].set(k.astype(k_pool.dtype), mode="drop")
  v_pool = v_pool.at[index].set(v.astype(v_pool.dtype), mode="drop")
  return k_pool, v_pool, a


def layer_view(pool: jax.Array, layer=None) -> tuple[jax.Array, jax.Array]:
  """(a [K, pages, page, D] view of layer `layer` of `pool`, the offset of its page 0 there):
  a per-layer pool as it is; a stacked [K, L, P, page, D] one as [K, L·P, page, D] with layer
  l's pages from l·P (a reshape, no copy)."""
  if layer is None:
    return pool, jnp.int32(0)
  heads, layers, pages, page, dim = pool.shape
  return pool.reshape(heads, layers * pages, page, dim), jnp.asarray(layer, jnp.int32) * pages


__all__ = ["PageAddress", "PagedKVCache", "layer_view", "read_pages", "read_positions", "write"]
