"""A paged KV cache for the decode engine: memory for the tokens sequences hold, not slots x length.

`Engine` keeps one cache row of max_prefill_length + max_decode_length entries per slot, whatever
its sequence holds. `PagedEngine` keeps a pool of fixed-size pages instead
(k, v [kv_heads, pages, page_size, head_dim] per layer, and each entry's position) and a page
table on the host: slot s's cache entries j·page_size … (j+1)·page_size − 1 live in page
table[s][j]. Pages are taken from the free list as a sequence grows (before each `generate`
call, enough for the tokens that call may write) and go back when the caller frees the slot
(`free_resource`, which the rollout drivers call when a sample is over) or inserts another
request into it.

Prefix sharing: the samples of a group are inserted from one `Prefix` (`Prefix.with_request`).
The prompt's full pages are written once, by the first insert, and every slot of the group
references them (a count per page; they are freed with their last user). Only the last,
partly filled prompt page is copied per slot, since each sample writes its first tokens into it.
A prompt of 48 tokens in pages of 16 shared by 8 samples holds 3 pages instead of 24.

Decoding reads the pool through page tables: a `generate` call hands the model the pool with
each row's read table (its pages) and write table (the pages it owns alone; shared prompt pages
are read-only), and every attention layer writes its new keys and values into their pages and
attends over its rows' pages (`models.kv_pages`, `kernels.paged_decode_attention`): gathered
into one layer's contiguous copy at a time (never a second whole cache), or read in place by
JAX's Pallas TPU paged-attention kernel (`rollout.kv_page_kernel`; the default on a TPU with a
bfloat16 cache). Greedy and sampled tokens are the same as `Engine`'s (tests/test_paged_kv.py).

A pool smaller than every slot's whole length (`rollout.kv_pages`) can run short. Before each
call `slots_to_preempt` names the newest live slots whose pages the others need, and
`rollout.stream_groups` re-queues their samples; it continues them later from their tokens (a
prefill and an `append_to_slot`), so the completions do not change (vLLM's recompute
preemption). Inserts wait until `has_room_for` a prompt. A caller that does neither gets a
SamplingError naming `rollout.kv_pages` when the free list runs out.

The pool is sharded like the contiguous cache's heads (`kv_heads` over the tensor axis) and
replicated over the sampler mesh's data axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from reasoning_rl import sharding as sharding_lib
from reasoning_rl.errors import SamplingError
from reasoning_rl.kernels import paged as paged_kernels
from reasoning_rl.models import kv_pages
from reasoning_rl.models.kv_pages import PagedKVCache
from reasoning_rl.models.transformer import KVCache
from reasoning_rl.sampler.engine import DecodeState, Engine, Prefix, spread_rows, start_slot


def gather_pages(pool: PagedKVCache, table) -> KVCache:
  """The contiguous `KVCache` (keys [rows, K, D, n·page_size], values [rows, K, n·page_size, D])
  of page table `table` [rows, n] (an append's row, `PagedEngine.append_to_slot`). Pages hold
  keys as they hold values, [K, P, page, D]."""
  def read(pages, keys):  # [K, P, page, D]
    entries = kv_pages.read_pages(pages, table)
    return entries.swapaxes(2, 3) if keys else entries

  def per_layer(pages, keys):
    if pool.stacked:  # [K, L, P, page, D] -> [L, rows, …]
      return jax.vmap(lambda one: read(one, keys), in_axes=1)(pages)
    return tuple(read(one, keys) for one in pages)

  return KVCache(k=per_layer(pool.k, True), v=per_layer(pool.v, False),
                 pos=kv_pages.read_positions(pool.pos, table))


def scatter_pages(pool: PagedKVCache, table, cache: KVCache) -> PagedKVCache:
  """`pool` with page table[r, j] overwritten by the contiguous `cache`'s entries j·page_size …
  of row r; a table entry of num_pages (outside the pool) writes nothing."""
  rows, n = table.shape
  page = pool.page_size

  def write(pages, contiguous, keys):  # pages [K, P, page, D], contiguous a `KVCache` buffer
    if keys:  # [rows, K, D, n * page] -> [rows, K, n * page, D]
      contiguous = contiguous.swapaxes(2, 3)
    split = contiguous.reshape(rows, pages.shape[0], n, page, pages.shape[3])
    split = split.transpose(1, 0, 2, 3, 4)  # [K, rows, n, page, D]
    return pages.at[:, table].set(split.astype(pages.dtype), mode="drop")

  def per_layer(mine, theirs, keys):
    if pool.stacked:  # [K, L, P, page, D] with [L, rows, …]
      return jax.vmap(lambda a, b: write(a, b, keys), in_axes=(1, 0), out_axes=1)(mine, theirs)
    return tuple(write(a, b, keys) for a, b in zip(mine, theirs))

  return pool.replace(k=per_layer(pool.k, cache.k, True), v=per_layer(pool.v, cache.v, False),
                      pos=pool.pos.at[table].set(cache.pos.reshape(rows, n, page), mode="drop"))


class PageTable:
  """The host's page bookkeeping: the free list, each slot's pages, and the shared prompt pages
  of each prefix (`Prefix.share_id`), with a user count per page. Pages taken since the last
  device call are listed in `fresh`: that call clears their positions first, since a page
  comes back from its last owner holding that owner's entries."""

  def __init__(self, num_pages: int, page_size: int, slots: int):
    self.num_pages, self.page_size = num_pages, page_size
    self.free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
    self.users = np.zeros(num_pages, np.int32)
    self.fresh: list[int] = []
    self.peak_in_use = 0  # most pages held at once (what a right-sized pool needs)
    self.slot_pages: list[list[int]] = [[] for _ in range(slots)]
    self.slot_shared = [0] * slots  # how many leading pages of the slot are a shared prompt's
    self.slot_prefix = [-1] * slots  # the share_id whose pages the slot references
    self.prefix_pages: dict[int, list[int]] = {}  # share_id -> its full prompt pages
    self.prefix_users: dict[int, int] = {}

  @property
  def pages_in_use(self) -> int:
    return self.num_pages - len(self.free)

  def take(self, count: int, what: str) -> list[int]:
    """`count` free pages (one user each), or a SamplingError naming the pool's size."""
    if count > len(self.free):
      raise SamplingError(
          f"the paged KV cache is full: {what} needs {count} more pages, {len(self.free)} of "
          f"the {self.num_pages} are free (rollout.kv_pages); raise rollout.kv_pages or lower "
          "rollout.max_concurrent_decodes")
    taken = [self.free.pop() for _ in range(count)]
    self.users[taken] += 1
    self.peak_in_use = max(self.peak_in_use, self.pages_in_use)
    return taken

  def release_slot(self, slot: int) -> None:
    """Drops the slot's pages: a page whose last user this was goes back to the free list."""
    for page in self.slot_pages[slot]:
      self.users[page] -= 1
      if self.users[page] == 0:
        self.free.append(page)
    share_id = self.slot_prefix[slot]
    if share_id >= 0:
      self.prefix_users[share_id] -= 1
      if self.prefix_users[share_id] == 0:
        del self.prefix_users[share_id], self.prefix_pages[share_id]
    self.slot_pages[slot], self.slot_shared[slot], self.slot_prefix[slot] = [], 0, -1

  def place_prompt(self, slot: int, length: int, share_id: int) -> list[int]:
    """Gives `slot` pages for a prompt of `length` entries: the full pages of prefix `share_id`
    (shared when another slot already holds them; share_id −1: never shared) and a page of its
    own for a partial last one. Returns the pages the insert must write (those it took)."""
    self.release_slot(slot)
    full, partial = divmod(length, self.page_size)
    what = f"a prompt of {length} tokens"
    if share_id in self.prefix_pages:
      shared, written = self.prefix_pages[share_id], []
      self.users[shared] += 1
    else:
      shared = written = self.take(full, what)
    own = self.take(1, what) if partial else []
    if share_id >= 0:
      self.prefix_pages[share_id] = shared
      self.prefix_users[share_id] = self.prefix_users.get(share_id, 0) + 1
      self.slot_prefix[slot] = share_id
    self.slot_pages[slot], self.slot_shared[slot] = list(shared) + own, full
    return list(written) + own

  def grow(self, slot: int, entries: int) -> None:
    """Gives `slot` pages for its first `entries` cache entries (listed in `fresh`)."""
    missing = -(-entries // self.page_size) - len(self.slot_pages[slot])
    if missing > 0:
      taken = self.take(missing, f"slot {slot} at {entries} tokens")
      self.slot_pages[slot] += taken
      self.fresh += taken

  def take_fresh(self, size: int) -> np.ndarray:
    """The pages taken by `grow` since the last call, padded to `size` with num_pages (which a
    device call skips), and the list emptied."""
    fresh, self.fresh = self.fresh, []
    padded = np.full(max(size, len(fresh)), self.num_pages, np.int32)
    padded[:len(fresh)] = fresh
    return padded

  def tables(self, rows, live, pages: int) -> tuple[np.ndarray, np.ndarray]:
    """(read, write) page tables [len(rows), pages]: read every page a row's slot holds (−1
    past them); write the pages a slot live at the call's start owns alone (num_pages
    elsewhere: shared prompt pages are read-only, done slots write nothing)."""
    read = np.full((len(rows), pages), -1, np.int32)
    write = np.full((len(rows), pages), self.num_pages, np.int32)
    for r, slot in enumerate(rows):
      held = self.slot_pages[slot][:pages]
      read[r, :len(held)] = held
      if live[slot]:
        write[r, self.slot_shared[slot]:len(held)] = held[self.slot_shared[slot]:]
    return read, write


class PagedEngine(Engine):
  """`Engine` over a paged KV cache (module docstring).

  Args (besides `Engine`'s):
    page_size: cache entries per page.
    num_pages: pages in the pool; 0 gives every slot room for its whole length (the contiguous
      cache's memory, with prefix sharing's savings as headroom).
    kernel: how decode attention reads the pool, one of `kernels.paged.PAGED_KERNELS` ("auto":
      the TPU kernel on a TPU with a bfloat16 cache, else gathering the rows' pages).
  """

  def __init__(self, model, *, page_size: int = 16, num_pages: int = 0, kernel: str = "auto",
               **kwargs):
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
      raise SamplingError(f"page_size={page_size!r}: must be a positive integer")
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
      raise SamplingError(f"num_pages={num_pages!r}: must be an integer >= 0 (0: enough for "
                          "every slot's whole length)")
    self.page_size = page_size
    sizes = {**Engine.__init__.__kwdefaults__, **kwargs}  # the pool is sized before Engine runs
    cache_length = sizes["max_prefill_length"] + sizes["max_decode_length"]
    self.pages_per_slot = -(-cache_length // page_size)
    self.num_pages = num_pages or sizes["max_concurrent_decodes"] * self.pages_per_slot
    if self.num_pages < self.pages_per_slot:
      raise SamplingError(
          f"num_pages={num_pages}: fewer than the {self.pages_per_slot} pages one slot's "
          f"{cache_length} tokens take in pages of {page_size}; raise it")
    self._shared_prefixes = 0
    backend = paged_kernels.backend_of(kwargs.get("mesh"))
    self.kernel = paged_kernels.choose_paged_kernel(
        kernel, backend=backend, dtype=model.dtype, head_dim=model.config.head_dim,
        latent_attention=model.config.mla is not None)
    super().__init__(model, **kwargs)
    # pages a generate call may take: each slot, its next steps_per_call entries
    self._fresh_per_call = self._slots * (-(-self.steps_per_call // page_size) + 1)
    self.pages = PageTable(self.num_pages, page_size, self._slots)

  # ----------------------------------------------------------------------------- engine API

  def init_decode_state(self) -> DecodeState:
    """An empty decode state, and every page free again (one decode state at a time)."""
    self.pages = PageTable(self.num_pages, self.page_size, self._slots)
    return self._init_fn()

  def prefill(self, **kwargs):
    prefix, first = super().prefill(**kwargs)
    return self._numbered(prefix), first

  def prefill_many(self, **kwargs) -> list[Prefix]:
    return [self._numbered(prefix) for prefix in super().prefill_many(**kwargs)]

  def _numbered(self, prefix: Prefix) -> Prefix:
    self._shared_prefixes += 1
    return prefix.replace(share_id=self._shared_prefixes)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """Puts `prefix` in `slot`: its full prompt pages are shared with the other slots holding
    the same prefix (written by the first), its partial last page is the slot's own."""
    if not 0 <= int(slot) < self._slots:
      raise SamplingError(f"slot={slot}: must be in [0, {self._slots})")
    written = self.pages.place_prompt(int(slot), int(prefix.length), prefix.share_id)
    held = self.pages.slot_pages[int(slot)]
    # the prompt's pages in order, num_pages (not written) where another slot wrote them
    targets = np.full(-(-prefix.cache.max_len // self.page_size), self.num_pages, np.int32)
    for index, page in enumerate(held):
      if page in written:
        targets[index] = page
    self.num_inserts += 1
    self.num_insert_calls += 1
    return self._insert_paged_fn(decode_state, prefix, np.int32(slot), targets)

  # each insert places pages that the next one's room depends on: `insert_many` inserts one at
  # a time
  inserts_many_at_once = False

  def has_room_for(self, prefix: Prefix, tokens: int = 0) -> bool:
    """Whether the free pages hold `prefix`'s prompt (its full pages only if no slot shares
    them yet), `tokens` continuing it (a resumed sample's) and one `generate` call's tokens."""
    entries = self._after_call(int(prefix.length) + tokens)
    shared = (int(prefix.length) // self.page_size
              if prefix.share_id in self.pages.prefix_pages else 0)
    return -(-entries // self.page_size) - shared <= len(self.pages.free)

  def append_to_slot(self, params, decode_state: DecodeState, slot: int, tokens, *, start: int,
                     max_new_tokens: int, draws_kept: int) -> DecodeState:
    """`Engine.append_to_slot`, with pages taken for the appended tokens first."""
    tokens = list(tokens)
    if 0 <= int(slot) < self._slots and 1 <= int(start) < self.cache_length - len(tokens):
      self.pages.grow(int(slot), int(start) + len(tokens))
    return super().append_to_slot(params, decode_state, slot, tokens, start=start,
                                  max_new_tokens=max_new_tokens, draws_kept=draws_kept)

  def free_resource(self, slot: int) -> None:
    """Returns the slot's pages (a shared prompt's once its last slot lets go)."""
    self.pages.release_slot(int(slot))

  def _after_call(self, position: int) -> int:
    """Cache entries a slot at `position` may hold after one `generate` call."""
    return min(position + self.steps_per_call, self.cache_length)

  def slots_to_preempt(self, decode_state: DecodeState, newest_first) -> list[int]:
    """Live slots whose pages must go back before the next `generate` call can take the pages
    every live slot needs, taken in the order of `newest_first` (the caller's newest samples
    first, as vLLM preempts); the caller re-queues their samples (`rollout.stream_groups`
    continues them later by a prefill and an append, the same tokens)."""
    done, position = jax.device_get((decode_state.done, decode_state.position))
    live = [int(s) for s in np.flatnonzero(~done)]
    need = {slot: max(0, -(-self._after_call(int(position[slot])) // self.page_size)
                      - len(self.pages.slot_pages[slot])) for slot in live}
    short = sum(need.values()) - len(self.pages.free)
    evicted = []
    for slot in newest_first:
      if short <= 0 or len(evicted) == len(live) - 1:
        break
      if slot in need:
        evicted.append(slot)
        own = sum(1 for page in self.pages.slot_pages[slot] if self.pages.users[page] == 1)
        short -= need[slot] + own
    return evicted

  def generate(self, params, decode_state: DecodeState, *, return_on_finish: bool = False):
    """`Engine.generate` over the pages: each live slot first gets pages for every entry the
    call may write (up to its position + steps_per_call, at most the cache length)."""
    self.num_generate_calls += 1
    done, position = jax.device_get((decode_state.done, decode_state.position))
    rows, key_length = self.plan_for(done, position)
    if rows is None:
      rows = np.arange(self._slots, dtype=np.int32)
    for slot in np.flatnonzero(~done):
      self.pages.grow(int(slot), self._after_call(int(position[slot])))
    pages = min(-(-key_length // self.page_size), self.pages_per_slot)
    read, write = self.pages.tables(rows, ~done, pages)
    return self._generate_paged_fn(params, decode_state, rows, read, write,
                                   self.pages.take_fresh(self._fresh_per_call),
                                   np.bool_(return_on_finish))

  # ----------------------------------------------------------------------------- jitted bodies

  def _decode_state_shardings(self) -> DecodeState:
    cfg, stacked = self.config, self._scan_layers
    axes = ("kv_heads",) + ("layers",) * stacked + (None, None, "head_dim")
    k, v = (sharding_lib.sharding_for(
        axes, (heads,) + (cfg.num_layers,) * stacked + (self.num_pages, self.page_size, width),
        self._mesh) for heads, width in cfg.kv_cache_layout())
    if not stacked:
      k, v = (k,) * cfg.num_layers, (v,) * cfg.num_layers
    return super()._decode_state_shardings().replace(
        cache=PagedKVCache(k=k, v=v, pos=self._replicated, kernel=self.kernel, mesh=self._mesh))

  def _build_functions(self):
    super()._build_functions()
    cfg, page = self.config, self.page_size
    state_shardings, replicated = self._state_shardings, self._replicated
    init_body, append_body, decode_steps = self._init_body, self._append_body, self._decode_steps

    def init():
      pool = PagedKVCache.init(cfg, self.num_pages, page, self.dtype, stacked=self._scan_layers)
      return init_body().replace(cache=pool.replace(kernel=self.kernel, mesh=self._mesh))

    def insert(state: DecodeState, prefix: Prefix, slot, targets):
      """Writes the prompt's entries into pages `targets` (num_pages: skipped)."""
      room = targets.shape[0] * page - prefix.cache.max_len
      def pad_length(a, axis):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, room)
        return jnp.pad(a, widths)

      padded = prefix.cache.map_length(pad_length)
      padded = padded.replace(pos=jnp.pad(prefix.cache.pos, ((0, 0), (0, room)),
                                          constant_values=-1))
      pool = scatter_pages(state.cache, targets[None], padded)
      return start_slot(state.replace(cache=pool), prefix, slot)

    def cleared(pool: PagedKVCache, fresh) -> PagedKVCache:
      """The pool with no entries in pages `fresh` (num_pages: skipped)."""
      return pool.replace(pos=pool.pos.at[fresh].set(-1, mode="drop"))

    def append(params, state: DecodeState, slot, tokens, positions, start, count, budget,
               draws_kept, read, write, fresh):
      """`Engine`'s append on the slot's row gathered from its pages, written back to those it
      owns."""
      pool = cleared(state.cache, fresh)
      per_slot = state.replace(cache=None)
      one = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0), per_slot)
      one = append_body(params, one.replace(cache=gather_pages(pool, read)), jnp.int32(0),
                        tokens, positions, start, count, budget, draws_kept)
      merged = jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, slot, 0),
                            per_slot, one.replace(cache=None))
      return merged.replace(cache=scatter_pages(pool, write, one.cache))

    def generate(params, state: DecodeState, rows, read, write, fresh, return_on_finish):
      """`Engine`'s decode steps for `rows`, every layer reading and writing the pool through
      the rows' page tables (`models.kv_pages`)."""
      pool = cleared(state.cache, fresh)
      per_slot = state.replace(cache=None)
      part = jax.tree.map(lambda a: a[rows], per_slot).replace(
          cache=pool.replace(read_table=read, write_table=write))
      part, result = decode_steps(params, part, return_on_finish, part.cache.max_len)
      state = jax.tree.map(lambda a, b: a.at[rows].set(b), per_slot,
                           part.replace(cache=None)).replace(cache=part.cache.pool())
      return state, spread_rows(result, rows, state)

    self._init_fn = jax.jit(init, out_shardings=state_shardings)
    self._insert_paged_fn = jax.jit(insert, donate_argnums=0, out_shardings=state_shardings)
    self._append_paged_fn = jax.jit(append, donate_argnums=1, out_shardings=state_shardings)
    self._generate_paged_fn = jax.jit(generate, donate_argnums=1,
                                      out_shardings=(state_shardings, replicated))
    self._append_fn = self._append_on_pages

  def _append_on_pages(self, params, state, slot, *args):
    """`Engine.append_to_slot`'s device call, on all of the slot's pages (one row, rare)."""
    read, write = self.pages.tables([int(slot)], np.ones(self._slots, bool), self.pages_per_slot)
    return self._append_paged_fn(params, state, slot, *args, read, write,
                                 self.pages.take_fresh(self.pages_per_slot))


__all__ = ["PageTable", "PagedEngine", "gather_pages", "scatter_pages"]
