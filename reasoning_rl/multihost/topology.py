"""Which devices train, which sample, and which process does what.

Devices are taken in process-major order (all of process 0's, then process 1's, ...), so "the first
K devices" of `mesh.num_trainer_devices=K` are whole hosts on a TPU slice.

- Colocated (`num_trainer_devices` = 0): every device trains; every process also samples on its own
  devices (one sampler replica per process).
- Split (K > 0): the first K devices train, the rest sample. With one process this is today's
  single-host split (one replica over all sampler devices). With several processes the split must
  fall between processes: trainer processes run the train step (one SPMD program over the trainer
  mesh), sampler processes decode, each its own replica on its local devices, independent of the
  other replicas (no collective couples them, so one slow replica never stalls another's decode).

Each replica receives the policy device to device from the trainer mesh (`param_sync`), which needs
the replica's device count to divide the trainer's.

Several slices (`sharding.device_slice_ids`): the trainer takes part of one slice or whole slices,
and its mesh stacks them along `data` (`trainer_num_slices`); a sampler replica is one process's
devices, so it never spans slices.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from reasoning_rl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Topology:
  """Roles of the devices and processes of a run.

  process_index / num_processes: this process and the run's process count.
  trainer_devices: the devices of the trainer mesh (process-major order).
  replicas: one tuple of devices per sampler replica, ordered by process.
  """

  process_index: int
  num_processes: int
  trainer_devices: tuple
  replicas: tuple[tuple, ...]
  trainer_num_slices: int = 1

  @property
  def multi_process(self) -> bool:
    return self.num_processes > 1

  @property
  def trainer_processes(self) -> tuple[int, ...]:
    return tuple(sorted({d.process_index for d in self.trainer_devices}))

  @property
  def is_trainer(self) -> bool:
    return self.process_index in self.trainer_processes

  @property
  def replica_processes(self) -> tuple[int, ...]:
    """The process that runs each replica (a replica never spans processes when there are
    several; with one process, its single replica is process 0's)."""
    return tuple(replica[0].process_index for replica in self.replicas)

  @property
  def replica_index(self) -> int | None:
    """This process's replica, or None on a trainer-only process."""
    processes = self.replica_processes
    return processes.index(self.process_index) if self.process_index in processes else None

  @property
  def is_sampler(self) -> bool:
    return self.replica_index is not None

  @property
  def local_replica_devices(self) -> tuple | None:
    index = self.replica_index
    return None if index is None else self.replicas[index]

  def describe(self) -> str:
    trainers = ",".join(map(str, self.trainer_processes))
    samplers = ",".join(map(str, self.replica_processes))
    slices = f" on {self.trainer_num_slices} slices" if self.trainer_num_slices > 1 else ""
    return (f"{self.num_processes} processes: trainer mesh of {len(self.trainer_devices)} devices"
            f"{slices} on process(es) {trainers}; {len(self.replicas)} sampler replica(s) of "
            f"{len(self.replicas[0])} devices on process(es) {samplers}")


def process_major(devices: Sequence) -> list:
  return sorted(devices, key=lambda d: (d.process_index, d.id))


def make_topology(num_trainer_devices: int, devices: Sequence, *, process_index: int,
                  num_processes: int, num_slices: int = 0,
                  field: str = "config.mesh.num_trainer_devices") -> Topology:
  """The roles for `devices` (all of the run's devices) on `num_slices` slices (0: as the devices
  say, see `sharding.device_slice_ids`); ConfigError names `field`."""
  from reasoning_rl import sharding  # pylint: disable=import-outside-toplevel

  devices = process_major(devices)
  topology = _roles(num_trainer_devices, devices, process_index=process_index,
                    num_processes=num_processes, field=field)
  trainer_slices = sharding.slices_spanned(len(topology.trainer_devices), len(devices),
                                           sharding.count_slices(devices, num_slices),
                                           field=field)
  return dataclasses.replace(topology, trainer_num_slices=trainer_slices)


def _roles(num_trainer_devices: int, devices: list, *, process_index: int, num_processes: int,
           field: str) -> Topology:
  from reasoning_rl import sharding  # pylint: disable=import-outside-toplevel

  if num_processes == 1:
    if num_trainer_devices == 0:
      trainer = sampler = devices
    else:
      trainer, sampler = sharding.split_devices(num_trainer_devices, devices, field=field)
    return Topology(process_index, 1, tuple(trainer), (tuple(sampler),))
  by_process: dict[int, list] = {}
  for device in devices:
    by_process.setdefault(device.process_index, []).append(device)
  if num_trainer_devices == 0:
    replicas = tuple(tuple(by_process[p]) for p in sorted(by_process))
    return Topology(process_index, num_processes, tuple(devices), replicas)
  trainer, sampler = sharding.split_devices(num_trainer_devices, devices, field=field)
  split = {d.process_index for d in trainer} & {d.process_index for d in sampler}
  if split:
    local = len(by_process[min(split)])
    raise ConfigError(
        f"{field}={num_trainer_devices}: splits the devices of process {min(split)} between the "
        f"trainer and the sampler; with several processes the split must fall between processes: "
        f"use a multiple of the {local} devices per process (or 0 to colocate)")
  if len({d.process_index for d in trainer}) == 1:
    # Orbax refuses to checkpoint arrays that live on one process of a multi-process run
    raise ConfigError(
        f"{field}={num_trainer_devices}: the trainer slice lies on one process of "
        f"{num_processes}; its checkpoints need it to span at least two processes (use "
        f"{2 * len(by_process[0])} or more) or colocate (0)")
  sampler_processes = sorted({d.process_index for d in sampler})
  replicas = tuple(tuple(by_process[p]) for p in sampler_processes)
  return Topology(process_index, num_processes, tuple(trainer), replicas)


def check_sync_shapes(topology: Topology, *, field: str = "config.mesh.num_trainer_devices"):
  """Replicas all of one size that divides the trainer's (the weight sync's layout needs it)."""
  sizes = {len(r) for r in topology.replicas}
  if len(sizes) > 1:
    raise ConfigError(f"{field}: sampler processes have different device counts {sorted(sizes)}; "
                      "every sampler host must have the same number of devices")
  size, trainers = sizes.pop(), len(topology.trainer_devices)
  if trainers % size:
    raise ConfigError(
        f"{field}: a sampler replica has {size} devices, which does not divide the "
        f"{trainers} trainer devices; the weight sync sends each replica its shards from "
        f"{size}-device groups of the trainer mesh, so choose a trainer device count that is a "
        f"multiple of {size}")
