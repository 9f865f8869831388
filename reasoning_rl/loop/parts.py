"""What a stage reads of a built run: the interfaces the loop depends on, not the composition root.

`build.Run` (what `build.build(config)` returns) has these fields, and so may anything a test or
another entry point assembles; the loop never imports `build`.
"""

from __future__ import annotations

from typing import Any, Protocol

from reasoning_rl.sampler.api import RolloutBackend


class RunParts(Protocol):
  """The pieces of a run a stage uses, each behind its own interface."""

  config: Any  # the validated run config
  tokenizer: Any  # encode / decode, pad_id, eos_ids
  template: Any  # `.encode(example) -> prompt token ids`
  model_config: Any  # models.config.ModelConfig (FLOPs accounting)
  # rl.step.TrainStep: `host_batch` / `host_batch_with_layout`, `__call__` / `call_with_outputs`,
  # `sampler_weights`
  step_fn: Any
  # this process's sampler replica (None: trains only): rollouts and held-out evaluations; its
  # optional methods are those its registration declared (`sampler.api.Capabilities`)
  backend: RolloutBackend | None
  weight_sync: Any  # loop.weight_sync.WeightSync: what the sampler receives, policy versions
  data: Any  # build.Data: training stream, held-out examples
  reward_fn: Any  # verifiers.rewards.RewardFunction: parts, verifier_version
  scorer: Any  # workers.scorer.Scorer
  sampling: Any  # sampler.SamplingParams of the rollouts
  cluster: Any  # multihost.cluster.Cluster
  trainer_mesh: Any
