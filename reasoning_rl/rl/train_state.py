"""What the training step carries from call to call (`TrainState`)."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax


class TrainState(flax.struct.PyTreeNode):
  """Everything the step changes or reads, as pytrees (checkpointable as is)."""

  step: jax.Array
  params: Any  # nnx.State of the policy
  opt_state: Any
  skipped_updates: jax.Array
  value_head: Any = None  # {"kernel": [D], "bias": []} for ppo
  ref_params: Any = None  # frozen reference, only when beta > 0 (never with LoRA)
  frozen_params: Any = None  # LoRA: the frozen base (`params` then holds the adapters)
