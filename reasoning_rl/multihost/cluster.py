"""What the training loop needs to know about the other processes: one object, the same interface
in single-process runs (where every call is a no-op or a local call) and multi-process ones."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from reasoning_rl.errors import PhaseInterrupted
from reasoning_rl.multihost import runtime
from reasoning_rl.multihost.exchange import Exchange, LocalExchange
from reasoning_rl.multihost.sync_watch import SyncWatch
from reasoning_rl.multihost.topology import Topology


_INTERRUPTED = "interrupted"  # an evaluation result's key when a stop request cut it short
_EVAL_RECORDS = ("examples", "canaries")  # the bulk of an evaluation result
_RECORDS_FILE = "records_file"  # the bulk file's descriptor in the broadcast result


@dataclasses.dataclass
class Cluster:
  """The run's topology, its host-side exchange and (multi-process) the weight sync.

  The loop calls every method on every process, in the same order; what each process does inside
  depends on its role (trainer, sampler replica, or both).
  """

  topology: Topology
  exchange: LocalExchange | Exchange
  param_sync: Any = None  # multihost.param_sync.ParamSync; None in single-process runs
  syncs: int = 0  # weight syncs so far (the same count on every process)
  bulk: Any = None  # multihost.bulk.BulkChannel (multi-process; the trainer attaches it)

  @property
  def multi_process(self) -> bool:
    return self.topology.multi_process

  @property
  def is_trainer(self) -> bool:
    return self.topology.is_trainer

  @property
  def is_sampler(self) -> bool:
    return self.topology.is_sampler

  @property
  def is_primary(self) -> bool:
    """Process 0: the one that writes the run's files (it is always a trainer process)."""
    return self.topology.process_index == 0

  @property
  def evaluator_process(self) -> int:
    """The process whose replica runs evaluations (its result is broadcast to all)."""
    return self.topology.replica_processes[0]

  def sync_params(self, backend, params, *, version: int, adapters_only: bool = False) -> None:
    """Publishes the trainer's `params` as policy `version` to every sampler replica's rollout
    backend (`sampler.api.RolloutBackend.update_weights`; None on a process that only
    trains); returns when this process's replica holds them (so `time/sync_s` is the copy, not
    its dispatch) and every other process finished its part. `adapters_only`: `params` are LoRA
    adapters alone (`loop.weight_sync.WeightSync` decides). Multi-process: the trainers pack the
    parameters, the processes start the transfers together (a sampler arrives while the trainers
    still train), and these run under a deadline (`param_sync.ParamSync.deadline_s`); past it
    every process stops with exit code 5 naming the sync and the process(es) it waited for
    (`sync_watch.py`)."""
    if self.param_sync is None:
      if backend is not None:
        backend.update_weights(params, version=version, adapters_only=adapters_only)
      return

    sync, me = self.param_sync, self.topology.process_index
    packed = sync.pack(params) if self.is_trainer else None  # trainer-side compute: no deadline
    self.syncs += 1
    self.exchange.gather("sync_start", None)
    watch = SyncWatch(client=runtime.coordination_client(), number=self.syncs, version=version,
                      deadline_s=sync.deadline_s, deadline_text=sync.describe_deadline(),
                      process_index=me, num_processes=self.topology.num_processes,
                      peers=sync.peers(me))
    try:
      watch.stall_if_asked()
      local = sync.send(packed=packed)
      if backend is not None:
        backend.update_weights(local, version=version, adapters_only=adapters_only)
    except BaseException:
      watch.cancel()
      raise
    watch.confirm()

  def evaluate(self, run_evaluation) -> dict:
    """`run_evaluation()` on the evaluator process; every process gets its result, or every
    process raises PhaseInterrupted when a stop request interrupted it.

    Only process 0 (which writes the evaluation file) gets the per-example records and canary
    completions (`_EVAL_RECORDS`): through a bulk file when another process evaluated. The
    others get the rest, which is what guards and the progress bar read."""
    result, me = None, self.topology.process_index
    source = self.evaluator_process
    if me == source:
      try:
        result = run_evaluation()
      except PhaseInterrupted as error:
        result = {_INTERRUPTED: str(error)}
      if source != 0 and self.multi_process:
        records = {k: result.pop(k) for k in _EVAL_RECORDS if k in result}
        if records:
          result[_RECORDS_FILE] = self.bulk.put("eval", records)
    result = self.exchange.broadcast("eval", result, source=source)
    if _INTERRUPTED in result:
      raise PhaseInterrupted(result[_INTERRUPTED])
    descriptor = result.pop(_RECORDS_FILE, None)
    if descriptor is not None and self.is_primary:
      result.update(self.bulk.get("eval", descriptor))
    return result

  def summed_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
    """Per-process counters (e.g. the verifier pool's) summed over processes."""
    if not self.multi_process:
      return metrics
    parts = self.exchange.gather("counters", {k: float(v) for k, v in metrics.items()})
    return {k: float(sum(p.get(k, 0.0) for p in parts)) for k in parts[0]}


def global_batch(batch: dict[str, np.ndarray], mesh) -> dict:
  """A host batch (identical on every trainer process) as global arrays on the trainer mesh, each
  process supplying only the rows its devices hold."""
  import jax  # pylint: disable=import-outside-toplevel

  from reasoning_rl import sharding as sharding_lib  # pylint: disable=import-outside-toplevel

  def one(array):
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape,
                                        sharding_lib.batch_sharding(mesh, array.ndim),
                                        lambda index: array[index])

  return {name: one(value) for name, value in batch.items()}


def local_cluster(topology: Topology | None = None) -> Cluster:
  """The single-process cluster (default topology: every local device trains and samples)."""
  if topology is None:
    import jax  # pylint: disable=import-outside-toplevel

    devices = tuple(jax.local_devices())
    topology = Topology(process_index=0, num_processes=1, trainer_devices=devices,
                        replicas=(devices,))
  return Cluster(topology=topology, exchange=LocalExchange())
