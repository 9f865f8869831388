"""What the training loop carries from step to step besides the train state, and its checkpoint form.

- `SampledBatch`: one step's rollouts (`rl.rollout_columns.RolloutColumns`, the one record of
  them) plus how they were obtained (sampling rounds, scoring statuses, seconds, the policy
  version that sampled them).
- `InFlight`: partial rollouts' groups still in flight between steps (`loop.partial_rollouts`).
- `LoopState`: data position, policy version, guard state, the queue of batches sampled ahead
  (asynchronous rollouts) and what partial rollouts hold in flight. `to_meta()` / `load_meta()`
  are its checkpoint metadata (plain JSON, with `format_version` = `LOOP_STATE_FORMAT_VERSION`),
  saved beside the Orbax train state so that a resume continues bit for bit. A loop state of
  another version is refused with one line (`CheckpointError`) before anything is loaded;
  version 1 (before partial rollouts) reads as version 2 with nothing in flight, and versions 1
  and 2 (before the columnar record) read their queued batches' groups into one.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from reasoning_rl import guards as guards_lib
from reasoning_rl.errors import CheckpointError
from reasoning_rl.rl.rollout_columns import RolloutColumns
from reasoning_rl.rl.segment_rows import SegmentRows
from reasoning_rl.sampler.api import Completion, Unfinished

SCORING_STATUSES = ("ok", "timeout", "error")


def scoring_counts(rollouts: RolloutColumns) -> dict[str, int]:
  """{ok, timeout, error}: how many of the record's groups the scorer gave each verdict."""
  return {status: rollouts.status.count(status) for status in SCORING_STATUSES}


# The checkpoint metadata `LoopState.to_meta` writes: the fields of `_META_FIELDS`, each queued
# batch as `SampledBatch.to_json` (version 3: its rollouts as `RolloutColumns.to_json`; versions
# 1 and 2 listed its groups, `RolloutColumns.from_legacy_groups`), and (from version 2)
# `in_flight` as `InFlight.to_json`.
LOOP_STATE_FORMAT_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)  # version 1 had no in_flight: nothing was
_META_FIELDS = ("data_position", "policy_version", "guards", "queue", "pending_eval")


@dataclasses.dataclass(frozen=True)
class SampledBatch:
  """One step's kept groups (DAPO dynamic sampling may have dropped and refilled some).

  rollouts: the groups' tokens, log-probs, rewards and texts (`rl.rollout_columns`).
  outcome: all-pass / all-fail fractions over every group sampled, kept or not.
  groups_sampled: groups sampled over all rounds.
  scoring: {ok, timeout, error} group counts over every group sampled.
  sample_s / verify_s: seconds decoding / waiting for the scorer after decoding ended.
  policy_version: the policy version that sampled the groups.
  exact: with `rollout.exact_logprobs`, what verification did on this process's share
    (`sampler.exact.ExactStats` as a dict, summed over dynamic-sampling rounds); else None.
  decode: the decode calls' slot use (`sampler.rollout.DecodeUsage` as a dict, the last
    sampling round's), when the backend reports it.
  partial: partial rollouts' round (`loop.partial_rollouts`): groups in flight and carried,
    tokens resumed, samples restarted, and the trained tokens' lag behind the policy version
    (policy_version is then the oldest token's version).
  teacher_s: seconds in on-policy distillation's teacher forwards (`teacher.path`; this process's
    share), 0 without a teacher.
  agent: agent rollouts (`agents.collector`): the step's failed-episode fraction and counts
    (logged as episode/*).
  segments: agent rollouts with `agent.segment_rows`: the segments of split episodes past the first,
    trained in the batch's extra rows (`rl.segment_rows`); None otherwise.
  """

  rollouts: RolloutColumns
  outcome: dict
  groups_sampled: int
  scoring: dict
  sample_s: float
  verify_s: float
  policy_version: int
  exact: dict | None = None
  decode: dict | None = None
  partial: dict | None = None
  teacher_s: float = 0.0
  agent: dict | None = None  # agent rollouts (reasoning_rl/agents): failed episodes, skips
  segments: SegmentRows | None = None

  def to_json(self) -> dict:
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    fields["rollouts"] = self.rollouts.to_json()
    if self.segments is None:  # the form of loop states written before segments existed
      del fields["segments"]
    else:
      fields["segments"] = self.segments.to_json()
    return fields

  def summary(self) -> "SampledBatch":
    """This batch with its rollouts' summary (`RolloutColumns.summary`)."""
    return dataclasses.replace(self, rollouts=self.rollouts.summary(), segments=None)

  @classmethod
  def from_json(cls, fields: dict) -> "SampledBatch":
    """As `to_json` wrote it, or as a loop state of format_version 1 or 2 did (`groups`)."""
    fields = dict(fields)
    if "groups" in fields:
      fields["rollouts"] = RolloutColumns.from_legacy_groups(fields.pop("groups"))
    else:
      fields["rollouts"] = RolloutColumns.from_json(fields["rollouts"])
    if fields.get("segments") is not None:
      fields["segments"] = SegmentRows.from_json(fields["segments"])
    return cls(**fields)


@dataclasses.dataclass
class InFlightGroup:
  """One prompt of partial rollouts not trained yet: its finished samples (sample index ->
  completion), its unfinished ones (sample index -> what they drew so far; a sample in neither
  has not started), and once all G finished, the scorer's verdict (`scored`)."""

  data_position: int
  finished: dict[int, Completion] = dataclasses.field(default_factory=dict)
  unfinished: dict[int, Unfinished] = dataclasses.field(default_factory=dict)
  scored: dict | None = None

  def to_json(self) -> dict:
    return {"data_position": self.data_position,
            "finished": {str(s): c.to_json() for s, c in self.finished.items()},
            "unfinished": {str(s): u.to_json() for s, u in self.unfinished.items()},
            "scored": self.scored}

  @classmethod
  def from_json(cls, fields: dict) -> "InFlightGroup":
    return cls(int(fields["data_position"]),
               {int(s): Completion.from_json(c) for s, c in fields["finished"].items()},
               {int(s): Unfinished.from_json(u) for s, u in fields["unfinished"].items()},
               fields["scored"])


@dataclasses.dataclass
class InFlight:
  """Partial rollouts' groups in flight, in the order they were admitted."""

  groups: list[InFlightGroup] = dataclasses.field(default_factory=list)

  def to_json(self) -> list:
    return [group.to_json() for group in self.groups]

  @classmethod
  def from_json(cls, items: list) -> "InFlight":
    return cls([InFlightGroup.from_json(item) for item in items])


@dataclasses.dataclass
class LoopState:
  """The loop's bookkeeping between steps (the train state itself lives in rl.train_state.TrainState).

  data_position: training prompts consumed so far (the next prompt's index).
  policy_version: training steps applied so far (RL: rollout batches, each with all its μ × M
    optimizer updates; SFT: batches), so version v is the parameters after step v and 0 the
    starting model. The sampler holds this version; rollout records carry the version that
    sampled them and asynchronous rollouts measure staleness in it. Only
    `loop.weight_sync.WeightSync.publish` advances it (and a restore loads it).
  guards: the stop conditions and their history.
  queue: batches sampled ahead of their step (asynchronous rollouts), oldest first.
  pending_eval: the step whose held-out evaluation is due and not yet done (a stop request
    interrupted it, or the checkpoint was written first); a resumed run does it before training.
  in_flight: partial rollouts' groups between steps (empty otherwise).
  """

  guards: guards_lib.Guards
  data_position: int = 0
  policy_version: int = 0
  queue: collections.deque = dataclasses.field(default_factory=collections.deque)
  pending_eval: int | None = None
  in_flight: InFlight = dataclasses.field(default_factory=InFlight)

  def to_meta(self) -> dict[str, Any]:
    return {"format_version": LOOP_STATE_FORMAT_VERSION, "data_position": self.data_position,
            "policy_version": self.policy_version, "guards": self.guards.state_dict(),
            "queue": [b.to_json() for b in self.queue], "pending_eval": self.pending_eval,
            "in_flight": self.in_flight.to_json()}

  @staticmethod
  def summary_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` (as `to_meta` wrote it) with the queued batches' groups summarized: what
    sampler-only processes load at a resume (the queue holds bulk data)."""
    return {**meta, "queue": [SampledBatch.from_json(b).summary().to_json() for b in meta["queue"]]}

  def meta_problem(self, meta: dict[str, Any], where: str) -> str | None:
    """Why `meta` (read from `where`, a file) cannot be loaded, in one line; None if it can."""
    try:
      self._parse_meta(meta, where)
    except CheckpointError as error:
      return str(error)
    return None

  def load_meta(self, meta: dict[str, Any], where: str = "the checkpoint's meta item") -> None:
    """Loads `meta` as `to_meta` wrote it (from file `where`). Raises CheckpointError naming
    `where` for a meta of another format version, or one that does not parse; then nothing is
    loaded."""
    (self.data_position, self.policy_version, guards_state, self.queue,
     self.pending_eval, self.in_flight) = self._parse_meta(meta, where)
    self.guards.load_state_dict(guards_state)

  def _parse_meta(self, meta: dict[str, Any], where: str) -> tuple:
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version is None:
      # Written before versions were. The last field version 1 added was pending_eval: a meta
      # holding every field of _META_FIELDS is version 1's content and reads as such (it still
      # has to parse below); an older one is refused.
      missing = [f for f in _META_FIELDS if not isinstance(meta, dict) or f not in meta]
      if missing:
        raise CheckpointError(
            f"{where}: loop state from before format_version 1 (it lacks {missing[0]!r}), "
            "which this reasoning_rl does not resume; start a new workdir, or resume with the "
            "reasoning_rl that wrote it")
    elif version not in _READABLE_VERSIONS:
      raise CheckpointError(
          f"{where}: loop state format_version {version!r}, but this reasoning_rl reads versions "
          f"{', '.join(map(str, _READABLE_VERSIONS))} only; resume with the reasoning_rl that "
          "wrote it, or start a new workdir")
    try:
      pending = meta["pending_eval"]
      parsed = (int(meta["data_position"]), int(meta["policy_version"]), meta["guards"],
                collections.deque(SampledBatch.from_json(b) for b in meta["queue"]),
                None if pending is None else int(pending),
                InFlight.from_json(meta["in_flight"] if version in (2, 3) else []))
      guards_lib.Guards(self.guards.config).load_state_dict(parsed[2])  # a trial: it parses
    except (KeyError, TypeError, ValueError) as error:
      raise CheckpointError(
          f"{where}: loop state of format_version {version or 1} does not parse "
          f"({type(error).__name__}: {error}); the checkpoint is damaged, restore an earlier "
          "step") from None
    return parsed
