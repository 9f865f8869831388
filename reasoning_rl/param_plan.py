"""Bytes of a run's parameters per device: every parameter's (logical axes, shape, bytes per
element) from the abstract model, what one device's shard of them weighs under the project's
partition rules, and what each role holds (`ModelShapes`: master weights, compute-dtype copies,
LoRA adapters, the sampler's weights, what a sync sends) in which dtype (`Precision`). The
memory plan (`memory_plan`) adds activations, caches and phases on top.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from reasoning_rl.lora import PROJECTIONS, LoraSettings
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import abstract_model
from reasoning_rl.quantized_plan import sampler_shapes
from reasoning_rl.sharding import logical_to_spec


def shard_size(axes: Sequence[str | None], shape: Sequence[int], mesh: AbstractMesh) -> int:
  """Elements of one device's shard of an array with logical `axes` (dims the rules do not divide
  stay whole)."""
  spec = logical_to_spec(axes, shape, mesh)
  size = 1
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    size *= dim // math.prod(mesh.shape[a] for a in names)
  return size


def parameter_shapes(model_config: ModelConfig, dtype, lora=None) -> list[tuple[tuple, tuple,
                                                                                float]]:
  """(logical axes, shape, bytes per element) of every parameter, from the abstract model; with
  QLoRA settings (`lora.base_quantization`) the adapted projections at their quantized size.
  Remembered per (architecture, dtype, LoRA settings): tracing a 7B model takes seconds."""
  key = (repr(model_config), str(np.dtype(dtype)), repr(lora))
  if key not in _SHAPES:
    _SHAPES[key] = _parameter_shapes(model_config, dtype, lora)
  return list(_SHAPES[key])


_SHAPES: dict[tuple, list] = {}


def _parameter_shapes(model_config: ModelConfig, dtype, lora) -> list[tuple[tuple, tuple, float]]:
  _, state = abstract_model(model_config, dtype=dtype, param_dtype=dtype)
  quantized = _quantized_itemsize(lora)
  shapes = []
  for path, v in nnx.to_flat_state(state):
    itemsize = np.dtype(v.dtype).itemsize
    if quantized and _is_adapted_projection(path, lora):
      itemsize = quantized
    shapes.append((tuple(v.get_metadata()["logical_axes"]), tuple(v.shape), itemsize))
  return shapes


def _quantized_itemsize(lora) -> float | None:
  if lora is None or not lora.enabled or not lora.base_quantization:
    return None
  if lora.base_quantization == "int8":
    return 1.0  # + one float32 scale per output channel, negligible
  return 0.5 + (4 / lora.quantization_tile if lora.quantization_tile else 0.0)


def _is_adapted_projection(path, lora) -> bool:
  path = tuple(map(str, path))
  return (len(path) == 4 and path[0] == "layers" and path[3] in PROJECTIONS.get(path[2], ())
          and re.fullmatch(lora.target_modules, "/".join(path[:3])) is not None)


def adapter_shapes(model_config: ModelConfig, lora, dtype) -> list[tuple[tuple, tuple, float]]:
  """(axes, shape, bytes per element) of every LoRA adapter (replicated, so axes are None):
  A [fan-in, r] and B [r, fan-out] per adapted projection (`reasoning_rl.lora`)."""
  if lora is None or not lora.enabled:
    return []
  m, r, itemsize = model_config, lora.rank, np.dtype(dtype).itemsize
  d, f, k = m.hidden_size, m.intermediate_size, m.head_dim
  fans = {"q_proj": (d, m.num_heads * k), "k_proj": (d, m.num_kv_heads * k),
          "v_proj": (d, m.num_kv_heads * k), "o_proj": (m.num_heads * k, d),
          "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
  shapes = []
  for layer in range(m.num_layers):
    for module, projections in PROJECTIONS.items():
      if re.fullmatch(lora.target_modules, f"layers/{layer}/{module}"):
        for name in projections:
          fan_in, fan_out = fans[name]
          shapes += [((None, None), (fan_in, r), itemsize), ((None, None), (r, fan_out), itemsize)]
  return shapes


def param_bytes_per_device(shapes: Sequence[tuple[tuple, tuple, float]],
                           mesh: AbstractMesh) -> int:
  """Bytes of one device's shard of every parameter, as the partition rules place it."""
  return int(sum(shard_size(axes, shape, mesh) * itemsize for axes, shape, itemsize in shapes))


def split_ways(mesh: AbstractMesh, axis: str, size: int) -> int:
  """How many ways a dimension of `size` with logical `axis` is split on `mesh`."""
  return size // shard_size((axis,), (size,), mesh)


def layer_weight_bytes(shapes: Sequence[tuple[tuple, tuple, int]], mesh: AbstractMesh,
                        num_layers: int) -> int:
  """Bytes of one layer's weights with the `fsdp` axis gathered (tensor sharding kept)."""
  gathered = AbstractMesh(tuple(1 if name == "fsdp" else size for name, size in
                                zip(mesh.axis_names, mesh.axis_sizes)), mesh.axis_names)
  layer_shapes = [s for s in shapes if "vocab" not in s[0]]  # all but embedding / LM head
  return param_bytes_per_device(layer_shapes, gathered) // max(1, num_layers)


@dataclasses.dataclass(frozen=True)
class Precision:
  """The dtypes of a run: `compute` (model.dtype: activations, the KV cache, the sampler's
  weights and what the trainer sends them) and `weights` (model.weight_dtype: the trainer's
  master weights and AdamW moments). Gradients are accumulated in float32; LoRA adapters are
  float32."""

  compute: np.dtype
  weights: np.dtype

  @classmethod
  def of(cls, config) -> "Precision":
    return cls(np.dtype(config.model.dtype),
               np.dtype(config.model.weight_dtype))


@dataclasses.dataclass(frozen=True)
class ModelShapes:
  """(logical axes, shape, bytes per element) of what each role holds."""

  master: list  # every base parameter in the weight dtype (QLoRA: adapted projections quantized)
  compute: list  # the same in the compute dtype: the frozen base / reference copies
  adapters: list  # LoRA adapters (float32); [] without LoRA
  sends_adapters: bool  # LoRA with lora.sampler_weights = "adapters": the sync sends them alone
  # the sampler's weights and what a full sync sends: `compute`, or with
  # rollout.weight_quantization its projections quantized (`quantized_plan.sampler_shapes`)
  sampler: list = dataclasses.field(default_factory=list)
  quantization: str = "none"

  @classmethod
  def of(cls, config, model_config: ModelConfig) -> "ModelShapes":

    lora = LoraSettings.from_config(config)
    precision = Precision.of(config)
    master = parameter_shapes(model_config, precision.weights, lora)
    # the same tensors in the compute dtype (quantized ones keep their size)
    compute = [(axes, shape, precision.compute.itemsize
                if itemsize == precision.weights.itemsize else itemsize)
               for axes, shape, itemsize in master]
    quantization = config.rollout.weight_quantization
    sampler = (compute if quantization == "none"
               else sampler_shapes(model_config, precision.compute, quantization))
    return cls(master=master, compute=compute,
               adapters=adapter_shapes(model_config, lora, "float32"),
               sends_adapters=lora.enabled and lora.sampler_weights == "adapters",
               sampler=sampler, quantization=quantization)

  def sampler_weights(self, mesh: AbstractMesh) -> int:
    """Bytes per device of the sampler's weights on `mesh`: base + adapters, or merged (with
    rollout.weight_quantization: quantized)."""
    extra = param_bytes_per_device(self.adapters, mesh) if self.sends_adapters else 0
    return param_bytes_per_device(self.sampler, mesh) + extra

  def sent(self, mesh: AbstractMesh) -> int:
    """Bytes per device, laid out as `mesh` wants them, of what a weight sync sends."""
    if self.sends_adapters:
      return param_bytes_per_device(self.adapters, mesh)
    return param_bytes_per_device(self.sampler, mesh)

  def sampler_dtype(self, precision: Precision) -> str:
    """How the sampler's weights are held, for the plan's labels: the compute dtype, or e.g.
    int8/float32 (projections quantized, the rest in the compute dtype)."""
    if self.quantization == "none":
      return precision.compute.name
    return f"{self.quantization}/{precision.compute.name}"


def with_itemsize(shapes, itemsize: float) -> list:
  return [(axes, shape, itemsize) for axes, shape, _ in shapes]


__all__ = ["ModelShapes", "Precision", "adapter_shapes", "layer_weight_bytes",
           "param_bytes_per_device", "parameter_shapes", "shard_size", "split_ways",
           "with_itemsize"]
