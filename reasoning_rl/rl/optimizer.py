"""The step's optimizer: clipped AdamW on a warm-up + cosine learning-rate schedule.

Counters: the schedule counts optimizer updates (optax's own count in the optimizer state, as
TRL's trainer does), with `warmup_steps` / `total_steps` given in RL steps and stretched by the
μ·M updates per step (`StepConfig.updates_per_step`), so a schedule spans the same RL steps
whatever μ and M are, and the rate also moves within a step.

The moments keep the dtype of the parameters they belong to (float32 master weights by default,
`reasoning_rl.precision`), and on a mesh each moment is sharded like its parameter.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from reasoning_rl.rl.step_config import StepConfig


def learning_rate_schedule(config: StepConfig) -> optax.Schedule:
  """Linear warm-up to `learning_rate`, then cosine decay to `final_lr_fraction` of it.

  Indexed by optimizer updates; `warmup_steps` and `total_steps` are RL steps, each of
  `config.updates_per_step` updates (module docstring, "Counters").
  """
  per_step = config.updates_per_step
  warmup = config.warmup_steps * per_step
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else config.learning_rate,
      peak_value=config.learning_rate, warmup_steps=warmup,
      decay_steps=max(config.total_steps * per_step, warmup + 1),
      end_value=config.learning_rate * config.final_lr_fraction)


def applied_updates(opt_state) -> jax.Array:
  """Optimizer updates applied so far: the count the learning-rate schedule reads (skipped
  updates keep the old optimizer state, so they do not count)."""
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
  counts = [s.count for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
  if len(counts) != 1:
    raise ValueError(f"expected one schedule state in the optimizer state, found {len(counts)}")
  return counts[0]


def make_optimizer(config: StepConfig) -> optax.GradientTransformation:
  """Clipped AdamW over the trainable tree. Model variables that are not parameters (a
  `models.primitives.Buffer`, e.g. DeepSeek-V3's router selection bias) get a zero update:
  neither the gradient nor AdamW's weight decay moves them."""
  return optax.chain(
      optax.clip_by_global_norm(config.max_grad_norm),
      optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2,
                  eps=config.eps, weight_decay=config.weight_decay),
      optax.masked(optax.set_to_zero(), _not_parameters))


def _not_parameters(tree):
  """True at every model variable that is not an `nnx.Param` (the value head's plain arrays and
  every parameter, LoRA adapters included, are False)."""
  return jax.tree.map(lambda v: isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param),
                      tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def init_optimizer_state(optimizer: optax.GradientTransformation, trainable, mesh=None):
  """AdamW's state, each moment sharded like the parameter it belongs to.

  A plain `jit(optimizer.init)` puts the zeros it creates (they depend on no input's values)
  on one device, and the state would then be replicated on every device of the mesh: two full
  copies of the model per device instead of two shards of it.
  """
  if mesh is None:
    return jax.jit(optimizer.init)(trainable)
  replicated = NamedSharding(mesh, PartitionSpec())
  shardings = jax.tree.map(
      lambda x: x.sharding if isinstance(x.sharding, NamedSharding)
      and x.sharding.mesh == mesh else replicated, trainable)
  abstract = jax.eval_shape(optimizer.init, trainable)
  out_shardings = optax.tree_utils.tree_map_params(
      optimizer, lambda _, sharding: sharding, abstract, shardings,
      transform_non_params=lambda _: replicated)
  return jax.jit(optimizer.init, out_shardings=out_shardings)(trainable)
