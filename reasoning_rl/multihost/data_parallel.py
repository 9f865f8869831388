"""Inference split over the processes of a run: each process generates for its share of the
prompts on its own devices, and the results meet on every process (`launch/evaluate.py`,
`launch/generate.py`).

Prompt i belongs to process i mod N. A completion's random stream depends only on (seed, prompt
id, sample index) (reasoning_rl.sampler.rollout), so the merged results equal those of one process
generating everything. Results travel as JSON through the run's `Exchange` (the coordination
service's key-value store), so no shared file system is needed; process 0 writes the output.
The store takes small values only (`exchange.MAX_VALUE_BYTES`), so each process sends its results
in pieces under that size, one gather per piece: these one-off tools have no workdir to put a
file in, and no training step waits on them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from reasoning_rl.multihost.exchange import Exchange, LocalExchange


@dataclasses.dataclass
class Share:
  """This process's part of a job split over `count` processes."""

  index: int = 0
  count: int = 1
  exchange: LocalExchange = dataclasses.field(default_factory=LocalExchange)

  @property
  def is_primary(self) -> bool:
    return self.index == 0

  def mine(self, ids: Sequence[int]) -> list[int]:
    """The ids (in order) this process works on: every count-th one, from its index."""
    return [i for position, i in enumerate(ids) if position % self.count == self.index]

  def merge(self, name: str, results: Mapping[int, Any]) -> dict[int, Any]:
    """Every process's {id: result}, merged and ordered by id, on every process."""
    limit = getattr(self.exchange, "max_value_bytes", None)
    pieces = [{str(k): v for k, v in results.items()}] if limit is None else _pieces(results,
                                                                                     limit // 2)
    # every process makes the same number of gathers: the most pieces any process has
    rounds = max(self.exchange.gather(f"{name}/pieces", len(pieces)))
    merged: dict[int, Any] = {}
    for round_index in range(rounds):
      mine = pieces[round_index] if round_index < len(pieces) else {}
      for part in self.exchange.gather(f"{name}/{round_index}", mine):
        merged.update({int(k): v for k, v in part.items()})
    return dict(sorted(merged.items()))


def _pieces(results: Mapping[int, Any], max_json_bytes: int) -> list[dict[str, Any]]:
  """`results` as {str(id): result} dicts of at most `max_json_bytes` of JSON each (zlib never
  grows JSON by more than a few bytes, so each piece fits the store compressed); one result
  larger than that is a piece of its own, which the store then refuses by name."""
  pieces, current, size = [], {}, 0
  for key, value in results.items():
    item = len(json.dumps({str(key): value}, default=str).encode())
    if current and size + item > max_json_bytes:
      pieces.append(current)
      current, size = {}, 0
    current[str(key)] = value
    size += item
  return pieces + [current] if current or not pieces else pieces


def current_share() -> Share:
  """The share of this process in the current JAX run (the whole job in a single process)."""
  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() == 1:
    return Share()
  return Share(index=jax.process_index(), count=jax.process_count(), exchange=Exchange())


def local_mesh(shape: Sequence[int] = (1, 1, -1), *, field: str = "config.mesh.sampler"):
  """A (data, fsdp, tensor) mesh over this process's own devices (None in a single process:
  models and engines then use the default device, as before)."""
  import jax  # pylint: disable=import-outside-toplevel

  from reasoning_rl import sharding  # pylint: disable=import-outside-toplevel

  if jax.process_count() == 1:
    return None
  return sharding.make_mesh(tuple(shape), jax.local_devices(), field=field)
