"""A KV cache in fixed-size pages, read and written through page tables (the sampler's paged
cache, `reasoning_rl.sampler.paged`).

The pool: k, v per layer [P, K, page_size, D] (one [L, P, K, page_size, D] array each for a
scanned model) and pos [P, page_size], the position of each entry (−1: empty). A decode call
comes with two page tables [B, n]: row b's cache entries j·page_size … (j+1)·page_size − 1 are
in page read_table[b, j] (−1: none yet, read as empty), and its new entries go to
write_table[b, j] (P: nowhere; a page other rows share is read-only). Each layer writes its new
keys and values into their pages and reads its row's pages back in the contiguous
[B, K, n·page_size, D] layout the attention takes: one layer's copy at a time, where gathering
every layer's before the call would hold a second cache.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PageAddress:
  """Where a call's new tokens go and which pages its rows read: pages, offsets [B, T] of each
  new token (page P: not written) and the read table [B, n]."""

  pages: jax.Array
  offsets: jax.Array
  read_table: jax.Array


@flax.struct.dataclass
class PagedKVCache:
  """The page pool, with the page tables of the call that uses it (None outside a call)."""

  k: tuple | jax.Array
  v: tuple | jax.Array
  pos: jax.Array
  read_table: jax.Array | None = None
  write_table: jax.Array | None = None
  address: PageAddress | None = None  # set by `Transformer.decode` for its blocks

  @classmethod
  def init(cls, config, num_pages: int, page_size: int, dtype, *,
           stacked: bool) -> "PagedKVCache":
    shape = (num_pages, config.num_kv_heads, page_size, config.head_dim)
    pos = jnp.full((num_pages, page_size), -1, jnp.int32)
    if stacked:
      shape = (config.num_layers, *shape)
      return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), pos=pos)
    return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
               v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)), pos=pos)

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
    return PagedKVCache(k=self.k, v=self.v, pos=self.pos)

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
        read_table=self.read_table))

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


def read_pages(pages: jax.Array, table: jax.Array) -> jax.Array:
  """One layer's pool [P, K, page, D] read through `table` [B, n]: [B, K, n·page, D] (a −1
  page reads page 0, which its positions of −1 mask)."""
  rows, n = table.shape
  picked = pages[jnp.maximum(table, 0)]  # [B, n, K, page, D]
  return picked.swapaxes(1, 2).reshape(rows, pages.shape[1], n * pages.shape[2], pages.shape[3])


def write_and_read(cache_kv, k: jax.Array, v: jax.Array, layer=None):
  """`Attention`'s paged cache step: the new k, v [B, T, K, D] written at their addresses into
  layer `layer` of the pools (`layer` None: the pools are one layer's), then that layer's rows
  read back. Returns ((k pool, v pool, address), k rows, v rows [B, K, n·page, D])."""
  k_pool, v_pool, a = cache_kv
  heads = jnp.arange(k.shape[2])[None, None, :]
  index = (a.pages[:, :, None], heads, a.offsets[:, :, None])
  if layer is not None:
    index = (layer, *index)
  k_pool = k_pool.at[index].set(k.astype(k_pool.dtype), mode="drop")
  v_pool = v_pool.at[index].set(v.astype(v_pool.dtype), mode="drop")
  k_layer, v_layer = k_pool, v_pool
  if layer is not None:
    k_layer = jax.lax.dynamic_index_in_dim(k_pool, layer, 0, keepdims=False)
    v_layer = jax.lax.dynamic_index_in_dim(v_pool, layer, 0, keepdims=False)
  return ((k_pool, v_pool, a), read_pages(k_layer, a.read_table),
          read_pages(v_layer, a.read_table))


__all__ = ["PageAddress", "PagedKVCache", "read_pages", "read_positions", "write_and_read"]
