"""A learned reward model as a reward part (`kind="reward_model"`).

The model is a Hugging Face `LlamaForSequenceClassification` / `Qwen2ForSequenceClassification`
checkpoint (`reasoning_rl.models.reward_model.RewardModel`: the reward model of Ouyang et al. 2022,
InstructGPT, arXiv:2203.02155, section 3.5 — a transformer whose scalar head reads the final
token). It scores (task prompt, completion) under its own chat template; the part's value is the
score of `label`, raw, or squashed by a logistic sigmoid (`transform="sigmoid"`: under the
Bradley–Terry model such a reward model is trained with, σ(r) is the probability that the
completion beats one scored 0).

Settings (`config.rewards.<name>`; declared with their defaults and accepted values in
`config_groups.REWARD_PARTS["reward_model"]`, which also checks them):
  model: the checkpoint directory (local). Required.
  dtype: compute dtype, "float32" | "bfloat16".
  label: which output of the head is the reward (0 for the usual single-logit reward model).
  transform: "none" (the raw score) | "sigmoid".
  max_tokens: longest scored sequence; a longer one keeps its last `max_tokens` tokens (the
    completion's end, where the head reads, and as much of the prompt as fits).
  batch_size: rows per forward (the batch is padded to a power of two up to this).

Like `judge`, the part is model-scored: `workers.model_parts.ModelPartsScorer` scores it on the
main process in one batch per step, its model on the sampler's devices (colocated).
"""

from __future__ import annotations

import math
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from reasoning_rl import config_groups
from reasoning_rl.errors import ConfigError

REWARD_MODEL_VERSION = "reward_model-1"
TRANSFORMS = config_groups.REWARD_MODEL_TRANSFORMS  # declared with the setting that names them
def version(s: Mapping[str, Any]) -> str:
  """The part's verifier version: the checkpoint (its directory name) and every setting."""
  return (f"{REWARD_MODEL_VERSION}:{pathlib.Path(s['model']).name}:label{s['label']}:"
          f"{s['transform']}:{s['dtype']}:max{s['max_tokens']}")


class RewardModelPart:
  """The part scorer (`workers.model_parts` contract): one value per record of a batch."""

  def __init__(self, settings: Mapping[str, Any], model):
    self.settings = dict(settings)
    self.model = model
    if not 0 <= self.settings["label"] < model.num_labels:
      raise ConfigError(f"reward_model.label={self.settings['label']}: the checkpoint "
                        f"{self.settings['model']} has {model.num_labels} label(s); use one of "
                        f"0..{model.num_labels - 1}")
    self._records = 0
    self._truncated = 0
    self._seconds = 0.0

  @classmethod
  def load(cls, settings: Mapping[str, Any], *, mesh=None) -> "RewardModelPart":
    from reasoning_rl.models.reward_model import RewardModel  # pylint: disable=import-outside-toplevel
    model = RewardModel.load(settings["model"], dtype=settings["dtype"], mesh=mesh,
                             max_batch=settings["batch_size"])
    return cls(settings, model)

  def score_batch(self, records: Sequence[Any], rule_rewards: Sequence[Any] = ()) -> list[float]:
    start = time.perf_counter()
    limit = self.settings["max_tokens"]
    rows = []
    for record in records:
      ids = self.model.encode_pair(record.prompt, record.response)
      if len(ids) > limit:
        self._truncated += 1
        ids = ids[-limit:]
      rows.append(ids)
    scores = self.model.score_tokens(rows)[:, self.settings["label"]] if rows else []
    values = [float(score) for score in scores]
    if self.settings["transform"] == "sigmoid":
      values = [_sigmoid(v) for v in values]
    self._records += len(records)
    self._seconds += time.perf_counter() - start
    return values

  def metrics(self) -> dict[str, float]:
    return {"records": float(self._records), "truncated": float(self._truncated),
            "seconds": self._seconds}


def _sigmoid(x: float) -> float:
  return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
