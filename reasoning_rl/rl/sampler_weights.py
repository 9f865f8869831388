"""The weights the sampler receives from the trainer after a step.

All parameters cast to `StepConfig.compute_dtype` (a new copy on the trainer's devices; the float32
master weights stay as they are); with LoRA the adapters alone (`lora.sampler_weights='adapters'`:
the sampler keeps its copy of the base) or the plain model's weights with the adapters folded in
('merged'), also in `compute_dtype`. Where nothing is cast or merged, the parameters themselves:
the sampler copies them. With a `quantizer` (`rollout.weight_quantization`,
`reasoning_rl.sampler.quantized`), the plain weights in the compute dtype are then quantized here,
on the trainer's devices, so the sync sends the quantized form and the sampler decodes exactly it.
"""

from __future__ import annotations

import jax

from reasoning_rl import lora, precision
from reasoning_rl.rl.step_config import StepConfig


class SamplerWeights:
  """Called with (params, frozen_params): the sampler's copy of the trainer's weights, made by one
  program compiled on first use (`params`: the policy, or the adapters with LoRA;
  `frozen_params`: LoRA's frozen base, else None). `quantizer`: a
  `sampler.quantized.WeightQuantizer` of the plain model, or None (float weights)."""

  def __init__(self, config: StepConfig, quantizer=None):
    self.config = config
    self.quantizer = quantizer
    self._compiled = None

  def __call__(self, params, frozen_params):
    c = self.config
    merges = c.trains_adapters and c.lora.sampler_weights == "merged"
    if self.quantizer is None and not merges and (
        c.compute_dtype is None or not precision.needs_cast(params, c.compute_dtype)):
      return params  # nothing to cast: the sampler copies the parameters themselves
    if self._compiled is None:
      self._compiled = jax.jit(self._sampler_copy)
    return self._compiled(params, frozen_params)

  def _sampler_copy(self, params, frozen_params):
    """The sampler's weights from the trainer's (traced by `__call__`'s jit)."""
    if self.config.trains_adapters and self.config.lora.sampler_weights == "merged":
      params = lora.merge_into_base(params, frozen_params, self.config.lora)
    if self.config.compute_dtype is not None:
      params = precision.cast_floating(params, self.config.compute_dtype)
    return params if self.quantizer is None else self.quantizer(params)
