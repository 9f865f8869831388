"""The weight sync: what the sampler receives after a step, how it gets there, and which policy
version it then holds. The one owner of both decisions (architecture §1, "weight sync").

What the sampler receives (`WeightSync.mode`), decided once from the step's configuration:
- `full`: every parameter, cast to the compute dtype (`TrainStep.sampler_weights`);
- `adapters`: a LoRA run's adapters alone (`lora.sampler_weights='adapters'`); the backend keeps
  its copy of the frozen base and joins them (`update_weights(..., adapters_only=True)`);
- `merged`: a LoRA run's adapters folded into the base (`lora.sampler_weights='merged'`), so the
  sampler decodes a plain model.
With `rollout.weight_quantization`, `full` and `merged` send the plain model quantized
(`sampler.quantized`): int8 / fp8 kernels and their scales, computed on the trainer's devices.

How: one process, the backend's `update_weights` (a device-to-device copy); several, the trainer
mesh to each sampler replica in buckets under a deadline (`multihost.Cluster.sync_params`).

The policy version (`loop.state.LoopState.policy_version`) counts training steps: version v is
the parameters after step v (an RL step: one rollout batch with all its μ × M optimizer updates;
an SFT step: one batch), version 0 the starting model. It advances here and nowhere else, once
per published step; the sampler holds it, each rollout records the version that sampled it, and
asynchronous rollouts measure their staleness in it (docs/architecture.md §1).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from reasoning_rl import lora, precision

MODES = ("full", "adapters", "merged")


@dataclasses.dataclass(frozen=True)
class Published:
  """One sync: the version the sampler now holds, what went to each replica, and how long."""

  version: int
  num_bytes: int
  seconds: float


def mode_of(step_config) -> str:
  """What the sampler receives under `step_config` (`rl.step_config.StepConfig`): one of MODES."""
  if not step_config.trains_adapters:
    return "full"
  return "adapters" if step_config.lora.sampler_weights == "adapters" else "merged"


def abstract_payload(step_config, params, quantizer=None) -> Any:
  """Shapes and dtypes of what each sync sends, from the freshly built model's state (the
  multi-process weight sync plans its buckets from them): all weights, the adapters, or the
  base's tree (merged weights have its shapes), in the compute dtype; with a `quantizer`
  (`rollout.weight_quantization`), the quantized sampler's state it makes from those."""
  if quantizer is not None:
    return quantizer.abstract
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  mode = mode_of(step_config)
  if mode != "full":
    adapters, base = lora.split_adapters(abstract)
    abstract = adapters if mode == "adapters" else base
  dtype = step_config.compute_dtype
  return abstract if dtype is None else precision.cast_floating(abstract, dtype)


class WeightSync:
  """Publishes the trainer's weights to the rollout backend(s) and advances the policy version.

  Args:
    step_fn: the `rl.step.TrainStep` (its `sampler_weights(state)` computes the payload on the
      trainer's devices; its config says which payload, `mode_of`).
    backend: this process's `sampler.api.RolloutBackend` (None on a process that only trains).
    cluster: `multihost.cluster.Cluster` (roles and, multi-process, the transfers).
  """

  def __init__(self, step_fn, backend, cluster):
    self.step_fn = step_fn
    self.backend = backend
    self.cluster = cluster
    self.mode = mode_of(step_fn.config)

  def payload(self, state) -> Any:
    """What the sampler receives for train state `state` (None on a process that does not
    train: its share arrives through the cluster)."""
    return self.step_fn.sampler_weights(state) if self.cluster.is_trainer else None

  def publish(self, state, loop) -> Published:
    """After a step: version `loop.policy_version + 1` is `state`'s; the sampler gets it."""
    loop.policy_version += 1
    return self.push(state, loop.policy_version)

  def push(self, state, version: int) -> Published:
    """Sends `state`'s weights as `version` without advancing the count (a resume puts the
    restored policy back on the sampler)."""
    start = time.perf_counter()
    weights = self.payload(state)
    self.cluster.sync_params(self.backend, weights, version=version,
                             adapters_only=self.mode == "adapters")
    return Published(version=version, num_bytes=lora.num_bytes(weights) if weights is not None
                     else 0, seconds=time.perf_counter() - start)


__all__ = ["MODES", "Published", "WeightSync", "abstract_payload", "mode_of"]
