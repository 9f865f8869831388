"""bfloat16 projections on a CPU: every product of the forward and the backward pass in the one
operand layout XLA:CPU runs through its bfloat16 matrix kernels (AMX on Intel Xeons, AVX512-BF16
dot-product instructions on AMD Zen 4 and 5).

XLA:CPU keeps a bfloat16 dot in bfloat16 only when it is the plain matmul `[M, K] × [K, N]` (the
left operand contracting its last axis, the right its first) and it accumulates in float32; any
other dot is converted to float32 operands first and runs at float32 speed. A projection's
forward is that plain matmul, but autodiff writes its two backward products as dots over a
transposed operand (dx = dy · Wᵀ, dW = xᵀ · dy), and XLA folds a `transpose` into the dot's
dimension numbers, so they never reach the bfloat16 kernels. Here the backward is written by hand
with each transposed operand made by a reshape and a transpose of three axes, which XLA lays out
as a real copy instead of folding (`physical_transpose`). On an Intel Xeon with AMX a projection's
forward + backward runs 2.4-4.1x float32's, the GRPO step 2.1x (benchmarks/RESULTS.md, "bfloat16
projections on an Intel Xeon with AMX"); on an AMD EPYC Zen 5 (AVX512-BF16, no AMX) 1.5-2.1x
float32's ("bfloat16 products on an AMD EPYC with AVX512-BF16").

The arithmetic is mixed precision's (Micikevicius et al. 2018, "Mixed Precision Training", §3.3:
low-precision operands, products summed in float32, the result rounded once), with the incoming
gradient rounded to bfloat16 like every other operand, as torch's CPU autocast does; autodiff of
the einsum differs only in that XLA runs its backward dots on float32 copies. Checked against
float64 products of the rounded operands (tests/test_cpu_products.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# qwix (LoRA) intercepts jnp.einsum while it adapts a model by swapping the function's code
# object, so a changed code object is how an interception shows.
_PLAIN_EINSUM_CODE = jnp.einsum.__code__


BFLOAT16_PRODUCT_FLAGS = ("amx_bf16", "avx512_bf16")


def lists_bfloat16_products(cpuinfo: str = "/proc/cpuinfo") -> bool:
  """Whether a CPU's flags (Linux's /proc/cpuinfo) include bfloat16 products in hardware: AMX-BF16
  tiles (Intel Xeon since Sapphire Rapids) or AVX512-BF16 dot-product instructions (AMD Zen 4
  and 5, Intel Cooper Lake). Without either this module's products are slower than float32 ones
  (capped at AVX2 on an Intel Xeon, `python -m benchmarks.isa_cap benchmarks.cpu_products`:
  0.56-0.79x the float32 projection), so there the einsum stays, which XLA converts to float32."""
  try:
    with open(cpuinfo, encoding="ascii", errors="replace") as lines:
      for line in lines:
        if line.startswith("flags"):
          return not set(line.split()).isdisjoint(BFLOAT16_PRODUCT_FLAGS)
  except OSError:
    pass
  return False


@functools.cache
def has_bfloat16_products() -> bool:
  return lists_bfloat16_products()


def applies(x, kernel) -> bool:
  """Whether `project` should take this module's product: bfloat16 operands, traced for a CPU
  with bfloat16 products in hardware, plain arrays (not a quantized base), and no qwix
  interception of `jnp.einsum` installed (LoRA adds its adapters inside that call, so it must
  stay an einsum)."""
  return (x.dtype == jnp.bfloat16 and isinstance(kernel, jax.Array)  # tracers are jax.Arrays
          and kernel.dtype == jnp.bfloat16
          and getattr(jnp.einsum, "__code__", None) is _PLAIN_EINSUM_CODE
          and jax.default_backend() == "cpu"
          and has_bfloat16_products())


def split_spec(spec: str) -> tuple[int, int]:
  """(contracted axes, output axes of the kernel) of a projection spec "t<in>,<in><out>->t<out>",
  e.g. "td,dhk->thk" → (1, 2); refuses any other form."""
  inputs, output = spec.split("->")
  rows, kernel = inputs.split(",")
  contracted = rows[1:]
  if (rows[:1] != output[:1] or not kernel.startswith(contracted)
      or output[1:] != kernel[len(contracted):]):
    raise ValueError(f"projection spec {spec!r} is not of the form 't<in>,<in><out>->t<out>'")
  return len(contracted), len(kernel) - len(contracted)


def physical_transpose(matrix):
  """matrix [M, N] → [N, M] as data in row-major order. A plain transpose feeding a dot is folded
  into the dot's dimension numbers; this one moves the data (a transpose of three axes, which the
  dot cannot absorb)."""
  rows, cols = matrix.shape
  return jnp.transpose(matrix.reshape(rows, cols, 1), (1, 0, 2)).reshape(cols, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x, w, out_dtype=None):
  """x [M, K] · w [K, N] for bfloat16 operands, accumulated in float32, returned in `out_dtype`
  (default: the operands' dtype)."""
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype or x.dtype)


def _matmul_forward(x, w, out_dtype):
  return matmul(x, w, out_dtype), (x, w)


def _matmul_backward(out_dtype, saved, dy):
  del out_dtype
  x, w = saved
  dy = dy.astype(x.dtype)  # the products' operands in bfloat16, as in the forward
  dx = jnp.dot(dy, physical_transpose(w), preferred_element_type=jnp.float32)
  dw = jnp.dot(physical_transpose(x), dy, preferred_element_type=jnp.float32)
  return dx.astype(x.dtype), dw.astype(w.dtype)


matmul.defvjp(_matmul_forward, _matmul_backward)


def project_rows(spec: str, rows, kernel):
  """`jnp.einsum(spec, rows, kernel)` for rows [T, *in] and kernel [*in, *out] through `matmul`."""
  contracted, _ = split_spec(spec)
  fan_in = math.prod(kernel.shape[:contracted])
  flat = matmul(rows.reshape(rows.shape[0], fan_in), kernel.reshape(fan_in, -1))
  return flat.reshape(rows.shape[0], *kernel.shape[contracted:])
