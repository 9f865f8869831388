"""LoRA adapters inside a model's state: telling them apart from the base, and folding them into
the weights they adapt (W + α/r · A B), which gives a plain `Transformer` again.

These live with the model, not in `reasoning_rl.lora` (which adds the adapters through qwix and
re-exports everything here), because writing a model (`checkpoints.save_hf`) merges adapters, and
the models package must not depend on the LoRA machinery that builds on it.

`settings` below is a `reasoning_rl.lora.LoraSettings` (its `scale` and `base_quantization`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from reasoning_rl.errors import ConfigError
from reasoning_rl.models.transformer import abstract_model


def is_adapted(state) -> bool:
  """Whether an nnx state (or model) holds LoRA adapters."""
  if isinstance(state, nnx.Module):
    state = nnx.state(state)
  return any(isinstance(v, nnx.LoRAParam)
             for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def split_adapters(state):
  """(adapters, base) of a full nnx state."""
  return nnx.split_state(state, nnx.LoRAParam, ...)


def join(adapters, base):
  """The full state from its two parts (inverse of `split_adapters`)."""
  return nnx.merge_state(base, adapters)


def adapted_projections(state):
  """{(path of the module, projection name): (A, B)} of every adapter pair in a state."""
  pairs = {}
  for path, _ in nnx.to_flat_state(state):
    name = str(path[-1])
    if name.endswith("_lora_a"):
      module, projection = tuple(path[:-1]), name[:-len("_lora_a")]
      pairs[(module, projection)] = (
          _value(state, (*module, projection + "_lora_a")),
          _value(state, (*module, projection + "_lora_b")))
  return pairs


def _value(state, path):
  node = state
  for key in path:
    node = node[key]
  return node[...] if isinstance(node, nnx.Variable) else node


def merged_delta(lora_a, lora_b, scale: float, shape) -> jax.Array:
  """α/r · A B in the layout of the weight it adapts.

  Our projections list their contracting axes first (q/k/v [D, H, K], o [H, K, D], MLP [D, F] /
  [F, D]), which is also how qwix orders A's axes, so A B is a tensordot over the rank axis. The
  adapters of a scanned stack carry a leading layers axis (as the weight does): one product per
  layer."""
  a, b = lora_a.astype(jnp.float32), lora_b.astype(jnp.float32)
  if a.ndim + b.ndim - 2 == len(shape):
    delta = jnp.tensordot(a, b, axes=1)
  else:
    delta = jax.vmap(lambda x, y: jnp.tensordot(x, y, axes=1))(a, b)
  if delta.shape != tuple(shape):
    raise ValueError(f"adapter product {delta.shape} does not match the weight {tuple(shape)}")
  return delta * scale


def merge_into_base(adapters, base, settings):
  """The plain model's state W + α/r · A B for every adapted W (same tree as a model without
  LoRA); jit-able. The base must not be quantized."""
  if settings.base_quantization:
    raise ConfigError("merging adapters into a quantized base is not supported: export the "
                      "adapters (PEFT format) and apply them to the unquantized base")
  merged = jax.tree.map(lambda x: x, base)  # a new tree; the arrays are replaced below
  for (module, projection), (a, b) in adapted_projections(adapters).items():
    node = merged
    for key in module:
      node = node[key]
    weight = node[projection]
    new = weight[...] + merged_delta(a, b, settings.scale, weight.shape).astype(weight.dtype)
    node[projection] = weight.replace(new)
  return merged


def plain_graphdef(model_config, *, dtype, param_dtype, scan_layers: bool = False):
  """The graph of the model without adapters (what merged weights run on), in either layout of
  the block stack."""
  graphdef, _ = abstract_model(model_config, dtype=dtype, param_dtype=param_dtype,
                               scan_layers=scan_layers)
  return graphdef


def merged_model(model, settings=None):
  """A plain `Transformer` whose weights are the adapted model's W + α/r · A B."""
  settings = settings or model.lora_settings
  adapters, base = split_adapters(nnx.state(model))
  state = merge_into_base(adapters, base, settings)
  graphdef = plain_graphdef(model.config, dtype=model.dtype, param_dtype=model.param_dtype,
                            scan_layers=model.scan_layers)
  return nnx.merge(graphdef, state)
