"""One way to score completions: `Scorer`, in this process (`InlineScorer`) or in a verifier pool.

Training, held-out evaluation and replay all score through this interface, so a
verifier that raises or hangs is handled the same everywhere: the group gets zero rewards and a
status — "timeout" (it ran past its deadline) or "error" (it raised, or killed its worker) —
counted apart from "ok" (`counts()`), never a crash of the caller and never a silent zero.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import traceback
from typing import Hashable, Iterable

from reasoning_rl.errors import ConfigError, VerifierError
from reasoning_rl.verifiers.rewards import CompletionRecord, Reward, RewardFunction
from reasoning_rl.workers.pool import VerifierPool

STATUSES = ("ok", "timeout", "error")


@dataclasses.dataclass(frozen=True)
class ScoredItem:
  """The rewards of one submitted group (one per record) and how scoring went."""

  key: Hashable
  rewards: list[Reward]
  status: str  # ok | timeout | error
  error: str = ""


def zero_rewards(reward_fn: RewardFunction, count: int) -> list[Reward]:
  """What a group that could not be scored gets: every part 0."""
  parts = {part.name: 0.0 for part in reward_fn.parts}
  return [Reward(total=0.0, parts=dict(parts), verifier_version=reward_fn.verifier_version)
          for _ in range(count)]


class GroupScorer:
  """Picklable pool job: one group's records -> their rewards (group-level parts allowed)."""

  def __init__(self, reward_fn: RewardFunction):
    self.reward_fn = reward_fn

  def __call__(self, records: list[CompletionRecord]) -> list[Reward]:
    return self.reward_fn.score_group(records)


class Scorer(abc.ABC):
  """submit groups as they are ready, `get()` them as they finish; or `score()` a whole set."""

  def __init__(self, reward_fn: RewardFunction):
    self.reward_fn = reward_fn
    self._counts = collections.Counter({status: 0 for status in STATUSES})
    self._sizes: dict[Hashable, int] = {}

  @abc.abstractmethod
  def submit(self, key: Hashable, records: list[CompletionRecord]) -> None:
    """Queues one group; `key` must not be outstanding."""

  @abc.abstractmethod
  def _next(self, timeout: float | None) -> ScoredItem | None:
    """The next finished item, or None when none finished within `timeout`."""

  def get(self, timeout: float | None = None) -> ScoredItem:
    """The next finished group, in finishing order.

    Raises:
      VerifierError: nothing is outstanding, the pool can no longer deliver, or `timeout` passed.
    """
    if not self._sizes:
      raise VerifierError("Scorer.get: nothing is outstanding (submit a group first)")
    item = self._next(timeout)
    if item is None:
      raise VerifierError(f"Scorer.get: no group finished within {timeout} s")
    del self._sizes[item.key]
    self._counts[item.status] += 1
    return item

  def score(self, items: Iterable[tuple[Hashable, list[CompletionRecord]]]
            ) -> dict[Hashable, ScoredItem]:
    """Submits every (key, records) group and waits for all of them."""
    keys = []
    for key, records in items:
      self.submit(key, records)
      keys.append(key)
    out = {}
    while len(out) < len(keys):
      item = self.get()
      out[item.key] = item
    return out

  def counts(self) -> dict[str, int]:
    """Groups delivered so far, by status."""
    return dict(self._counts)

  def metrics(self) -> dict[str, float]:
    """Throughput and latency of the worker processes ({} when scoring inline)."""
    return {}

  def close(self) -> None:
    """Releases workers; idempotent."""

  def __enter__(self) -> "Scorer":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _register(self, key: Hashable, records: list[CompletionRecord]) -> None:
    if key in self._sizes:
      raise ValueError(f"Scorer.submit: key {key!r} is already outstanding")
    self._sizes[key] = len(records)


class InlineScorer(Scorer):
  """Scores each group in the calling process when it is submitted."""

  def __init__(self, reward_fn: RewardFunction):
    super().__init__(reward_fn)
    self._done: collections.deque[ScoredItem] = collections.deque()

  def submit(self, key: Hashable, records: list[CompletionRecord]) -> None:
    self._register(key, records)
    try:
      item = ScoredItem(key, self.reward_fn.score_group(list(records)), "ok")
    except Exception as error:  # pylint: disable=broad-except  # a verifier bug: see module doc
      item = ScoredItem(key, zero_rewards(self.reward_fn, len(records)), "error",
                        f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=5)}")
    self._done.append(item)

  def _next(self, timeout: float | None) -> ScoredItem | None:
    return self._done.popleft() if self._done else None


class PoolScorer(Scorer):
  """Scores groups in `num_workers` worker processes, each group under `item_timeout_s`."""

  def __init__(self, reward_fn: RewardFunction, *, num_workers: int, item_timeout_s: float):

    super().__init__(reward_fn)
    self._pool = VerifierPool(GroupScorer(reward_fn), num_workers=num_workers,
                              item_timeout_s=item_timeout_s, fallback=None)

  def submit(self, key: Hashable, records: list[CompletionRecord]) -> None:
    self._register(key, records)
    try:
      self._pool.submit(key, list(records))
    except BaseException:
      del self._sizes[key]  # not taken: it must not count as outstanding
      raise

  def _next(self, timeout: float | None) -> ScoredItem | None:
    result = self._pool.get(timeout=timeout)  # raises VerifierError if its dispatcher died
    if result is None:
      return None
    size = self._sizes[result.item_id]
    if result.status == "ok":
      return ScoredItem(result.item_id, result.value, "ok")
    status = "timeout" if result.status == "timeout" else "error"
    return ScoredItem(result.item_id, zero_rewards(self.reward_fn, size), status, result.error)

  def metrics(self) -> dict[str, float]:
    return self._pool.metrics()

  def close(self) -> None:
    self._pool.close()


def make_scorer(reward_fn: RewardFunction, *, num_workers: int, item_timeout_s: float) -> Scorer:
  """`InlineScorer` for 0 workers, else a `PoolScorer`; arguments as `verifier.*` in the config."""
  if type(num_workers) is not int or num_workers < 0:
    raise ConfigError(f"verifier.num_workers must be an int >= 0 (0 scores in this process), got "
                      f"{num_workers!r}")
  if not isinstance(item_timeout_s, (int, float)) or item_timeout_s <= 0:
    raise ConfigError(f"verifier.item_timeout_s must be a number of seconds > 0, got "
                      f"{item_timeout_s!r}")
  if num_workers == 0:
    return InlineScorer(reward_fn)
  return PoolScorer(reward_fn, num_workers=num_workers, item_timeout_s=item_timeout_s)
