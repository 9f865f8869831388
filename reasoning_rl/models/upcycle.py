"""Sparse upcycling (Komatsuzaki et al. 2022, "Sparse Upcycling: Training Mixture-of-Experts from
Dense Checkpoints"): a dense model becomes a mixture of experts whose every sparse layer holds E
copies of the dense layer's MLP and a freshly initialised router.

With the chosen experts' weights renormalised to sum 1 (`MoEConfig.normalize_top_k`), a token's
output is Σ_i w_i · MLP(x) = MLP(x) whatever the router picks, so the upcycled model computes what
the dense one computes (up to the rounding of that sum) until training makes the experts differ.

A fresh random router on a trained model's hidden states is all but collapsed: the inputs of a
layer's MLP share a large common direction (SmolLM2-135M on chat prompts: the mean input's norm
is 0.55 of the mean norm), its share of every token's logits is the same, and top-k picks the
same experts for nearly every token (SmolLM2 upcycled into 4 experts, top-2: a layer's busiest
expert took 0.75 of the most it could on average over layers, 1.0 in the worst, where 0.5 is
balanced; benchmarks/RESULTS.md). With `calibration` token rows, each layer's router is drawn
orthogonal to the mean of its inputs over those rows, so only what tells tokens apart routes
them (0.55 on average, 0.60 at worst, also on tokens the mean was not taken from).

The upcycled model belongs to a mixture-of-experts family with the dense family's attention, so
`save_hf` writes a checkpoint transformers loads: Llama (SmolLM2 …) becomes Mixtral, Qwen3 becomes
Qwen3-MoE. Other families have no such counterpart and are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reasoning_rl.errors import ConfigError
from reasoning_rl.models.config import ModelConfig, MoEConfig
from reasoning_rl.models.transformer import (Transformer, create_model, stack_layers,
                                             unstack_layers)

# dense family -> the MoE family with the same attention (what save_hf then writes)
UPCYCLED_FAMILY = {"llama": "mixtral", "qwen3": "qwen3_moe"}


def upcycled_config(config: ModelConfig, *, num_experts: int,
                    experts_per_token: int) -> ModelConfig:
  """The MoE config of an upcycled `config`: every layer sparse, E experts of the dense MLP's
  width, renormalised top-k weights."""
  if config.moe is not None:
    raise ConfigError(f"model.upcycle: the model ({config.model_type}) is already a mixture of "
                      "experts; set model.upcycle.num_experts=0")
  if config.model_type not in UPCYCLED_FAMILY:
    raise ConfigError(
        f"model.upcycle: a {config.model_type!r} model has no mixture-of-experts family with its "
        f"attention to become (supported: {', '.join(sorted(UPCYCLED_FAMILY))})")
  if config.model_type == "llama" and config.attention_bias:
    raise ConfigError("model.upcycle: a Llama model with attention biases has no Mixtral "
                      "counterpart (Mixtral's projections have no bias)")
  if not 0 < experts_per_token <= num_experts:
    raise ConfigError(f"model.upcycle.experts_per_token={experts_per_token}: must be in "
                      f"1..num_experts={num_experts}")
  moe = MoEConfig(num_experts=num_experts, experts_per_token=experts_per_token,
                  intermediate_size=config.intermediate_size,
                  sparse_layers=(True,) * config.num_layers, normalize_top_k=True)
  return dataclasses.replace(config, model_type=UPCYCLED_FAMILY[config.model_type], moe=moe)


def upcycle(model: Transformer, *, num_experts: int, experts_per_token: int, seed: int = 0,
            calibration: Sequence[Sequence[int]] = ()) -> Transformer:
  """The upcycled mixture of experts of `model` (module docstring), in `model`'s layout and
  dtypes; routers drawn from N(0, 0.02²) with `seed`, each orthogonal to the mean of its layer's
  inputs over the `calibration` token rows when given."""
  dense = unstack_layers(model)
  config = upcycled_config(dense.config, num_experts=num_experts,
                           experts_per_token=experts_per_token)
  target = nnx.eval_shape(lambda: create_model(config, dtype=dense.dtype,
                                               param_dtype=dense.param_dtype))
  _, dense_state = nnx.split(dense)
  graphdef, state = nnx.split(target)
  dense_flat = dict(nnx.to_flat_state(dense_state))
  routers = jax.random.split(jax.random.key(seed), config.num_layers)
  for path, variable in nnx.to_flat_state(state):
    path = tuple(path)
    if len(path) == 4 and path[2] == "mlp" and path[3] == "router":
      value = 0.02 * jax.random.normal(routers[path[1]], variable.shape, jnp.float32)
      value = value.astype(variable.dtype)
    elif len(path) == 4 and path[2] == "mlp":  # an expert projection: E copies of the MLP's
      dense_value = dense_flat[path][...]
      value = jnp.broadcast_to(dense_value, (num_experts, *dense_value.shape))
    else:
      value = dense_flat[path][...]
    variable.set_value(jnp.array(value, dtype=variable.dtype))
  upcycled = nnx.merge(graphdef, state)
  if calibration:
    upcycled = _centered_routers(upcycled, calibration)
  return stack_layers(upcycled) if model.scan_layers else upcycled


def _centered_routers(model: Transformer, rows: Sequence[Sequence[int]]) -> Transformer:
  """`model` with each router W ← W − μ̂ μ̂ᵀ W, μ̂ the unit mean of its layer's inputs over
  `rows` (left-padded into one batch). The experts being copies of one MLP, the forward that
  measures the inputs is the dense model's whatever the routers are."""
  width = max(len(row) for row in rows)
  tokens = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), np.int32)
  for index, row in enumerate(rows):
    tokens[index, width - len(row):], mask[index, width - len(row):] = row, 1
  _, stats = model.hidden_states(jnp.asarray(tokens), jnp.asarray(mask), with_router_stats=True)
  means = np.asarray(stats.input_sum) / np.maximum(np.asarray(stats.tokens), 1.0)[:, None]
  sparse = 0
  for block in model.layers:
    if not block.sparse:
      continue
    direction = means[sparse] / max(np.linalg.norm(means[sparse]), 1e-12)
    router = np.asarray(block.mlp.router[...], np.float32)
    router = router - np.outer(direction, direction @ router)
    block.mlp.router.set_value(jnp.asarray(router, block.mlp.router.dtype))
    sparse += 1
  return model
