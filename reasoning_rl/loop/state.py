"""What the training loop carries from step to step besides the train state, and its checkpoint form.

- `GroupRollout`: one prompt's G completions, sampled and scored.
- `SampledBatch`: one step's groups plus how they were obtained (sampling rounds, scoring statuses,
  seconds, the policy version that sampled them).
- `LoopState`: data position, policy version, guard state and the queue of batches sampled ahead
  (asynchronous rollouts). `to_meta()` / `from_meta()` are its checkpoint metadata (plain JSON),
  saved beside the Orbax train state so that a resume continues bit for bit.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from reasoning_rl import guards as guards_lib
from reasoning_rl.rl import batching

SCORING_STATUSES = ("ok", "timeout", "error")


@dataclasses.dataclass(frozen=True)
class GroupRollout:
  """One prompt's group.

  data_position: the prompt's index in the training stream (also its sampling key).
  group: token ids, sampler log-probs, rewards and reward parts of the G completions.
  responses: the decoded completions, as the verifiers scored them.
  status: the scorer's verdict for the group: ok | timeout | error (then every reward is 0).
  """

  data_position: int
  group: batching.ScoredGroup
  responses: tuple[str, ...]
  status: str = "ok"

  def to_json(self) -> list:
    return [self.data_position, dataclasses.asdict(self.group), list(self.responses), self.status]

  def summary(self) -> "GroupRollout":
    """The group as sampler-only processes of a split run hold it: what every process's loop
    decides on (data position, scoring status, rewards for dynamic sampling, the `correct` part
    for the pass / fail fractions), without tokens, log-probs or text. Those processes never build
    a batch (they do not train), so they are spared reading the bulk (multihost.bulk)."""
    parts = {k: v for k, v in self.group.parts.items() if k == "correct"}
    return GroupRollout(self.data_position, batching.ScoredGroup(
        prompt_tokens=[], completion_ids=[], logprobs=[], rewards=list(self.group.rewards),
        parts=parts, truncated=[]), (), self.status)

  @classmethod
  def from_json(cls, item: list) -> "GroupRollout":
    position, fields, responses, *rest = item  # checkpoints before statuses had 3 fields
    return cls(int(position), batching.ScoredGroup(**fields), tuple(responses),
               rest[0] if rest else "ok")


@dataclasses.dataclass(frozen=True)
class SampledBatch:
  """One step's kept groups (DAPO dynamic sampling may have dropped and refilled some).

  outcome: all-pass / all-fail fractions over every group sampled, kept or not.
  groups_sampled: groups sampled over all rounds.
  scoring: {ok, timeout, error} group counts over every group sampled.
  sample_s / verify_s: seconds decoding / waiting for the scorer after decoding ended.
  policy_version: the policy version that sampled the groups.
  """

  groups: tuple[GroupRollout, ...]
  outcome: dict
  groups_sampled: int
  scoring: dict
  sample_s: float
  verify_s: float
  policy_version: int

  def to_json(self) -> dict:
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    fields["groups"] = [g.to_json() for g in self.groups]
    return fields

  def summary(self) -> "SampledBatch":
    """This batch with its groups' summaries (`GroupRollout.summary`)."""
    return dataclasses.replace(self, groups=tuple(g.summary() for g in self.groups))

  @classmethod
  def from_json(cls, fields: dict) -> "SampledBatch":
    fields = dict(fields)
    if "scoring" not in fields:  # checkpoints written before scoring statuses were counted apart
      timeouts, total = fields.pop("timeouts"), fields.pop("verifications")
      fields["scoring"] = {"ok": total - timeouts, "timeout": timeouts, "error": 0}
    fields["groups"] = tuple(GroupRollout.from_json(g) for g in fields["groups"])
    return cls(**fields)


@dataclasses.dataclass
class LoopState:
  """The loop's bookkeeping between steps (the train state itself lives in rl.step.TrainState).

  data_position: training prompts consumed so far (the next prompt's index).
  policy_version: optimizer updates applied so far; the sampler holds this version.
  guards: the stop conditions and their history.
  queue: batches sampled ahead of their step (asynchronous rollouts), oldest first.
  pending_eval: the step whose held-out evaluation is due and not yet done (a stop request
    interrupted it, or the checkpoint was written first); a resumed run does it before training.
  """

  guards: guards_lib.Guards
  data_position: int = 0
  policy_version: int = 0
  queue: collections.deque = dataclasses.field(default_factory=collections.deque)
  pending_eval: int | None = None

  def to_meta(self) -> dict[str, Any]:
    return {"data_position": self.data_position, "policy_version": self.policy_version,
            "guards": self.guards.state_dict(), "queue": [b.to_json() for b in self.queue],
            "pending_eval": self.pending_eval}

  @staticmethod
  def summary_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` (as `to_meta` wrote it) with the queued batches' groups summarized: what
    sampler-only processes load at a resume (the queue holds bulk data)."""
    return {**meta, "queue": [SampledBatch.from_json(b).summary().to_json() for b in meta["queue"]]}

  def load_meta(self, meta: dict[str, Any]) -> None:
    self.data_position = int(meta["data_position"])
    self.policy_version = int(meta["policy_version"])
    self.guards.load_state_dict(meta["guards"])
    self.queue = collections.deque(SampledBatch.from_json(b) for b in meta["queue"])
    self.pending_eval = meta.get("pending_eval")  # absent in checkpoints before it existed
