"""MXFP4 tensors: how GPT-OSS's published checkpoints store their experts, dequantized at load.

MXFP4 is a microscaling format of the OCP "Microscaling Formats (MX) Specification" v1.0 (2023): a
block of 32 elements shares one E8M0 scale, a power of two 2^(s − 127) kept as its biased exponent
s in an unsigned byte (255 is NaN), and each element is an FP4 E2M1 code (a sign bit, two exponent
bits, one mantissa bit: ±0, 0.5, 1, 1.5, 2, 3, 4 or 6). An element is its code's value times its
block's scale.

GPT-OSS's checkpoints keep each expert projection [E, fan-in C, fan-out R] quantized along its
fan-in: the tensor `<name>` is absent, and in its place

  <name>_blocks  uint8 [E, R, C/32, 16]  two codes per byte, the element of even index in the
                                         low nibble
  <name>_scales  uint8 [E, R, C/32]      each block's biased exponent

which transformers' `integrations/mxfp4.py` dequantizes to [E, R, C] and transposes to the
parameter's [E, C, R]; `dequantize` here computes the same tensor. Loading dequantizes (the model
then holds bfloat16 or float32 experts like any checkpoint's): every MXFP4 value has at most two
significant bits, so the result is exact in bfloat16, which is what `dequantize` returns (half
float32's host memory while a large checkpoint loads). Keeping the experts quantized on device
(e.g. through qwix) is not done.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from reasoning_rl.errors import CheckpointError

BLOCK = 32  # elements per shared scale
# FP4 E2M1 code -> value: bit 3 the sign, bits 2..1 the exponent, bit 0 the mantissa.
FP4_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_BIAS = 127


def is_stored_as_mxfp4(files, name: str) -> bool:
  """Whether `files` (a SafetensorsDirectory) hold tensor `name` as MXFP4 blocks and scales."""
  return name not in files and f"{name}_blocks" in files and f"{name}_scales" in files


def dequantized_shape(blocks_shape) -> tuple[int, ...]:
  """The [E, C, R] parameter a `<name>_blocks` tensor of shape [E, R, C/32, 16] holds."""
  experts, rows, groups, width = blocks_shape
  return (experts, groups * width * 2, rows)


def dequantize(blocks: np.ndarray, scales: np.ndarray, *, name: str = "tensor") -> np.ndarray:
  """blocks uint8 [E, R, G, 16] and scales uint8 [E, R, G] → the [E, 32·G, R] parameter in
  bfloat16 (exact; module docstring). One expert at a time, so the float32 temporaries stay one
  expert's size."""
  if blocks.ndim != 4 or blocks.shape[-1] * 2 != BLOCK or scales.shape != blocks.shape[:-1]:
    raise CheckpointError(
        f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not "
        f"[E, R, G, {BLOCK // 2}] and [E, R, G]; the checkpoint is not GPT-OSS's MXFP4 layout")
  out = np.empty(dequantized_shape(blocks.shape), ml_dtypes.bfloat16)
  for expert in range(blocks.shape[0]):
    packed = np.asarray(blocks[expert], np.uint8)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1)  # [R, G, 16, 2]: even, odd element
    values = FP4_E2M1_VALUES[codes].reshape(*packed.shape[:2], BLOCK)  # [R, G, 32]
    exponents = np.asarray(scales[expert], np.int32) - SCALE_BIAS
    # 2^−127 … 2^127 are exact in float32; 255 (NaN in the spec) overflows to inf, which the
    # loader's finiteness check refuses
    values = np.ldexp(values, exponents[..., None])
    out[expert] = values.reshape(packed.shape[0], -1).T.astype(ml_dtypes.bfloat16)
  return out
