"""Grouped matrix multiplication: the expert computation of a dropless mixture of experts.

Rows of `lhs` [M, K] sorted by group (expert), `group_sizes` [G] rows each, are multiplied by their
group's matrix of `rhs` [G, K, N]: out[r] = lhs[r] · rhs[g(r)]. A MoE layer sends each token's
copies through it once per projection (Gale et al. 2023, "MegaBlocks: Efficient Sparse Training
with Mixture-of-Experts": block-sparse grouped matmuls instead of capacity-padded batches, so no
token is dropped and no FLOP is spent on padding).

  implementation  backend  what it is
  --------------  -------  ---------------------------------------------------------------
  ragged_dot      any      `jax.lax.ragged_dot`, lowered by XLA for the backend
  megablox        TPU      JAX's Pallas TPU grouped-matmul kernel (megablox `gmm`, with its
                           custom VJP); elsewhere run in Pallas interpret mode (tests)

`auto` takes megablox on TPU and ragged_dot elsewhere. Both compute each output row as one dot
product of the row with its group's matrix, so a row's result does not depend on which other rows
share the call (what routing-exact rollouts rely on: `reasoning_rl.models.moe`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUPED_MATMULS = ("auto", "ragged_dot", "megablox")

# megablox's (m, k, n) tile; rows are padded to a multiple of the m tile.
_MEGABLOX_TILING = (128, 128, 128)


def resolve(implementation: str, backend: str | None = None) -> str:
  """The implementation `auto` stands for on `backend` (default: JAX's default backend)."""
  if implementation not in GROUPED_MATMULS:
    raise ValueError(f"grouped matmul {implementation!r}: use one of {GROUPED_MATMULS}")
  if implementation != "auto":
    return implementation
  return "megablox" if (backend or jax.default_backend()) == "tpu" else "ragged_dot"


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   implementation: str = "auto", tiling=_MEGABLOX_TILING) -> jax.Array:
  """lhs [M, K] (rows sorted by group, sum(group_sizes) == M) times rhs [G, K, N] → [M, N] in
  lhs's dtype (float32 accumulation)."""
  implementation = resolve(implementation)
  group_sizes = group_sizes.astype(jnp.int32)
  if implementation == "ragged_dot":
    return jax.lax.ragged_dot(lhs, rhs, group_sizes,
                              preferred_element_type=jnp.float32).astype(lhs.dtype)
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


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple
