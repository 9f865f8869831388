"""Quantized rollouts (`rollout.weight_quantization`): the sampler decodes with int8 or fp8
weights, re-quantized from the trainer's weights at every weight sync; the trainer keeps its own.

Post-training weight quantization through qwix (its PTQ provider): every projection kernel the
block stack multiplies by (`Transformer.run_blocks`: q, k, v, o, gate, up, down) is stored as
`round(W / s)` in the quantized type with one scale `s = max|W| / q_max` per output channel
(absmax over the contracting axes; q_max = 127.5 for int8, qwix's top bucket edge, and 448
for float8_e4m3fn), and the model's
`jnp.einsum` with it is qwix's einsum over that QArray. The embedding, the LM head (outside
`run_blocks`), the norms and the biases stay in the compute dtype, and so does the KV cache.

Activations are not quantized (weight-only): qwix then dequantizes the weight, `q · s` in the
scale's dtype, and multiplies in floating point (`qwix._src.core.dot_general`, its slow path,
which XLA fuses with the matmul). So on a CPU both types save memory and transfer, not
arithmetic: fp8 is storage (float8_e4m3fn converted to the compute dtype before each matmul).

One function makes the sampler's weights from float weights (`WeightQuantizer.__call__`,
traced): the engine's first weights and every weight sync's payload, on the trainer's devices
before the transfer, so the sync moves the quantized bytes. Quantizing is deterministic, so the
sampler decodes exactly the model `nnx.merge(quantizer.graphdef, quantizer(params))`: the
behaviour policy μ of the rollouts, whose log-probs the sampler reports. It is not the trainer's
π_old, so quantized runs always carry an importance correction (`run_settings.sampler_correction`,
docs/off_policy.md).

Not covered (refused by name): mixture-of-experts models (their experts run through a grouped
matmul qwix's PTQ does not intercept: most of the weights would stay float while the router was
quantized), latent attention (its cached decode multiplies by slices of kv_b_proj, which no
quantized einsum sees), a scanned block stack (`model.scan_layers`: the blocks are rebuilt
inside the scan, where qwix cannot replace their kernels), and LoRA with
`lora.sampler_weights='adapters'` (the sampler joins float adapters to its base; `merged` works).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx, traverse_util
from qwix._src.providers.ptq import WithAux  # the quantized kernel's node in the model graph

from reasoning_rl.errors import ConfigError

FIELD = "config.rollout.weight_quantization"
QTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}  # rollout.weight_quantization → qwix qtype
QUANTIZATIONS = ("none", *QTYPES)


def check_model(model, quantization: str) -> None:
  """ConfigError naming `rollout.weight_quantization` for a model it cannot quantize (module
  docstring)."""
  config = model.config
  if quantization not in QUANTIZATIONS:
    raise ConfigError(f"{FIELD}={quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
  if config.mla is not None:
    raise ConfigError(f"{FIELD}={quantization!r}: latent attention ({config.model_type}) "
                      "decodes with slices of kv_b_proj that a quantized matmul does not see; "
                      "use 'none' for this model")
  if config.moe is not None:
    raise ConfigError(f"{FIELD}={quantization!r}: the experts of this mixture-of-experts model "
                      f"({config.model_type}) run through a grouped matmul that qwix's weight "
                      "quantization does not reach; use 'none' for MoE models")
  if model.scan_layers:
    raise ConfigError(f"{FIELD}={quantization!r} with config.model.scan_layers=True: the "
                      "scanned blocks are rebuilt inside the scan, where qwix cannot replace "
                      "their kernels; set model.scan_layers=False or weight_quantization='none'")


def _provider(quantization: str) -> qwix.PtqProvider:
  # weight-only: act_qtype unset, the activations stay in the compute dtype
  return qwix.PtqProvider([qwix.QtRule(module_path=".*", weight_qtype=QTYPES[quantization])])


def _pure_path(key_path) -> tuple:
  """A state leaf's key path as the keys of `nnx.to_pure_dict` (the Variable's `.value` dropped)."""
  keys = []
  for entry in key_path:
    if isinstance(entry, jax.tree_util.DictKey):
      keys.append(entry.key)
    elif isinstance(entry, jax.tree_util.SequenceKey):
      keys.append(entry.idx)
  return tuple(keys)


class WeightQuantizer:
  """Float weights → the quantized sampler's weights, for one model graph.

  Args:
    graphdef: the plain model's graph (what the sampler decodes: no LoRA adapters).
    params: that model's state, concrete or abstract (only shapes and dtypes are read).
    quantization: 'int8' or 'fp8'.

  `graphdef` (after construction): the quantized model's graph, qwix's interception of
  `run_blocks` included; `how`: for each quantized kernel's path, how qwix quantizes it (qtype,
  per-channel axes); `abstract`: shapes and dtypes of what `__call__` returns.
  """

  def __init__(self, graphdef, params, quantization: str):
    if quantization not in QTYPES:
      raise ConfigError(f"{FIELD}={quantization!r}: quantizes with one of {', '.join(QTYPES)}")
    self.quantization = quantization
    self.how: dict[tuple, Any] = {}
    found = {}

    def quantize_once(state):  # traced by eval_shape: qwix runs run_blocks once to find kernels
      model = nnx.merge(graphdef, state)
      check_model(model, quantization)
      config = model.config
      x = jnp.zeros((1, 1, config.hidden_size), model.dtype)
      positions = jnp.zeros((1, 1), jnp.int32)
      quantized = qwix.quantize_model(model, _provider(quantization), x, positions, positions,
                                      methods=("run_blocks",))
      found["graphdef"] = nnx.graphdef(quantized)
      for path, node in nnx.iter_graph(quantized):
        if isinstance(node, WithAux):
          self.how[tuple(path)] = node.how
      return nnx.state(quantized)

    self.abstract = jax.eval_shape(quantize_once, _abstract(params))
    self.graphdef = found["graphdef"]
    if not self.how:
      raise ConfigError(f"{FIELD}={quantization!r}: qwix found no projection to quantize in "
                        "this model's run_blocks")

  def __call__(self, params):
    """The sampler's state from the plain model's float state `params` (jit-able, pure): every
    kernel in `how` quantized per output channel, the rest as it is."""
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(params))
    for path, how in self.how.items():
      quantized = qwix.quantize(flat.pop(path), how.qtype,
                                channelwise_axes=how.channelwise_axes,
                                tiled_axes=how.tiled_axes,
                                calibration_method=how.calibration_method)
      flat[path + ("array", "qvalue")] = quantized.qvalue
      flat[path + ("array", "scale")] = quantized.scale
    leaves, treedef = jax.tree_util.tree_flatten_with_path(self.abstract)
    return jax.tree_util.tree_unflatten(treedef, [flat.pop(_pure_path(key)) for key, _ in leaves])

  def model(self, params) -> nnx.Module:
    """The quantized model for the plain model's float state `params` (the sampler's)."""
    return nnx.merge(self.graphdef, self(params))


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def quantized_model(model, quantization: str) -> nnx.Module:
  """`model` (plain, float) with its projection kernels quantized (`WeightQuantizer`)."""
  graphdef, params = nnx.split(model)
  return WeightQuantizer(graphdef, params, quantization).model(params)


def sampler_bytes(tree) -> int:
  """Bytes of a state's arrays (the sampler's weights, or what a sync sends)."""
  return int(sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)))


__all__ = ["QTYPES", "QUANTIZATIONS", "WeightQuantizer", "check_model", "quantized_model",
           "sampler_bytes"]
