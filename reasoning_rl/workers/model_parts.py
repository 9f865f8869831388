"""Model-scored reward parts: a `Scorer` that adds, on the main process, the parts a model scores
(e.g. `judge`, an LLM judge) to the rule-based rewards of an inner scorer.

Why a wrapper: rule-based parts run in verifier worker processes (`PoolScorer`) or inline, from a
picklable `RewardFunction`; a model cannot run there. `RewardFunction.score_group` therefore skips
model-scored parts (they are absent from its `Reward.parts` and add nothing to `total`), and
`ModelPartsScorer` fills them in.

When: `submit` hands each group to the inner scorer at once. `get()` returns a group whose model
parts are already filled in if there is one; otherwise it waits for *every* group outstanding in
the inner scorer and scores the model parts in ONE batch over all their records. Training submits
every group of a step before its first `get()` (`loop.rollouts`), evaluation and replay submit
everything before they read (`Scorer.score`), so a batch is a whole step's completions.

The seam's contract, for a new kind of model-scored part (e.g. a reward model):
  - register a `rewards.PartKind` whose `make_scorer(settings, mesh=None)` returns a part scorer;
    its `score` is never called (pass one that raises);
  - a part scorer has `score_batch(records, rule_rewards) -> list[float]`: `records` are the
    `CompletionRecord`s of the batch (several groups, concatenated in delivery order),
    `rule_rewards` the matching rule-based `Reward`s (parts of the rule parts only); it returns one
    unweighted value per record and may batch, cache and decode as it likes. `mesh` is where its
    model should sit (the sampler's devices, colocated; None: the default device);
  - optionally `metrics() -> dict[str, float]` (cumulative counters: they are logged under
    `verifier/pool/<part name>/<key>`) and `close()`.
  The totals are recomputed as Σ weight · value over all parts. A part scorer that raises turns
  every group of its batch into status "error" with zero rewards (the `Scorer` contract); groups the
  inner scorer could not score ("timeout" / "error") keep their zero rewards and are not sent to
  model parts.
"""

from __future__ import annotations

import collections
import time
import traceback
from collections.abc import Hashable, Mapping
from typing import Any

from reasoning_rl.verifiers.rewards import CompletionRecord, Reward, RewardFunction
from reasoning_rl.workers.scorer import ScoredItem, Scorer, zero_rewards


class ModelPartsScorer(Scorer):
  """`inner` scores the rule-based parts; `part_scorers` (part name -> part scorer, see the module
  docstring) score the model-scored parts of `inner.reward_fn`."""

  def __init__(self, inner: Scorer, part_scorers: Mapping[str, Any]):
    super().__init__(inner.reward_fn)
    missing = sorted({p.name for p in inner.reward_fn.model_parts} - set(part_scorers))
    if missing:
      raise ValueError(f"ModelPartsScorer: no part scorer for model-scored parts {missing}")
    self.inner = inner
    self.part_scorers = dict(part_scorers)
    self._records: dict[Hashable, list[CompletionRecord]] = {}
    self._drained: list[ScoredItem] = []  # from inner, waiting for the model parts
    self._ready: collections.deque[ScoredItem] = collections.deque()
    self._batches = 0
    self._batch_records = 0
    self._seconds = 0.0

  def submit(self, key: Hashable, records: list[CompletionRecord]) -> None:
    self._register(key, records)
    try:
      self.inner.submit(key, list(records))
    except BaseException:
      del self._sizes[key]
      raise
    self._records[key] = list(records)

  def _next(self, timeout: float | None) -> ScoredItem | None:
    if not self._ready:
      while len(self._drained) < len(self._records):  # everything outstanding in inner
        self._drained.append(self.inner.get(timeout))
      self._ready.extend(self._score_model_parts(self._drained))
      self._drained = []
    return self._ready.popleft() if self._ready else None

  def _score_model_parts(self, items: list[ScoredItem]) -> list[ScoredItem]:
    """The items with their model-scored parts filled in and totals recomputed."""
    start = time.perf_counter()
    groups = [(item, self._records.pop(item.key)) for item in items]
    ok = [(item, records) for item, records in groups if item.status == "ok"]
    records = [r for _, group in ok for r in group]
    rule_rewards = [r for item, _ in ok for r in item.rewards]
    values: dict[str, list[float]] = {}
    try:
      for part in self.reward_fn.model_parts:
        values[part.name] = [float(v) for v in
                             self.part_scorers[part.name].score_batch(records, rule_rewards)]
        if len(values[part.name]) != len(records):
          raise ValueError(f"part {part.name!r}: score_batch returned {len(values[part.name])} "
                           f"values for {len(records)} records")
    except Exception as error:  # pylint: disable=broad-except  # the Scorer contract: a status
      detail = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=5)}"
      out = [item if item.status != "ok" else
             ScoredItem(item.key, zero_rewards(self.reward_fn, len(group)), "error", detail)
             for item, group in groups]
      self._seconds += time.perf_counter() - start
      return out
    out, offset = [], 0
    for item, group in groups:
      if item.status != "ok":
        out.append(item)
        continue
      rewards = []
      for reward in item.rewards:
        parts = dict(reward.parts)
        parts.update({name: v[offset] for name, v in values.items()})
        offset += 1
        total = sum(p.weight * parts[p.name] for p in self.reward_fn.parts)
        rewards.append(Reward(total=float(total), parts=parts,
                              verifier_version=reward.verifier_version))
      out.append(ScoredItem(item.key, rewards, "ok", item.error))
    self._batches += 1
    self._batch_records += len(records)
    self._seconds += time.perf_counter() - start
    return out

  def metrics(self) -> dict[str, float]:
    """The inner scorer's, plus model_parts/{batches, records, seconds} and each part scorer's
    counters under `<part name>/<key>` (cumulative)."""
    out = dict(self.inner.metrics())
    out.update({"model_parts/batches": float(self._batches),
                "model_parts/records": float(self._batch_records),
                "model_parts/seconds": self._seconds})
    for name, scorer in self.part_scorers.items():
      if hasattr(scorer, "metrics"):
        out.update({f"{name}/{k}": float(v) for k, v in scorer.metrics().items()})
    return out

  def close(self) -> None:
    self.inner.close()
    for scorer in self.part_scorers.values():
      if hasattr(scorer, "close"):
        scorer.close()


def with_model_parts(inner: Scorer, *, mesh=None,
                     part_scorers: Mapping[str, Any] | None = None) -> Scorer:
  """`inner` itself when its reward has no model-scored part; else a `ModelPartsScorer` whose part
  scorers come from `part_scorers` (by part name; tests pass fakes) or are made by each part's
  `make_scorer(settings, mesh=mesh)` (the judge loads its model here)."""
  reward_fn: RewardFunction = inner.reward_fn
  if not reward_fn.model_parts:
    return inner
  given = dict(part_scorers or {})
  try:
    for part in reward_fn.model_parts:
      if part.name not in given:
        given[part.name] = part.behaviour.make_scorer(part.settings, mesh=mesh)
  except BaseException:
    inner.close()
    raise
  return ModelPartsScorer(inner, given)
