"""What a stage reads of a built run: the interfaces the loop depends on, not the composition root.

`build.Run` (what `build.build(config)` returns) has these fields, and so may anything a test or
another entry point assembles; the loop never imports `build`. The types are named for readers and
type checkers only (`TYPE_CHECKING`): importing this module loads none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from reasoning_rl.sampler.api import RolloutBackend

if TYPE_CHECKING:
  import jax
  import ml_collections

  from reasoning_rl.data.templates import PromptTemplate
  from reasoning_rl.loop.weight_sync import WeightSync
  from reasoning_rl.models.config import ModelConfig
  from reasoning_rl.models.tokenizers import Tokenizer
  from reasoning_rl.multihost.cluster import Cluster
  from reasoning_rl.rl.step import TrainStep
  from reasoning_rl.sampler.sampling import SamplingParams
  from reasoning_rl.verifiers.rewards import RewardFunction
  from reasoning_rl.workers.scorer import Scorer


class TrainingData(Protocol):
  """The prompts a run trains on and the held-out examples it evaluates (`build.Data`)."""

  train_source: Any  # data.tasks task source: `.example(index)`, the training stream's examples
  eval_examples: Sequence[Any]
  held_out: Any  # the held-out prompts the training stream excludes


class RunParts(Protocol):
  """The pieces of a run a stage uses, each behind its own interface."""

  config: ml_collections.ConfigDict  # the validated run config
  tokenizer: Tokenizer  # encode / decode, pad_id, eos_ids
  template: PromptTemplate  # `.encode(example) -> prompt token ids`
  model_config: ModelConfig  # FLOPs accounting
  # `host_batch` / `host_batch_with_layout`, `__call__` / `call_with_outputs`, `sampler_weights`
  step_fn: TrainStep
  # this process's sampler replica (None: trains only): rollouts and held-out evaluations; its
  # optional methods are those its registration declared (`sampler.api.Capabilities`)
  backend: RolloutBackend | None
  weight_sync: WeightSync  # what the sampler receives, policy versions
  data: TrainingData
  reward_fn: RewardFunction  # parts, verifier_version
  scorer: Scorer
  sampling: SamplingParams  # of the rollouts
  cluster: Cluster
  trainer_mesh: jax.sharding.Mesh | None
