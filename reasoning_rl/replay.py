"""Replay: re-score a past run's rollout records with today's verifiers (reward-version drift).

Reads `workdir/rollouts/step_XXXXXXXX.jsonl` (rollout records, docs/architecture.md §3.5), rebuilds each completion's
`CompletionRecord`, scores it with a `RewardFunction` built from a `rewards` config, and reports every
record whose total reward or any part changed, part by part, with the old and new
`verifier_version`.

Fields read from each record:
  format_version (`metrics.ROLLOUT_FORMAT_VERSION`; another version is refused with one line),
  completion, task_prompt (the prompt the verifiers saw), reward (the old total), reward/<part>
  (old unweighted parts), ground_truth, task, metadata, tests (empty but for code tasks),
  num_tokens, truncated, sampling.max_new_tokens, verifier_version, step, group_id (groups for
  group-level parts such as Kimi's length reward), prompt_id, sample_index.
A record that lacks a required field is refused with one line naming it (ConfigError).

The report this module returns (`ReplayReport.to_dict`, `launch/replay.py --output`) is for
people and CI to read; nothing reads it back, so it carries no format version.

A value counts as changed when |old − new| > abs_tol + rel_tol·|old| (default 1e-9 relative,
1e-12 absolute: JSON round-trips floats exactly, so only a real change exceeds it), or when a part
exists on one side only (a part added to or removed from the config).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

from reasoning_rl import storage
from reasoning_rl.errors import ConfigError, VerifierError
from reasoning_rl.metrics import ROLLOUT_FORMAT_VERSION, check_rollout_version
from reasoning_rl.verifiers.rewards import CompletionRecord, RewardFunction
from reasoning_rl.workers.model_parts import with_model_parts
from reasoning_rl.workers.scorer import InlineScorer

_ROLLOUT_NAME = re.compile(r"^step_(\d{8})\.jsonl$")
_REQUIRED = ("completion", "task_prompt", "reward", "ground_truth", "task", "metadata", "tests",
             "num_tokens", "truncated", "sampling", "step", "group_id", "prompt_id",
             "sample_index", "verifier_version")


@dataclasses.dataclass(frozen=True)
class ChangedRecord:
  """One rollout record whose reward differs under the current verifiers."""

  file: str
  line: int
  step: int
  prompt_id: int | None
  group_id: int | None
  sample_index: int | None
  old_total: float
  new_total: float
  parts: dict[str, list[float | None]]  # changed parts only: name -> [old, new] (None: absent)
  old_verifier_version: str | None


@dataclasses.dataclass
class ReplayReport:
  num_records: int
  new_verifier_version: str
  old_verifier_versions: list[str]
  changed: list[ChangedRecord]

  @property
  def changed_by_part(self) -> dict[str, int]:
    """How many records changed in each part ("total" counts changed totals)."""
    counts: dict[str, int] = {}
    for record in self.changed:
      if not _same(record.old_total, record.new_total):
        counts["total"] = counts.get("total", 0) + 1
      for name in record.parts:
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))

  def to_dict(self) -> dict[str, Any]:
    return {"num_records": self.num_records, "num_changed": len(self.changed),
            "new_verifier_version": self.new_verifier_version,
            "old_verifier_versions": self.old_verifier_versions,
            "changed_by_part": self.changed_by_part,
            "changed": [dataclasses.asdict(c) for c in self.changed]}

  def summary(self) -> str:
    lines = [f"{self.num_records} records re-scored; {len(self.changed)} changed.",
             f"old verifier_version: {', '.join(self.old_verifier_versions) or '(none recorded)'}",
             f"new verifier_version: {self.new_verifier_version}"]
    lines += [f"  {name}: {count} records" for name, count in self.changed_by_part.items()]
    for c in self.changed[:20]:
      parts = ", ".join(f"{n} {o} -> {w}" for n, (o, w) in c.parts.items())
      lines.append(f"  {c.file}:{c.line} step {c.step} prompt {c.prompt_id} sample "
                   f"{c.sample_index}: total {c.old_total} -> {c.new_total}"
                   + (f" ({parts})" if parts else ""))
    if len(self.changed) > 20:
      lines.append(f"  … and {len(self.changed) - 20} more (see the JSON output)")
    return "\n".join(lines)


def _same(old: float | None, new: float | None, rel_tol: float = 1e-9,
          abs_tol: float = 1e-12) -> bool:
  if old is None or new is None:
    return old is None and new is None
  if math.isnan(old) or math.isnan(new):
    return math.isnan(old) and math.isnan(new)
  return abs(old - new) <= abs_tol + rel_tol * abs(old)


def stored_completion_record(record: Mapping[str, Any], where: str) -> CompletionRecord:
  """The `CompletionRecord` a rollout record was scored from (ConfigError naming `where` for a
  record of another format version, or one that lacks a field replay needs)."""
  check_rollout_version(record, where)
  for field in _REQUIRED:
    if field not in record:
      raise ConfigError(f"{where}: rollout record lacks {field!r}; replay needs "
                        f"{', '.join(_REQUIRED)} (records of format_version "
                        f"{ROLLOUT_FORMAT_VERSION} hold them all)")
  sampling = record["sampling"]
  if not isinstance(sampling, Mapping) or "max_new_tokens" not in sampling:
    raise ConfigError(f"{where}: rollout record lacks 'sampling.max_new_tokens'")
  try:
    return CompletionRecord(
        response=record["completion"], ground_truth=str(record["ground_truth"]),
        task=record["task"], num_tokens=int(record["num_tokens"]),
        truncated=bool(record["truncated"]), max_new_tokens=sampling["max_new_tokens"],
        prompt=record["task_prompt"],  # the task's own prompt, as training scored it
        tests=tuple(record["tests"]), metadata=dict(record["metadata"]),
        # a multi-turn episode's outcome, as its environment reported it
        environment_parts=dict(record.get("environment_parts") or {}))
  except (TypeError, ValueError) as error:
    raise ConfigError(f"{where}: a field of the rollout record has the wrong type ({error})"
                      ) from None


def _read_records(rollouts_dir: pathlib.Path) -> list[tuple[str, int, dict[str, Any]]]:
  if not rollouts_dir.is_dir():
    raise ConfigError(f"{rollouts_dir} is not a directory; give the workdir of a run that logged "
                      "rollouts (config.logging.rollouts_every_steps > 0)")
  found = []
  for path in sorted(rollouts_dir.iterdir()):
    if not _ROLLOUT_NAME.match(path.name):
      continue
    with path.open("rb") as handle:
      for number, raw in enumerate(handle, start=1):
        where = f"rollouts/{path.name}:{number}"
        try:
          line = raw.decode("utf-8")
          record = json.loads(line) if line.strip() else None
        except ValueError as error:  # UnicodeDecodeError is one
          raise ConfigError(f"{where}: not a JSON line ({error}); a rollout file holds one JSON "
                            "object per line") from None
        if record is None:
          continue
        if not isinstance(record, dict):
          raise ConfigError(f"{where}: a {type(record).__name__}, not a rollout record (a JSON "
                            "object)")
        check_rollout_version(record, where)
        found.append((path.name, number, record))
  return found


def _old_parts(record: Mapping[str, Any]) -> dict[str, float]:
  return {key[len("reward/"):]: float(value) for key, value in record.items()
          if key.startswith("reward/") and isinstance(value, (int, float))}


def replay(workdir: str | os.PathLike[str], rewards_config: Any, *, rel_tol: float = 1e-9,
           abs_tol: float = 1e-12, scorer=None) -> ReplayReport:
  """Re-scores every rollout record under `workdir/rollouts` with `rewards_config`.

  `scorer` (a `workers.scorer.Scorer` of that reward, e.g. a verifier pool) scores the groups;
  by default they are scored inline. A group the scorer could not score raises VerifierError
  naming its records: a replay must not report fake zeros as changed rewards.
  """

  reward_fn = scorer.reward_fn if scorer is not None else RewardFunction(rewards_config)
  # model-scored parts (a judge) are added around the inline scorer; their models load here
  scorer = scorer if scorer is not None else with_model_parts(InlineScorer(reward_fn))
  entries = _read_records(storage.path(workdir) / "rollouts")
  # every record is checked (stored_completion_record) before anything is scored
  completions = [stored_completion_record(record, f"rollouts/{name}:{line}")
                 for name, line, record in entries]
  groups: dict[tuple, list[int]] = {}
  for index, (name, _, record) in enumerate(entries):
    key = (name, record["step"], record["group_id"]) if reward_fn.needs_group else (index,)
    groups.setdefault(key, []).append(index)
  scored = scorer.score((key, [completions[i] for i in members])
                        for key, members in groups.items())
  new_rewards: list = [None] * len(entries)
  for key, members in groups.items():
    item = scored[key]
    if item.status != "ok":
      name, line, _ = entries[members[0]]
      raise VerifierError(f"rollouts/{name}:{line}: re-scoring failed ({item.status}): "
                          f"{item.error.splitlines()[0] if item.error else 'no detail'}")
    for i, reward in zip(members, item.rewards):
      new_rewards[i] = reward

  changed = []
  for (name, line, record), reward in zip(entries, new_rewards):
    old_parts = _old_parts(record)
    parts = {part: [old_parts.get(part), reward.parts.get(part)]
             for part in sorted(set(old_parts) | set(reward.parts))
             if not _same(old_parts.get(part), reward.parts.get(part), rel_tol, abs_tol)}
    old_total = float(record["reward"])
    if parts or not _same(old_total, reward.total, rel_tol, abs_tol):
      changed.append(ChangedRecord(
          file=name, line=line, step=int(record["step"]), prompt_id=record["prompt_id"],
          group_id=record["group_id"], sample_index=record["sample_index"],
          old_total=old_total, new_total=reward.total, parts=parts,
          old_verifier_version=record["verifier_version"]))
  old_versions = sorted({str(r["verifier_version"]) for _, _, r in entries
                         if r["verifier_version"] is not None})
  return ReplayReport(num_records=len(entries), new_verifier_version=reward_fn.verifier_version,
                      old_verifier_versions=old_versions, changed=changed)
