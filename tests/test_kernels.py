"""Every training-attention kernel against the XLA reference, on values and gradients, for every
mask the models use (causal over left-padded rows, packed segments, sliding window, soft-cap,
attention sinks), in Pallas interpret mode on this CPU; then the choice per backend, the model
wired to a kernel, and a kernel inside a sharded step.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl import kernels
from reasoning_rl.errors import ConfigError
from reasoning_rl.kernels import reference

BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 2, 100, 4, 2, 32  # 100 tokens: the dispatcher pads


def _rows(layout: str, length: int = LENGTH):
  """(positions, key_positions, segment_ids or None) of two rows laid out as `layout`; rows
  longer than LENGTH hold the same then padding."""
  index = np.arange(length)
  if layout == "left_padded":  # 17 and 0 padding tokens first
    starts = np.array([[17], [length - LENGTH]])
    positions = np.where(index >= starts, index - starts, -1)
    return positions, positions, None
  segment_ids = np.zeros((BATCH, length), np.int64)
  positions = np.full((BATCH, length), -1)
  if layout == "shared_prompt":
    # row 0: a prompt of 12 tokens, completions of 30, 25 and 20 continuing from it, a second
    # unit (prompt 8, completion 5); row 1: one prompt of 40 and a completion of 60
    units = [[[12, 30, 25, 20], [8, 5]], [[40, 60]]]  # per row, per unit: prompt, completions
    for row, row_units in enumerate(units):
      start = 0
      for unit, sizes in enumerate(row_units, start=1):
        for branch, size in enumerate(sizes):
          segment_ids[row, start:start + size] = reference.shared_prefix_ids(unit, branch)
          offset = 0 if branch == 0 else sizes[0]
          positions[row, start:start + size] = offset + np.arange(size)
          start += size
    return positions, np.where(segment_ids > 0, positions, -1), segment_ids
  # packed: row 0 holds sequences of 30, 45 and 20 tokens then 5 padding; row 1 one of 100
  start = 0
  for segment, size in enumerate([30, 45, 20], start=1):
    segment_ids[0, start:start + size] = segment
    positions[0, start:start + size] = np.arange(size)
    start += size
  segment_ids[1, :LENGTH], positions[1, :LENGTH] = 1, index[:LENGTH]
  return positions, np.where(segment_ids > 0, positions, -1), segment_ids


def _inputs(dtype, seed=0, length=LENGTH):
  rng = np.random.default_rng(seed)
  shape_q = (BATCH, length, HEADS, HEAD_DIM)
  shape_kv = (BATCH, length, KV_HEADS, HEAD_DIM)
  q, k, v = (jnp.asarray(rng.normal(size=s), dtype) for s in (shape_q, shape_kv, shape_kv))
  cotangent = jnp.asarray(rng.normal(size=shape_q), jnp.float32)
  return q, k, v, cotangent


def _attention_and_grads(kernel, q, k, v, cotangent, rows, options, grads=True, sinks=None):
  """(outputs at real tokens, gradients of q, k, v and, when given, of the sinks)."""
  positions, key_positions, segment_ids = (None if x is None else jnp.asarray(x, jnp.int32)
                                           for x in rows)
  real = (key_positions >= 0)[:, :, None, None]

  def loss(q, k, v, sinks):
    out = kernels.training_attention(q, k, v, positions, key_positions, segment_ids,
                                     sinks=sinks, kernel=kernel, **options)
    # padding outputs differ between kernels by design (never read): the loss leaves them out
    return jnp.sum(jnp.where(real, out.astype(jnp.float32) * cotangent, 0.0)), out

  if grads:
    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(q, k, v, sinks)
  else:
    out = jax.jit(loss)(q, k, v, sinks)[1]
  return np.where(np.asarray(real), np.asarray(out, np.float32), 0), grads


# per query head: a sink well above, near and below the scores' scale (|q·k|/√D ~ 1)
SINKS = jnp.asarray([3.0, 0.5, -1.0, -4.0], jnp.float32)

CASES = [  # (layout, softcap, window, sinks)
    ("left_padded", None, None, False),
    ("packed", None, None, False),
    ("packed", None, 16, False),
    ("left_padded", 20.0, None, False),
    ("packed", 5.0, 16, False),
    ("packed", None, 16, True),  # GPT-OSS's local layers (its global ones: no window)
]


@pytest.mark.parametrize("kernel, layout, softcap, window, sinks",
                         [("splash", *case) for case in CASES]
                         # the GPU kernel has no soft-cap / window / sinks (the dispatcher keeps
                         # the reference for those layers there)
                         + [("pallas_gpu", *case) for case in CASES if not any(case[1:])])
def test_kernel_matches_the_reference_on_values_and_gradients(kernel, layout, softcap, window,
                                                              sinks):
  rows = _rows(layout)
  q, k, v, cotangent = _inputs(jnp.float32)
  options = dict(scale=HEAD_DIM ** -0.5, softcap=softcap, window=window)
  sinks = SINKS if sinks else None
  want, want_grads = _attention_and_grads("reference", q, k, v, cotangent, rows, options,
                                          sinks=sinks)
  got, got_grads = _attention_and_grads(kernel, q, k, v, cotangent, rows, options, sinks=sinks)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  for name, g, w in zip(("q", "k", "v", "sinks"), got_grads, want_grads):
    scale = np.abs(np.asarray(w)).max()
    assert scale > 0.1, name  # the gradient is not trivially zero
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4 * scale, err_msg=name)


@pytest.mark.parametrize("layout, softcap, window, sinks",
                         CASES + [("shared_prompt", None, None, False),
                                  ("shared_prompt", 5.0, None, True)])
def test_causal_blocks_compute_the_dense_reference(layout, softcap, window, sinks):
  """The training path's reference (query blocks, each against the keys up to its end) against
  the dense [T, T] one, on values and gradients, over rows long enough for 4 blocks (the last
  shorter); padding queries' outputs are left out (they differ by design)."""
  length = 4 * reference.MIN_CAUSAL_BLOCK + 13
  assert len(reference.causal_blocks(length)) == 4
  positions, key_positions, segment_ids = (None if x is None else jnp.asarray(x, jnp.int32)
                                           for x in _rows(layout, length))
  q, k, v, cotangent = _inputs(jnp.float32, length=length)
  real = (key_positions >= 0)[:, :, None, None]
  options = dict(scale=HEAD_DIM ** -0.5, softcap=softcap, window=window,
                 segment_ids=segment_ids, sinks=SINKS if sinks else None)

  def loss(attention, q, k, v):
    out = attention(q, k, v, positions, key_positions, **options)
    return jnp.sum(jnp.where(real, out * cotangent, 0.0)), jnp.where(real, out, 0.0)

  results = [jax.jit(jax.value_and_grad(functools.partial(loss, attention), argnums=(0, 1, 2),
                                        has_aux=True))(q, k, v)
             for attention in (reference.causal_attention, reference.attention)]
  (_, got), got_grads = results[0]
  (_, want), want_grads = results[1]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  for name, g, w in zip("qkv", got_grads, want_grads):
    scale = np.abs(np.asarray(w)).max()
    assert scale > 0.1, name
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5 * scale, err_msg=name)


def test_causal_blocks_cover_the_row_in_at_most_the_cap():
  for length in (1, 63, 64, 127, 128, 200, 384, 769, 4096):
    blocks = reference.causal_blocks(length)
    assert blocks[0][0] == 0 and blocks[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert len(blocks) <= reference.MAX_CAUSAL_BLOCKS
    assert len(blocks) == 1 or min(end - start for start, end in blocks[:-1]) >= (
        reference.MIN_CAUSAL_BLOCK)


def test_a_sink_takes_its_share_of_each_softmax():
  """The reference against the definition: p_s = exp(z_s) / (Σ_s' exp(z_s') + exp(sink)) for
  each head, numpy in float64; a very negative sink is no sink."""
  rng = np.random.default_rng(7)
  q, k, v = (rng.normal(size=(1, 5, 4, 8)), rng.normal(size=(1, 5, 2, 8)),
             rng.normal(size=(1, 5, 2, 8)))
  positions = jnp.arange(5)[None]
  sinks = np.array([1.0, -0.5, 2.0, 0.0])
  got = reference.attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), positions,
                            positions, scale=0.3, softcap=None, window=None,
                            sinks=jnp.asarray(sinks, jnp.float32))
  want = np.zeros(q.shape)
  for t in range(5):
    for h in range(4):
      z = 0.3 * k[0, :t + 1, h // 2] @ q[0, t, h]
      weights = np.exp(z) / (np.exp(z).sum() + np.exp(sinks[h]))
      want[0, t, h] = weights @ v[0, :t + 1, h // 2]
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  options = dict(scale=0.3, softcap=None, window=None)
  args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)] + [positions, positions]
  # Two programs (the sink's column in the softmax or not): a few ulp apart where XLA fuses or
  # orders the ≤5-key sums differently; the bound of the reference check above. A sink that
  # leaked weight (e^{-1e4} taken as anything but 0) moves outputs by O(1).
  np.testing.assert_allclose(
      np.asarray(reference.attention(*args, sinks=jnp.full(4, -1e4), **options)),
      np.asarray(reference.attention(*args, **options)), rtol=1e-5, atol=1e-6)


def test_splash_in_bfloat16_accumulates_in_float32():
  # bfloat16 inputs: the kernel's error is bfloat16 rounding of inputs and output, not of the
  # softmax sums (which would be ~10x larger over 100 keys)
  rows = _rows("packed")
  q, k, v, cotangent = _inputs(jnp.bfloat16, seed=1)
  options = dict(scale=HEAD_DIM ** -0.5, softcap=None, window=None)
  exact, _ = _attention_and_grads("reference", *(x.astype(jnp.float32) for x in (q, k, v)),
                                  cotangent, rows, options, grads=False)
  got, _ = _attention_and_grads("splash", q, k, v, cotangent, rows, options, grads=False)
  error = np.abs(got - exact).max()
  assert 0 < error < 2 * 2 ** -8 * np.abs(exact).max()


@pytest.mark.parametrize("backend, softcap, window, sinks, chosen", [
    ("tpu", None, None, False, "splash"), ("tpu", 50.0, 4096, False, "splash"),
    ("tpu", None, 128, True, "splash"),
    ("gpu", None, None, False, "pallas_gpu"), ("cuda", None, None, False, "pallas_gpu"),
    ("gpu", 50.0, None, False, "reference"), ("gpu", None, 4096, False, "reference"),
    ("gpu", None, None, True, "reference"),
    ("cpu", None, None, False, "reference"),
])
def test_auto_picks_the_backends_kernel(backend, softcap, window, sinks, chosen):
  assert kernels.choose_training_kernel("auto", backend=backend, softcap=softcap,
                                        window=window, sinks=sinks) == chosen
  assert kernels.choose_training_kernel("reference", backend=backend) == "reference"


def test_a_bad_kernel_name_or_an_unsupported_layer_is_one_clear_error():
  with pytest.raises(ConfigError, match=r"config.model.attention_kernel='flash'.*auto"):
    kernels.choose_training_kernel("flash", backend="cpu")
  with pytest.raises(ConfigError, match="no sliding window, logit soft-cap or attention sinks"):
    kernels.choose_training_kernel("pallas_gpu", backend="gpu", softcap=50.0)
  with pytest.raises(ConfigError, match="pallas_gpu.*attention sinks.*'auto'"):
    kernels.choose_training_kernel("pallas_gpu", backend="gpu", sinks=True)


@pytest.mark.parametrize("softcap, window, sinks", [(None, None, None), (30.0, 5, None),
                                                   (None, 5, (2.0, 0.0, -1.0, 1.0, 0.5, -3.0))])
def test_one_query_decode_path_equals_the_einsum_path(softcap, window, sinks):
  # a decode step (one query per row) takes the products-and-sums path on a CPU; with two copies
  # of the query the same row takes the einsum path, and each query only sees its own keys
  rng = np.random.RandomState(0)
  batch, heads, kv_heads, head_dim, keys = 3, 6, 2, 16, 12
  q = jnp.asarray(rng.randn(batch, 1, heads, head_dim), jnp.float32)
  k, v = (jnp.asarray(rng.randn(batch, kv_heads, keys, head_dim), jnp.float32) for _ in "kv")
  k_pos = jnp.asarray(np.where(np.arange(keys) < [[9], [12], [3]], np.arange(keys), -1), jnp.int32)
  q_pos = jnp.asarray([[8], [11], [2]], jnp.int32)
  options = {"scale": 0.25, "softcap": softcap, "window": window,
             "sinks": None if sinks is None else jnp.asarray(sinks, jnp.float32)}
  keys_length_last = k.swapaxes(2, 3)  # the KV cache's layout of keys
  one = kernels.decode_attention(q, keys_length_last, v, q_pos, k_pos, **options)
  one_pages = kernels.decode_attention(q, k, v, q_pos, k_pos, keys_length_last=False, **options)
  two = reference.attention(jnp.concatenate([q, q], 1), k, v, jnp.concatenate([q_pos, q_pos], 1),
                            k_pos, kv_heads_first=True, **options)
  two_cache = reference.attention(jnp.concatenate([q, q], 1), keys_length_last, v,
                                  jnp.concatenate([q_pos, q_pos], 1), k_pos, kv_heads_first=True,
                                  keys_length_last=True, **options)
  assert one.shape == (batch, 1, heads, head_dim)
  np.testing.assert_allclose(np.asarray(one[:, 0]), np.asarray(two[:, 0]), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(one_pages), np.asarray(one), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(two_cache), np.asarray(two), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(two[:, 1]), np.asarray(two[:, 0]), rtol=1e-5, atol=1e-6)


@functools.cache
def _gemma2_like_model():
  from reasoning_rl.models.config import ModelConfig
  from reasoning_rl.models.transformer import create_model

  config = ModelConfig(model_type="gemma2", vocab_size=64, hidden_size=32, intermediate_size=48,
                       num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                       attn_logit_softcap=20.0, sliding_window=8,
                       layer_types=("sliding_attention",))
  return create_model(config, seed=3)


def test_the_model_runs_packed_rows_through_the_chosen_kernel():
  from flax import nnx

  model = _gemma2_like_model()
  rows = _rows("packed")
  tokens = jnp.asarray(np.random.default_rng(2).integers(1, 64, (BATCH, LENGTH)), jnp.int32)
  positions, _, segment_ids = (jnp.asarray(x, jnp.int32) for x in rows)
  real = np.asarray(segment_ids) > 0

  def hidden(kernel):
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state).use_attention_kernel(kernel)
    graphdef, state = nnx.split(copy)  # the choice travels in the graphdef
    run = jax.jit(lambda state: nnx.merge(graphdef, state).hidden_states(
        tokens, positions=positions, segment_ids=segment_ids))
    return np.asarray(run(state))

  want, got = hidden("reference"), hidden("splash")
  np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)
  with pytest.raises(ConfigError, match="attention_kernel"):
    model.use_attention_kernel("fast")


def test_a_kernel_inside_a_sharded_step_takes_the_unsharded_gradient():
  # 8 devices: batch over data × fsdp (4), heads over tensor (2); the kernel runs per device,
  # with the attention sinks of its own heads
  from reasoning_rl import sharding

  mesh = sharding.make_mesh((2, 2, 2))
  batch = 4
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.normal(size=(batch, 128, 4, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(batch, 128, 2, 16)), jnp.float32) for _ in "kv")
  positions = jnp.tile(jnp.arange(128, dtype=jnp.int32), (batch, 1))

  def loss(q, k, v, sinks, kernel):
    out = kernels.training_attention(q, k, v, positions, positions, scale=0.25, softcap=None,
                                     window=None, sinks=sinks, kernel=kernel)
    return jnp.sum(out * out)

  want = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, SINKS, "reference")
  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)), static_argnums=4)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), jax.set_mesh(mesh):
    placed = [jax.device_put(x, sharding.sharding_for(axes, x.shape, mesh)) for x, axes in
              ((q, ("batch", "length", "heads", "head_dim")),
               (k, ("batch", "length", "kv_heads", "head_dim")),
               (v, ("batch", "length", "kv_heads", "head_dim")),
               (SINKS, ("heads",)))]
    got = step(*placed, "splash")
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)
