"""bfloat16 projections on a CPU (reasoning_rl/models/cpu_products.py): the hand-written backward
equals mixed-precision arithmetic on an independent float64 reference, every product of the
forward and backward reaches XLA:CPU as a bfloat16 dot (what makes them fast), and a bfloat16
model computes through them what it computes through autodiff of its einsums."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from reasoning_rl.models import cpu_products
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model

BF16_EPS = 2.0 ** -8  # bfloat16 keeps 8 significant bits: half an ulp is 2^-8 of the value


@pytest.fixture(autouse=True)
def bfloat16_products(monkeypatch):
  """The module's arithmetic is the same on any CPU; only its speed needs bfloat16 products in
  hardware (AMX or AVX512-BF16). Taken here whatever the CPU running the tests."""
  monkeypatch.setattr(cpu_products, "has_bfloat16_products", lambda: True)


def bf16(a):
  return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def test_split_spec_reads_every_projection_the_models_make():
  assert cpu_products.split_spec("td,dhk->thk") == (1, 2)
  assert cpu_products.split_spec("thk,hkd->td") == (2, 1)
  assert cpu_products.split_spec("tf,fd->td") == (1, 1)
  with pytest.raises(ValueError, match="not of the form"):
    cpu_products.split_spec("td,hdk->thk")  # the kernel's contracted axis is not its first


def test_physical_transpose_is_the_transpose():
  matrix = jnp.arange(12.0).reshape(3, 4)
  np.testing.assert_array_equal(cpu_products.physical_transpose(matrix), matrix.T)


def test_matmul_and_its_gradients_are_mixed_precision_arithmetic():
  """Forward x·w, backward dy·wᵀ and xᵀ·dy: bfloat16 operands (dy rounded to bfloat16 first),
  float32 sums, each result rounded once to its dtype — checked against float64 products of the
  rounded operands, to within that one rounding (and float32 summation)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((48, 40)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((40, 24)), jnp.bfloat16)
  dy = rng.standard_normal((48, 24)).astype(np.float32)

  for out_dtype in (None, jnp.float32):
    out, pullback = jax.vjp(lambda a, b, d=out_dtype: cpu_products.matmul(a, b, d), x, w)
    assert out.dtype == (out_dtype or jnp.bfloat16)
    dx, dw = pullback(jnp.asarray(dy, out.dtype))
    assert dx.dtype == dw.dtype == jnp.bfloat16
    x64, w64, dy64 = bf16(x), bf16(w), bf16(dy)
    for got, want in ((out, x64 @ w64), (dx, dy64 @ w64.T), (dw, x64.T @ dy64)):
      got = np.asarray(got, np.float64)
      scale = np.abs(want) + 1e-3 * np.abs(want).max()
      assert np.max(np.abs(got - want) / scale) <= BF16_EPS * 1.01, np.max(np.abs(got - want))
  # an operand read transposed would be far off: the check can tell
  assert np.max(np.abs(np.asarray(dw, np.float64) - bf16(x).T @ bf16(dy)[:, ::-1])) > 1.0


def _dot_operand_types(hlo: str) -> list[str]:
  """The element types of every dot's operands in an optimized HLO module (the dots inside
  YNNPACK fusions included), each operand's type read where the module defines its name (names
  are unique within a computation; a fused computation's parameters are defined in it)."""
  types, defined = [], {}
  for line in hlo.splitlines():
    if line.startswith("}"):
      defined = {}
    definition = re.match(r"\s*(?:ROOT )?%([\w.-]+) = (\w+)\[", line)
    if definition:
      defined[definition.group(1)] = definition.group(2)
    call = re.search(r" dot\(%([\w.-]+), %([\w.-]+)\)", line)
    if call:
      types += [defined[name] for name in call.groups()]
  return types


def test_every_product_of_forward_and_backward_stays_bfloat16():
  """What the module is for: XLA:CPU runs only plain bfloat16 dots in bfloat16 and converts the
  operands of any other dot to float32. Through autodiff two of the three products would be
  converted (seen: f32 operands in the same check with `.T` instead of `physical_transpose`)."""
  x = jnp.ones((64, 32), jnp.bfloat16)
  w = jnp.ones((32, 48), jnp.bfloat16)

  def loss(a, b):
    return jnp.sum(cpu_products.matmul(a, b, jnp.float32) ** 2)

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
  types = _dot_operand_types(hlo)
  assert len(types) == 6, hlo  # three products, two operands each
  assert set(types) == {"bf16"}, types

  def autodiff_loss(a, b):
    return jnp.sum(jnp.dot(a, b, preferred_element_type=jnp.float32) ** 2)

  plain = jax.jit(jax.grad(autodiff_loss, argnums=(0, 1))).lower(x, w).compile().as_text()
  assert "f32" in _dot_operand_types(plain)  # the reason this module exists


def _tiny_model(dtype):
  config = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       tie_word_embeddings=True)
  return create_model(config, seed=1, dtype=dtype, param_dtype=jnp.float32)


def test_a_bfloat16_model_computes_what_autodiff_of_its_einsums_does(monkeypatch):
  """A 2-layer model in bfloat16 compute: loss and float32 master gradients through this module
  against the same model with the plain einsums (both bfloat16 products, rounded differently:
  they agree to bfloat16's precision, and the module is really taken)."""
  model = _tiny_model("bfloat16")
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 96, (3, 20)), jnp.int32)

  def loss(p):
    logits = nnx.merge(graphdef, p)(tokens)
    return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

  taken = []
  real_project_rows = cpu_products.project_rows
  monkeypatch.setattr(cpu_products, "project_rows",
                      lambda *a: taken.append(1) or real_project_rows(*a))
  fast_loss, fast_grads = jax.value_and_grad(loss)(params)
  assert len(taken) == 2 * 7  # q, k, v, o, gate, up, down in each layer
  monkeypatch.setattr(cpu_products, "applies", lambda *_: False)
  plain_loss, plain_grads = jax.value_and_grad(loss)(params)

  assert abs(float(fast_loss) - float(plain_loss)) < 1e-2 * abs(float(plain_loss))
  for (path, fast), plain in zip(jax.tree.leaves_with_path(fast_grads),
                                 jax.tree.leaves(plain_grads)):
    assert fast.dtype == jnp.float32, path
    fast, plain = np.asarray(fast), np.asarray(plain)
    # cosine similarity: rounding differences only (a wrong layout would decorrelate them)
    cosine = np.sum(fast * plain) / (np.linalg.norm(fast) * np.linalg.norm(plain) + 1e-30)
    assert cosine > 0.995, (jax.tree_util.keystr(path), cosine)


def test_only_bfloat16_cpu_products_without_an_einsum_interceptor_take_it(monkeypatch):
  x = jnp.ones((4, 8), jnp.bfloat16)
  kernel = jnp.ones((8, 2), jnp.bfloat16)
  assert cpu_products.applies(x, kernel)
  assert not cpu_products.applies(x.astype(jnp.float32), kernel.astype(jnp.float32))
  assert not cpu_products.applies(x, kernel.astype(jnp.int8))  # a quantized base
  monkeypatch.setattr(jnp, "einsum", lambda *a, **k: None)
  assert not cpu_products.applies(x, kernel)
  monkeypatch.undo()
  monkeypatch.setattr(jnp.einsum, "__code__", (lambda *a, **k: None).__code__)  # as qwix does
  assert not cpu_products.applies(x, kernel)
  monkeypatch.undo()
  monkeypatch.setattr(cpu_products, "has_bfloat16_products", lambda: False)
  assert not cpu_products.applies(x, kernel)


def test_bfloat16_products_are_read_from_the_cpu_flags(tmp_path):
  cpuinfo = tmp_path / "cpuinfo"
  for flags, expected in (("fpu sse2 avx2 avx512f avx512_vnni", False),
                          ("fpu sse2 avx2 avx512f avx512_bf16", True),
                          ("fpu avx2 avx512f amx_bf16 amx_tile", True)):
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert cpu_products.lists_bfloat16_products(str(cpuinfo)) is expected, flags
  assert not cpu_products.lists_bfloat16_products(str(tmp_path / "absent"))
