"""Grouped matrix multiplication: the expert computation of a dropless mixture of experts.

Rows of `lhs` [M, K] sorted by group (expert), `group_sizes` [G] rows each, are multiplied by their
group's matrix of `rhs` [G, K, N]: out[r] = lhs[r] · rhs[g(r)]. A MoE layer sends each token's
copies through it once per projection (Gale et al. 2023, "MegaBlocks: Efficient Sparse Training
with Mixture-of-Experts": block-sparse grouped matmuls instead of capacity-padded batches, so no
token is dropped and no FLOP is spent on padding).

  implementation  backend  what it is
  --------------  -------  ---------------------------------------------------------------
  ragged_dot      any      `jax.lax.ragged_dot`, lowered by XLA for the backend (XLA:CPU
                           lowers it to a dense masked product over every group: G times
                           the FLOPs)
  tiled           any      the rows of each group padded to whole tiles (`TILE_ROWS`, or the
                           mean group's rows if fewer), and one [tile, K]·[K, N] matmul per
                           tile with its group's matrix (`lax.map`): the grouped FLOPs plus
                           at most G tiles of padding
  megablox        TPU      JAX's Pallas TPU grouped-matmul kernel (megablox `gmm`, with its
                           custom VJP); elsewhere run in Pallas interpret mode (tests)

`auto` takes megablox on TPU, ragged_dot on GPU and tiled on CPU (benchmarks/RESULTS.md,
"Grouped matmul on CPU": ragged_dot 3.5x and tiled 1.8x the time of one dense matmul of the same
FLOPs). Each computes an output row as the dot product of the row with its group's matrix in a
program of fixed shapes, so a row's result does not depend on which other rows share the call
(what routing-exact rollouts rely on: `reasoning_rl.models.moe`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

GROUPED_MATMULS = ("auto", "ragged_dot", "tiled", "megablox")
TILE_ROWS = 256  # rows per tile of the tiled implementation

# megablox's (m, k, n) tile; rows are padded to a multiple of the m tile.
_MEGABLOX_TILING = (128, 128, 128)


def resolve(implementation: str, backend: str | None = None) -> str:
  """The implementation `auto` stands for on `backend` (default: JAX's default backend)."""
  if implementation not in GROUPED_MATMULS:
    raise ValueError(f"grouped matmul {implementation!r}: use one of {GROUPED_MATMULS}")
  if implementation != "auto":
    return implementation
  backend = backend or jax.default_backend()
  if backend == "tpu":
    return "megablox"
  return "tiled" if backend == "cpu" else "ragged_dot"


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   implementation: str = "auto", tiling=None) -> jax.Array:
  """lhs [M, K] (rows sorted by group) times rhs [G, K, N] → [M, N] in lhs's dtype (float32
  accumulation). Rows past sum(group_sizes) belong to no group: their outputs are unspecified
  (the caller masks them; the tiled implementation does not compute them). `tiling`: megablox's (m, k, n) tile; its m is also the
  tiled implementation's rows per tile (default: `_MEGABLOX_TILING`, `TILE_ROWS`)."""
  implementation = resolve(implementation)
  group_sizes = group_sizes.astype(jnp.int32)
  if implementation == "ragged_dot":
    return jax.lax.ragged_dot(lhs, rhs, group_sizes,
                              preferred_element_type=jnp.float32).astype(lhs.dtype)
  if implementation == "tiled":
    return _tiled(lhs, rhs, group_sizes, tiling[0] if tiling else TILE_ROWS)
  tiling = tiling or _MEGABLOX_TILING
  from jax.experimental.pallas.ops.tpu.megablox import ops  # TPU kernels: imported when used

  interpret = jax.default_backend() != "tpu"
  rows = lhs.shape[0]
  tile_m = min(tiling[0], _round_up(rows, 8))
  tiling = (tile_m, min(tiling[1], lhs.shape[1]), min(tiling[2], rhs.shape[2]))
  padded = _round_up(rows, tile_m)
  if padded != rows:
    # The kernel leaves rows past sum(group_sizes) unwritten: zero rows counted in the last
    # group give zero outputs, sliced off below.
    lhs = jnp.pad(lhs, ((0, padded - rows), (0, 0)))
    group_sizes = group_sizes.at[-1].add(padded - rows)
  out = ops.gmm(lhs, rhs, group_sizes, jnp.float32, tiling, None, None, False, interpret)
  return out[:rows].astype(lhs.dtype)


@dataclasses.dataclass(frozen=True)
class TileLayout:
  """Where the tiled implementation puts rows: `destination` [M] of each row in a buffer of
  `num_tiles` tiles of `tile` rows, in which each group starts on a tile boundary and the rows
  past the groups follow them; `tile_group` [num_tiles] the group whose matrix each tile takes;
  `live` [num_tiles] whether a tile holds grouped rows (the others are not computed)."""

  tile: int
  num_tiles: int
  destination: jax.Array
  tile_group: jax.Array
  live: jax.Array

  @classmethod
  def of(cls, rows: int, group_sizes: jax.Array, tile_rows: int = TILE_ROWS) -> "TileLayout":
    groups = group_sizes.shape[0]
    # At most `tile_rows`, and no more than the mean group's rows (a power of two, >= 8): with
    # many experts (Qwen3-30B-A3B's 128) large tiles would be mostly padding.
    mean_rows = -(-rows // groups)
    tile = min(tile_rows, _round_up(rows, 8), max(8, 1 << (mean_rows - 1).bit_length()))
    num_tiles = -(-rows // tile) + groups  # each group wastes less than one tile
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    padded = -(-group_sizes // tile) * tile
    padded_ends = jnp.cumsum(padded)
    index = jnp.arange(rows)
    group_of_row = jnp.minimum(jnp.searchsorted(ends, index, side="right"), groups - 1)
    destination = jnp.where(
        index < ends[-1],
        padded_ends[group_of_row] - padded[group_of_row] + index - starts[group_of_row],
        padded_ends[-1] + index - ends[-1])
    tile_start = jnp.arange(num_tiles) * tile
    tile_group = jnp.minimum(jnp.searchsorted(padded_ends, tile_start, side="right"), groups - 1)
    return cls(tile, num_tiles, destination, tile_group, tile_start < padded_ends[-1])

  def tiles(self, rows: jax.Array) -> jax.Array:
    """rows [M, W] in their tiles: [num_tiles, tile, W], zeros where no row goes."""
    buffer = jnp.zeros((self.num_tiles * self.tile, rows.shape[1]), rows.dtype)
    buffer = buffer.at[self.destination].set(rows, unique_indices=True)
    return buffer.reshape(self.num_tiles, self.tile, -1)

  def rows(self, tiles: jax.Array) -> jax.Array:
    """Inverse of `tiles`: [num_tiles, tile, W] → [M, W]."""
    return tiles.reshape(self.num_tiles * self.tile, -1)[self.destination]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(lhs, rhs, group_sizes, tile_rows: int):
  """The tiled implementation (module docstring): one matmul per live tile with its group's
  matrix (`lax.cond`: dead tiles are zeros). Its gradient (`_tiled_backward`) is two more tiled
  passes instead of what autodiff of `lax.map` gives (a gradient of every group's matrix
  carried through every tile)."""
  layout = TileLayout.of(lhs.shape[0], group_sizes, tile_rows)
  out_width = rhs.shape[2]

  def one_tile(args):
    block, group, live = args
    return jax.lax.cond(
        live,
        lambda: jnp.dot(block, rhs[group], preferred_element_type=jnp.float32).astype(lhs.dtype),
        lambda: jnp.zeros((layout.tile, out_width), lhs.dtype))

  out = jax.lax.map(one_tile, (layout.tiles(lhs), layout.tile_group, layout.live))
  return layout.rows(out)


def _tiled_forward(lhs, rhs, group_sizes, tile_rows):
  return _tiled(lhs, rhs, group_sizes, tile_rows), (lhs, rhs, group_sizes)


def _tiled_backward(tile_rows, residuals, out_grad):
  """d lhs = out_grad · rhs[g]ᵀ row by row (the tiled product with the transposed matrices);
  d rhs[g] = Σ over g's tiles of lhs_tileᵀ · out_grad_tile (dead tiles skipped), summed per
  group."""
  lhs, rhs, group_sizes = residuals
  lhs_grad = _tiled(out_grad, rhs.swapaxes(1, 2), group_sizes, tile_rows)
  layout = TileLayout.of(lhs.shape[0], group_sizes, tile_rows)
  blocks, grad_blocks = layout.tiles(lhs), layout.tiles(out_grad)

  # Each live tile adds its product into its group's slice of one float32 accumulator, in
  # place: a [tiles, K, N] stack of per-tile products to sum afterwards was held for every layer
  # at once by XLA:CPU's schedule (3.8 GB of a MoE SmolLM2 step).
  def add_tile(index, total):
    group = layout.tile_group[index]
    return jax.lax.cond(
        layout.live[index],
        lambda: total.at[group].add(jnp.dot(blocks[index].T, grad_blocks[index],
                                            preferred_element_type=jnp.float32)),
        lambda: total)

  rhs_grad = jax.lax.fori_loop(0, layout.num_tiles, add_tile,
                               jnp.zeros(rhs.shape, jnp.float32))
  return lhs_grad, rhs_grad.astype(rhs.dtype), None


_tiled.defvjp(_tiled_forward, _tiled_backward)


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple
