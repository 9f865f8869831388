"""One step's rollouts as columns: the one record from the collector to the training batch.

The collector builds a `RolloutColumns` from the backend's `Completion`s and the scorer's rewards;
the same object then goes everywhere a rollout goes — the advantage stage (which adds
`advantages`), the batch (`batching.build_batch`, whose padded rows are this record's samples in
order; packing maps its sequence slots back to them with one index, `packing.PackedLayout`), the
rollout records, the loop state of a checkpoint and the files between processes (`to_json`, one
versioned form) — and no other form of a completion is made on the way.

Three extents, and one column per quantity:
- per group [num_groups]: `data_position` (the prompt's index in the training stream, also its
  sampling key), the scorer's `status`, `prompt_tokens` (ragged) and the `sampling` settings;
- per sample [num_groups · G], sample g·G + s being sample s of group g and row g·G + s of the
  padded batch: `rewards`, reward `parts`, `truncated`, the `responses` the verifiers read,
  multi-turn `episodes` and, once the advantage stage ran, `advantages`;
- per token, ragged over samples (`Ragged`: one flat array and the samples' lengths):
  `completion_ids`, the sampler's `logprobs` and `sampling_logprobs`, `loss_mask`, the
  `token_versions` that drew each token, mixture-of-experts routing (`experts`, over prompt and
  completion tokens), per-token advantages (`token_advantages`: PPO's, the step's output, or
  on-policy distillation's, made before the batch, `rl.distillation`) and the teacher's log-prob
  of each sampled token (`teacher_logprobs`, `rl.teacher`).

Columns a run does not have are None (no routing for a dense model, no loss mask when every token
is the model's; a `summary` keeps only what the loop decides on). Numbers are held at the precision the batch and the metrics read them in:
rewards and parts float64 (as the verifiers return them), log-probs float32 (as the sampler
computes them).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from reasoning_rl.sampler.api import array_from_json, array_to_json

# `to_json`'s format. Loop states of format_version ≤ 2 held groups in the form before this record
# (`from_legacy_groups` reads them).
ROLLOUT_COLUMNS_FORMAT_VERSION = 1
# A group's sampling settings, and the dtype each is held in.
SAMPLING_FIELDS = {"temperature": np.float64, "top_p": np.float64, "top_k": np.int64,
                   "min_p": np.float64}


@dataclasses.dataclass(frozen=True, eq=False)
class Ragged:
  """Rows of different lengths in one array: row i is `values[offsets[i]:offsets[i + 1]]`."""

  values: np.ndarray  # [sum(lengths), ...]
  lengths: np.ndarray  # [rows] int64

  @classmethod
  def from_rows(cls, rows: Sequence, dtype, trailing: tuple[int, ...] = ()) -> "Ragged":
    arrays = [np.asarray(row, dtype).reshape(-1, *trailing) for row in rows]
    values = (np.concatenate(arrays) if arrays else np.zeros((0, *trailing), dtype))
    return cls(values, np.array([len(a) for a in arrays], np.int64))

  @property
  def offsets(self) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

  def __len__(self) -> int:
    return len(self.lengths)

  def __getitem__(self, row: int) -> np.ndarray:
    start = int(self.lengths[:row].sum())
    return self.values[start:start + int(self.lengths[row])]

  def rows(self) -> list[np.ndarray]:
    return np.split(self.values, self.offsets[1:-1]) if len(self) else []

  def take(self, rows: Sequence[int]) -> "Ragged":
    """The rows `rows`, in that order."""
    kept = self.rows()
    return Ragged.from_rows([kept[r] for r in rows], self.values.dtype, self.values.shape[1:])

  @staticmethod
  def concat(parts: Sequence["Ragged"]) -> "Ragged":
    return Ragged(np.concatenate([p.values for p in parts]),
                  np.concatenate([p.lengths for p in parts]))

  def to_json(self) -> dict:
    return {"values": array_to_json(self.values), "lengths": self.lengths.tolist()}

  def __eq__(self, other) -> bool:  # exact: same dtype, shape and values
    return isinstance(other, Ragged) and self.to_json() == other.to_json()

  @classmethod
  def from_json(cls, item: dict) -> "Ragged":
    return cls(array_from_json(item["values"]), np.array(item["lengths"], np.int64))


# The columns with one entry per group (`take_groups`), and those ragged over each sample's
# tokens (`from_json`); every other column has one entry per sample.
GROUP_COLUMNS = ("data_position", "status", "prompt_tokens", "sampling")
TOKEN_COLUMNS = ("completion_ids", "logprobs", "sampling_logprobs", "loss_mask",
                 "token_versions", "experts", "token_advantages", "teacher_logprobs")


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutColumns:
  """Groups of `group_size` samples, column by column (module docstring). Two records are equal
  when every column is, exactly (dtype included)."""

  group_size: int
  data_position: np.ndarray  # [N] int64
  status: tuple[str, ...]  # [N]: ok | timeout | error (then every reward is 0)
  prompt_tokens: Ragged | None  # [N] int32 (None: a summary, as below)
  sampling: dict[str, np.ndarray] | None  # SAMPLING_FIELDS -> [N]; None: not recorded
  rewards: np.ndarray  # [S] float64, the total reward
  parts: dict[str, np.ndarray]  # reward part -> [S] float64, unweighted
  truncated: np.ndarray | None  # [S] bool
  responses: tuple[str, ...] | None  # [S], the text the verifiers read
  episodes: tuple[dict, ...] | None  # [S] multi-turn: {"turns", "episode_end", "environment_parts"}
  completion_ids: Ragged | None  # [S] int32
  logprobs: Ragged | None  # [S] float32, the model's unscaled distribution
  sampling_logprobs: Ragged | None  # [S] float32, the distribution drawn from (= logprobs)
  loss_mask: Ragged | None  # [S] int32: 0 at an episode's observation tokens; None: all 1
  token_versions: Ragged | None  # [S] int64, the policy version that drew each token
  experts: Ragged | None  # [S] over prompt + completion tokens, [.., L_sparse, k] (MoE)
  advantages: np.ndarray | None = None  # [S] float32, the advantage stage's
  # [S] float32, per-token advantages: PPO's (the step's) or on-policy distillation's
  token_advantages: Ragged | None = None
  teacher_logprobs: Ragged | None = None  # [S] float32, log π_teacher of each sampled token

  # ------------------------------------------------------------------------------ building

  @classmethod
  def of_group(cls, data_position: int, completions: Sequence, responses: Sequence[str], *,
               status: str, rewards: Sequence, sampling=None) -> "RolloutColumns":
    """One prompt's group from its G completions (`sampler.api.Completion`, ordered by sample
    index), the texts the verifiers read, the scorer's status and one `verifiers.rewards.Reward`
    per completion. `sampling`: the `SamplingParams` it was drawn with (recorded for the
    truncated ratio, `algo.truncated_ratio`)."""
    multi_turn = completions[0].turns is not None
    routed = all(c.experts is not None for c in completions)
    return cls(
        group_size=len(completions),
        data_position=np.array([data_position], np.int64), status=(status,),
        prompt_tokens=Ragged.from_rows([completions[0].prompt_tokens], np.int32),
        sampling=None if sampling is None else {
            name: np.array([getattr(sampling, name)], dtype)
            for name, dtype in SAMPLING_FIELDS.items()},
        rewards=np.array([r.total for r in rewards], np.float64),
        parts={name: np.array([r.parts[name] for r in rewards], np.float64)
               for name in rewards[0].parts},
        truncated=np.array([bool(c.truncated) for c in completions]),
        responses=tuple(responses),
        episodes=(tuple({"turns": c.turns, "episode_end": c.episode_end,
                         "environment_parts": c.reward_parts} for c in completions)
                  if multi_turn else None),
        completion_ids=Ragged.from_rows([c.completion_ids for c in completions], np.int32),
        logprobs=Ragged.from_rows([c.logprobs for c in completions], np.float32),
        sampling_logprobs=Ragged.from_rows(
            [c.sampling_logprobs if c.sampling_logprobs is not None else c.logprobs
             for c in completions], np.float32),
        loss_mask=(Ragged.from_rows(
            [c.loss_mask if c.loss_mask is not None else [1] * len(c.completion_ids)
             for c in completions], np.int32)
                   if any(c.loss_mask is not None for c in completions) else None),
        token_versions=Ragged.from_rows(
            [c.token_versions or [c.policy_version] * len(c.completion_ids)
             for c in completions], np.int64),
        experts=(Ragged.from_rows([c.experts for c in completions], completions[0].experts.dtype,
                                  completions[0].experts.shape[1:]) if routed else None))

  @staticmethod
  def concat(parts: Sequence["RolloutColumns"], group_size: int) -> "RolloutColumns":
    """The groups of `parts`, in order (none: an empty record of `group_size`-sample groups).
    A column one part with groups lacks is dropped."""
    parts = [p for p in parts if p.num_groups]
    if not parts:
      return RolloutColumns.empty(group_size)
    fields = {}
    for field in dataclasses.fields(RolloutColumns):
      values = [getattr(p, field.name) for p in parts]
      if field.name == "group_size":
        fields["group_size"] = group_size
      elif any(v is None for v in values):
        fields[field.name] = None
      elif isinstance(values[0], Ragged):
        fields[field.name] = Ragged.concat(values)
      elif isinstance(values[0], tuple):
        fields[field.name] = sum(values, ())
      elif isinstance(values[0], dict):
        fields[field.name] = {k: np.concatenate([v[k] for v in values]) for k in values[0]}
      else:
        fields[field.name] = np.concatenate(values)
    return RolloutColumns(**fields)

  @classmethod
  def empty(cls, group_size: int) -> "RolloutColumns":
    nothing = Ragged.from_rows([], np.int32)
    return cls(group_size=group_size, data_position=np.zeros(0, np.int64), status=(),
               prompt_tokens=nothing, sampling=None, rewards=np.zeros(0), parts={},
               truncated=np.zeros(0, bool), responses=(), episodes=None,
               completion_ids=nothing, logprobs=Ragged.from_rows([], np.float32),
               sampling_logprobs=Ragged.from_rows([], np.float32), loss_mask=None,
               token_versions=Ragged.from_rows([], np.int64), experts=None)

  def take_groups(self, groups: Sequence[int]) -> "RolloutColumns":
    """Groups `groups` (indices), in that order, with all their columns."""
    groups = list(groups)
    samples = [g * self.group_size + s for g in groups for s in range(self.group_size)]
    fields = {"group_size": self.group_size}
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name == "group_size":
        continue
      rows = groups if field.name in GROUP_COLUMNS else samples
      if value is None:
        fields[field.name] = None
      elif isinstance(value, Ragged):
        fields[field.name] = value.take(rows)
      elif isinstance(value, tuple):
        fields[field.name] = tuple(value[r] for r in rows)
      elif isinstance(value, dict):
        fields[field.name] = {k: v[rows] for k, v in value.items()}
      else:
        fields[field.name] = value[np.array(rows, np.int64)]
    return RolloutColumns(**fields)

  def with_advantages(self, advantages) -> "RolloutColumns":
    """This record with the advantage stage's [num_groups, G] (or [S]) advantages, float32."""
    values = np.asarray(advantages, np.float32).reshape(-1)
    if len(values) != self.num_samples:
      raise ValueError(f"{len(values)} advantages for {self.num_samples} samples")
    return dataclasses.replace(self, advantages=values)

  def with_token_advantages(self, token_advantages: Ragged) -> "RolloutColumns":
    """This record with per-token advantages (PPO's, or on-policy distillation's), one per
    completion token of each sample."""
    if not np.array_equal(token_advantages.lengths, self.completion_ids.lengths):
      raise ValueError("token advantages must have one value per completion token")
    return dataclasses.replace(self, token_advantages=token_advantages)

  def with_teacher_logprobs(self, teacher_logprobs: Ragged) -> "RolloutColumns":
    """This record with the teacher's log-prob of each completion token (`rl.teacher`)."""
    if not np.array_equal(teacher_logprobs.lengths, self.completion_ids.lengths):
      raise ValueError("teacher log-probs must have one value per completion token")
    return dataclasses.replace(
        self, teacher_logprobs=Ragged(teacher_logprobs.values.astype(np.float32),
                                      teacher_logprobs.lengths))

  def __eq__(self, other) -> bool:
    return isinstance(other, RolloutColumns) and self.to_json() == other.to_json()

  # ------------------------------------------------------------------------------ reading

  @property
  def num_groups(self) -> int:
    return len(self.data_position)

  @property
  def num_samples(self) -> int:
    return len(self.rewards)

  def group_rewards(self) -> np.ndarray:
    """[num_groups, G] total rewards."""
    return self.rewards.reshape(self.num_groups, self.group_size)

  def has_signal(self) -> np.ndarray:
    """[num_groups] bool: False where every sample got the same reward (group-relative
    advantages are all zero there)."""
    rewards = self.group_rewards()
    return (rewards != rewards[:, :1]).any(axis=1)

  def model_token_counts(self) -> np.ndarray:
    """[S] tokens each sample generated itself (an episode's observation tokens excluded)."""
    if self.loss_mask is None:
      return self.completion_ids.lengths.copy()
    return np.array([int(mask.sum()) for mask in self.loss_mask.rows()], np.int64)

  def outcome_fractions(self, part: str | None = "correct") -> dict[str, float]:
    """Shares of groups where every sample passed / failed. Pass and fail are read from the
    `part` reward part (1 = pass) when the record has it, otherwise from the total reward
    (> 0 = pass)."""
    if not self.num_groups:
      return {"groups/all_pass_frac": 0.0, "groups/all_fail_frac": 0.0}
    values = self.parts.get(part) if part else None
    passed = (values >= 1.0) if values is not None else (self.rewards > 0)
    passed = passed.reshape(self.num_groups, self.group_size)
    return {"groups/all_pass_frac": int(passed.all(axis=1).sum()) / self.num_groups,
            "groups/all_fail_frac": int((~passed.any(axis=1)).sum()) / self.num_groups}

  def summary(self) -> "RolloutColumns":
    """The groups as sampler-only processes of a split run hold them: what every process's loop
    decides on (data positions, scoring status, rewards for dynamic sampling, the `correct` part
    for the pass / fail fractions) and nothing else — no tokens, log-probs or texts (those columns
    are None). Those processes never build a batch (they do not train), so they are spared
    reading the bulk (multihost.bulk), and the summary travels in the exchange's small messages."""
    return RolloutColumns(
        group_size=self.group_size, data_position=self.data_position, status=self.status,
        prompt_tokens=None, sampling=None, rewards=self.rewards,
        parts={k: v for k, v in self.parts.items() if k == "correct"}, truncated=None,
        responses=None, episodes=None, completion_ids=None, logprobs=None,
        sampling_logprobs=None, loss_mask=None, token_versions=None, experts=None)

  # ------------------------------------------------------------------------------ serialisation

  def to_json(self) -> dict:
    """The record as JSON: token columns as dtype, shape and base64 bytes (exact, and a quarter
    of the size of number lists), the per-group and per-sample columns as dtype and a number list
    (exact too: a float's repr reads back to the same value; a few numbers, which compress well in
    the exchange's messages, `summary`), texts and episodes as they are."""
    out: dict[str, Any] = {"format_version": ROLLOUT_COLUMNS_FORMAT_VERSION,
                           "group_size": self.group_size}
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name == "group_size":
        continue
      if value is None:  # a column the record does not have: left out (read back as None)
        continue
      if isinstance(value, tuple):
        out[field.name] = list(value)
      elif isinstance(value, Ragged):
        out[field.name] = value.to_json()
      elif isinstance(value, dict):
        out[field.name] = {k: _column_to_json(v) for k, v in value.items()}
      else:
        out[field.name] = _column_to_json(value)
    return out

  @classmethod
  def from_json(cls, item: Mapping) -> "RolloutColumns":
    version = item.get("format_version")
    if version != ROLLOUT_COLUMNS_FORMAT_VERSION:
      raise ValueError(f"rollout columns of format_version {version!r}; this reasoning_rl reads "
                       f"version {ROLLOUT_COLUMNS_FORMAT_VERSION}")
    fields = {"group_size": int(item["group_size"])}
    for field in dataclasses.fields(cls):
      if field.name == "group_size":
        continue
      value = item.get(field.name)
      if value is None:
        fields[field.name] = None
      elif field.name in ("status", "responses", "episodes"):
        fields[field.name] = tuple(value)
      elif field.name in ("sampling", "parts"):
        fields[field.name] = {k: _column_from_json(v) for k, v in value.items()}
      elif field.name == "prompt_tokens" or field.name in TOKEN_COLUMNS:
        fields[field.name] = Ragged.from_json(value)
      else:
        fields[field.name] = _column_from_json(value)
    return cls(**fields)

  @classmethod
  def from_legacy_groups(cls, items: Sequence[list]) -> "RolloutColumns":
    """The groups of a loop state of format_version 1 or 2, which held each group as
    [data position, its fields, responses, status(, turns)], log-probs as number lists."""
    parts = []
    for position, fields, responses, status, *turns in items:
      size = len(fields["rewards"])
      completions = [_LegacySample(fields, s, turns[0][s] if turns else None)
                     for s in range(size)]
      # what of_group reads of a Reward and of SamplingParams
      rewards = [types.SimpleNamespace(total=fields["rewards"][s],
                                       parts={k: v[s] for k, v in fields["parts"].items()})
                 for s in range(size)]
      sampling = fields.get("sampling")
      parts.append(cls.of_group(
          int(position), completions, responses, status=status, rewards=rewards,
          sampling=None if sampling is None else types.SimpleNamespace(**sampling)))
    return cls.concat(parts, group_size=len(items[0][1]["rewards"]) if items else 0)


def _column_to_json(values: np.ndarray) -> dict:
  """A per-group or per-sample column: its dtype and its values as a list."""
  return {"dtype": values.dtype.name, "values": values.tolist()}


def _column_from_json(item: dict) -> np.ndarray:
  return np.array(item["values"], np.dtype(item["dtype"]))


class _LegacySample:
  """Sample s of a legacy group's fields, read as `of_group` reads a Completion. Legacy groups
  carried no per-token versions (`token_versions` reads as the sampling policy's: 0 here, which
  nothing downstream of a dequeued batch reads)."""

  def __init__(self, fields: dict, s: int, turn: dict | None):
    self.prompt_tokens = fields["prompt_tokens"]
    self.completion_ids = fields["completion_ids"][s]
    self.logprobs = fields["logprobs"][s]
    self.sampling_logprobs = (fields["sampling_logprobs"][s]
                              if fields.get("sampling_logprobs") is not None else None)
    self.truncated = fields["truncated"][s]
    self.loss_mask = (fields["loss_masks"][s] if fields.get("loss_masks") is not None
                      else None)
    experts = fields.get("experts")
    self.experts = array_from_json(experts[s]) if experts is not None else None
    self.turns = turn["turns"] if turn is not None else None
    self.episode_end = turn["episode_end"] if turn is not None else None
    self.reward_parts = turn["environment_parts"] if turn is not None else None
    self.token_versions, self.policy_version = None, 0
