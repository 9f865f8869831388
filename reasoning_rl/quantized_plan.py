"""What the planner counts for a quantized sampler (`rollout.weight_quantization`,
`reasoning_rl.sampler.quantized`): the shapes and bytes of its weights, from the model's shapes
alone (no qwix, nothing traced but the abstract model).

Each projection kernel of the block stack is held as one byte per element (int8 or
float8_e4m3fn) plus one scale per output channel in the compute dtype: the kernel's shape with
its contracting axes (the ones `Transformer.run_blocks`' einsums sum over) set to 1. Everything
else (embedding, LM head, norms, biases) keeps the compute dtype, and so does the KV cache
(`memory_plan.kv_cache_bytes`, unchanged). `tests/test_quantized_rollouts.py` checks these
numbers against the quantizer's own output, byte for byte.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from reasoning_rl.lora import PROJECTIONS
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import abstract_model

QUANTIZED_ITEMSIZE = 1  # int8 and float8_e4m3fn alike
# the kernel axes each projection's einsum contracts (models/transformer.py: "td,dhk->thk" for
# q / k / v, "thk,hkd->td" for o, "td,df->tf" for gate / up, "tf,fd->td" for down)
CONTRACTING_AXES = {"q_proj": (0,), "k_proj": (0,), "v_proj": (0,), "o_proj": (0, 1),
                    "gate_proj": (0,), "up_proj": (0,), "down_proj": (0,)}


def is_projection_kernel(path) -> bool:
  """Whether a state path (layers, i, attn|mlp, name) is a kernel the sampler quantizes."""
  path = tuple(map(str, path))
  return (len(path) == 4 and path[0] == "layers" and path[3] in PROJECTIONS.get(path[2], ()))


def sampler_shapes(model_config: ModelConfig, compute_dtype,
                   quantization: str) -> list[tuple[tuple, tuple, float]]:
  """(logical axes, shape, bytes per element) of every array the quantized sampler holds: per
  projection kernel its quantized values and its scales (same axes), the rest as it is."""
  if quantization == "none":
    raise ValueError("sampler_shapes: a float sampler holds ModelShapes.compute")
  compute = np.dtype(compute_dtype)
  _, state = abstract_model(model_config, dtype=compute, param_dtype=compute)
  shapes = []
  for path, v in nnx.to_flat_state(state):
    axes, shape = tuple(v.get_metadata()["logical_axes"]), tuple(v.shape)
    if not is_projection_kernel(path):
      shapes.append((axes, shape, np.dtype(v.dtype).itemsize))
      continue
    contracted = CONTRACTING_AXES[str(path[3])]
    scale = tuple(1 if axis in contracted else size for axis, size in enumerate(shape))
    shapes += [(axes, shape, QUANTIZED_ITEMSIZE), (axes, scale, compute.itemsize)]
  return shapes


__all__ = ["CONTRACTING_AXES", "QUANTIZED_ITEMSIZE", "is_projection_kernel", "sampler_shapes"]
