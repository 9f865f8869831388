"""The KV cache write (`models.primitives.scatter_cache`): a decode step's one entry per row into a
2-byte float cache on a CPU is a select, which must store what the scatter stores and must keep
XLA from converting the cache to float32 around the write."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.models import primitives


def _scatter_reference(buffer, slots, values, layer):
  """The scatter path's result, computed in float32 (where `scatter_cache` always scatters) and
  rounded back: the written values are bf16 already, so the rounding is exact."""
  out = primitives.scatter_cache(buffer.astype(jnp.float32), slots, values.astype(jnp.float32),
                                 layer)
  return out.astype(buffer.dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("layer", [None, 1])
def test_one_entry_per_row_stores_what_the_scatter_stores(dtype, layer):
  rng = np.random.default_rng(0)
  rows, heads, size, dim = 6, 2, 5, 3
  shape = (rows, heads, size, dim) if layer is None else (3, rows, heads, size, dim)
  buffer = jnp.asarray(rng.normal(size=shape), dtype)
  values = jnp.asarray(rng.normal(size=(rows, 1, heads, dim)), dtype)
  # In range, the last slot, from the end (-1, -5: numpy's indexing), past either end (dropped).
  slots = jnp.array([[0], [4], [-1], [-5], [5], [-6]])
  assert primitives._select_one_entry(buffer, values)
  written = jax.jit(primitives.scatter_cache, static_argnums=3)(buffer, slots, values, layer)
  expected = _scatter_reference(buffer, slots, values, layer)
  np.testing.assert_array_equal(np.asarray(written, np.float32), np.asarray(expected, np.float32))
  # The rows past either end kept their entries; the others now hold their value.
  kept = buffer if layer is None else buffer[layer]
  new = written if layer is None else written[layer]
  np.testing.assert_array_equal(np.asarray(new[4:], np.float32), np.asarray(kept[4:], np.float32))
  np.testing.assert_array_equal(np.asarray(new[2, :, 4], np.float32),
                                np.asarray(values[2, 0], np.float32))


def test_only_single_entry_writes_of_two_byte_floats_take_the_select():
  bf16_buffer = jnp.zeros((2, 1, 4, 2), jnp.bfloat16)
  assert primitives._select_one_entry(bf16_buffer, jnp.zeros((2, 1, 1, 2), jnp.bfloat16))
  assert not primitives._select_one_entry(bf16_buffer, jnp.zeros((2, 3, 1, 2), jnp.bfloat16))
  assert not primitives._select_one_entry(jnp.zeros((2, 1, 4, 2)), jnp.zeros((2, 1, 1, 2)))
  assert not primitives._select_one_entry(jnp.zeros((2, 1, 4, 2), jnp.int16),
                                          jnp.zeros((2, 1, 1, 2), jnp.int16))


def test_a_prefill_write_of_several_entries_still_scatters():
  buffer = jnp.zeros((2, 1, 6, 2), jnp.bfloat16)
  values = jnp.arange(1, 9, dtype=jnp.bfloat16).reshape(2, 2, 1, 2)
  written = primitives.scatter_cache(buffer, jnp.array([[1, 2], [4, 5]]), values)
  np.testing.assert_array_equal(np.asarray(written[0, 0, 1:3], np.float32), [[1, 2], [3, 4]])
  np.testing.assert_array_equal(np.asarray(written[1, 0, 4:6], np.float32), [[5, 6], [7, 8]])
  assert not np.asarray(written[:, :, :1], np.float32).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layer", [None, 1])
@pytest.mark.parametrize("entries", [1, 2])
def test_a_keys_buffer_stored_length_last_holds_the_same_entries(dtype, layer, entries):
  """length_axis=3 (keys [B, K, D, S]) against the [B, K, S, D] write, transposed: the scatter
  (float32, or several entries), the select (a bfloat16 decode write), either end dropped."""
  rng = np.random.default_rng(1)
  rows, heads, size, dim = 6, 2, 5, 3
  shape = (rows, heads, size, dim) if layer is None else (3, rows, heads, size, dim)
  buffer = jnp.asarray(rng.normal(size=shape), dtype)
  values = jnp.asarray(rng.normal(size=(rows, entries, heads, dim)), dtype)
  first = jnp.array([[0], [3], [-1], [-5], [5], [-6]]) if entries == 1 else jnp.array(
      [[0], [3], [1], [2], [4], [6]])
  slots = first + jnp.arange(entries)[None, :]
  expected = primitives.scatter_cache(buffer, slots, values, layer)
  write = functools.partial(primitives.scatter_cache, layer=layer, length_axis=3)
  written = jax.jit(write)(buffer.swapaxes(-1, -2), slots, values)
  np.testing.assert_array_equal(np.asarray(written.swapaxes(-1, -2), np.float32),
                                np.asarray(expected, np.float32))
  assert not np.array_equal(np.asarray(expected, np.float32), np.asarray(buffer, np.float32))


def _float32_buffers(hlo: str, shape: tuple[int, ...]) -> list[str]:
  """Instructions of an optimized module that materialise a float32 array of the cache's shape:
  results outside fused computations (inside one, a converted element never leaves registers)."""
  dims = ",".join(map(str, shape))
  found, fused = [], False
  for line in hlo.splitlines():
    header = re.match(r"(?:ENTRY )?%([\w.-]+) ", line)
    if header and not line.startswith(" "):
      fused = "computation" in header.group(1)
    elif not fused and re.search(rf"= f32\[{dims}\]", line):
      found.append(line.strip())
  return found


@pytest.mark.parametrize("layer", [None, 1])
def test_a_bfloat16_decode_write_makes_no_float32_copy_of_the_cache(layer):
  shape = (4, 2, 16, 8) if layer is None else (3, 4, 2, 16, 8)
  buffer = jnp.zeros(shape, jnp.bfloat16)
  values = jnp.ones((4, 1, 2, 8), jnp.bfloat16)
  slots = jnp.arange(4)[:, None]

  def write(cache, slots, values):
    return primitives.scatter_cache(cache, slots, values, layer)

  hlo = jax.jit(write, donate_argnums=0).lower(buffer, slots, values).compile().as_text()
  assert _float32_buffers(hlo, shape) == [], hlo
  assert " scatter(" not in hlo

  # What the select avoids: the same write as a scatter converts the cache to float32 and back.
  def scatter(cache, slots, values):
    index = (jnp.arange(4)[:, None, None], jnp.arange(2)[None, :, None], slots[:, None, :])
    if layer is not None:
      index = (layer, *index)
    return cache.at[index].set(values.swapaxes(1, 2), mode="drop")

  plain = jax.jit(scatter, donate_argnums=0).lower(buffer, slots, values).compile().as_text()
  assert len(_float32_buffers(plain, shape)) >= 1, plain
