"""Inference split over the processes of a run: each process generates for its share of the
prompts on its own devices, and the results meet on every process (`launch/evaluate.py`,
`launch/generate.py`).

Prompt i belongs to process i mod N. A completion's random stream depends only on (seed, prompt
id, sample index) (reasoning_rl.sampler.rollout), so the merged results equal those of one process
generating everything. Results travel as JSON through the run's `Exchange` (the coordination
service's key-value store), so no shared file system is needed; process 0 writes the output.
"""

from __future__ import annotations

import dataclasses
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
    merged: dict[int, Any] = {}
    for part in self.exchange.gather(name, {str(k): v for k, v in results.items()}):
      merged.update({int(k): v for k, v in part.items()})
    return dict(sorted(merged.items()))


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
