"""Trainer mesh → sampler replicas, device to device, across processes, in a few large buffers.

JAX moves an array between processes only when source and destination shardings have the same
layout over the same number of devices. A sampler replica (S devices, its own mesh and partition
rules) and the trainer mesh (T devices) differ, so the sync goes in three moves:

1. On the trainer mesh (one jit, trainer processes only): cast every leaf to the sampler's dtype
   (only sampler-dtype bytes cross hosts), lay it out as the replicas want it on a "send mesh" =
   the trainer devices arranged as (T/S copies) × (replica mesh shape), and pack: each device
   concatenates its raveled shards, grouped by dtype, into buckets of at most `bucket_bytes`.
   Device j of copy c then holds exactly the buckets that device j of a replica needs.
2. `jax.device_put` of single-device buckets: copy c's device j → replica r's device j, with
   c = the copy on replica r's own process when there is one (colocated runs: the move stays on
   the host) and r mod (T/S) otherwise (split runs: replicas pull from different copies, which
   spreads the traffic). One call per (sending, receiving) process pair, made by every process in
   the same order; the side that does not hold a bucket passes a data-less placeholder for it.
3. On each replica (one jit): slice and reshape the buckets back into the parameter shards.

Why buckets: a model has hundreds of leaves, many tiny (a 1×128 bias), and one transfer per leaf
and device pair means thousands of small cross-host transfers per sync, the kind JAX's own
multi-process tests report as unreliable on TPU. Buckets make it a few large ones.

Values are bit-identical to `params.astype(sampler dtype)`. Requires S to divide T
(`topology.check_sync_shapes`).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from reasoning_rl import sharding as sharding_lib

log = logging.getLogger("reasoning_rl")

BUCKET_BYTES = 256 << 20
BUCKET_BYTES_ENV = "REASONING_RL_SYNC_BUCKET_BYTES"  # 0: one bucket per leaf (benchmarks)
# The sync's deadline: floor + bytes moved / bandwidth floor (docs/multihost.md, "Weight sync").
DEADLINE_FLOOR_S = 60.0
DEADLINE_BYTES_PER_S = 100e6
FLOOR_ENV = "REASONING_RL_SYNC_DEADLINE_FLOOR_S"
BYTES_PER_S_ENV = "REASONING_RL_SYNC_DEADLINE_BYTES_PER_S"


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where one leaf's shard lies in a bucket: elements offset .. offset + prod(shape)."""

  leaf: int
  offset: int
  shape: tuple[int, ...]

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class Bucket:
  """One flat buffer of one dtype holding the shards of several leaves, in leaf order."""

  dtype: np.dtype
  slots: tuple[Slot, ...]

  @property
  def size(self) -> int:
    return sum(slot.size for slot in self.slots)

  @property
  def nbytes(self) -> int:
    return self.size * np.dtype(self.dtype).itemsize


def plan_buckets(shards: list[jax.ShapeDtypeStruct], bucket_bytes: int = BUCKET_BYTES
                 ) -> list[Bucket]:
  """Groups the per-device shards (one per leaf) by dtype, in leaf order, into buckets of at most
  `bucket_bytes` (a shard larger than that gets a bucket of its own)."""
  by_dtype: dict[np.dtype, list[list[Slot]]] = {}
  for leaf, shard in enumerate(shards):
    dtype = np.dtype(shard.dtype)
    open_buckets = by_dtype.setdefault(dtype, [[]])
    current = open_buckets[-1]
    used = sum(s.size for s in current) * dtype.itemsize
    size = int(np.prod(shard.shape, dtype=np.int64))
    if current and used + size * dtype.itemsize > bucket_bytes:
      current = []
      open_buckets.append(current)
      used = 0
    current.append(Slot(leaf, used // dtype.itemsize, tuple(shard.shape)))
  return [Bucket(dtype, tuple(slots)) for dtype, groups in by_dtype.items() for slots in groups]


def pack(shards, buckets: list[Bucket]) -> list[jax.Array]:
  """The shards (one per leaf) as flat buckets (traceable: runs inside the sending jit)."""
  return [jnp.concatenate([shards[slot.leaf].astype(bucket.dtype).reshape(-1)
                           for slot in bucket.slots]) for bucket in buckets]


def unpack(flats, buckets: list[Bucket]) -> list[jax.Array]:
  """The shards again, in leaf order, from `pack`'s buckets (traceable)."""
  shards = {}
  for flat, bucket in zip(flats, buckets):
    for slot in bucket.slots:
      shards[slot.leaf] = flat[slot.offset:slot.offset + slot.size].reshape(slot.shape)
  return [shards[leaf] for leaf in range(len(shards))]


class ParamSync:
  """Sends the trainer's parameters to every sampler replica; `send` returns this process's copy.

  Args:
    abstract_params: the policy's nnx.State as the *sampler* holds it (arrays or
      ShapeDtypeStructs with logical axes): its dtypes are what the replicas receive, the
      trainer's leaves are cast to them before they leave the trainer mesh.
    topology: the run's `multihost.topology.Topology`.
    replica_meshes: one mesh per replica (same shape for all), in `topology.replicas` order.
    bucket_bytes: the largest buffer one transfer carries (a larger shard travels alone);
      default: the environment variable BUCKET_BYTES_ENV, else 256 MiB.
    deadline_floor_s, deadline_bytes_per_s: the sync's deadline is floor + bytes / rate
      (defaults: the environment variables FLOOR_ENV and BYTES_PER_S_ENV, else 60 s and 100 MB/s).
  """

  def __init__(self, abstract_params, topology, replica_meshes, *, bucket_bytes=None,
               deadline_floor_s=None, deadline_bytes_per_s=None):
    if bucket_bytes is None:
      bucket_bytes = int(float(os.environ.get(BUCKET_BYTES_ENV, BUCKET_BYTES)))
    self.topology = topology
    self.replica_meshes = list(replica_meshes)
    self._treedef = jax.tree.structure(abstract_params)
    self._avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(abstract_params)]
    self._replica_shardings = [jax.tree.leaves(sharding_lib.param_shardings(abstract_params, m))
                               for m in self.replica_meshes]
    if any(len(s) != len(self._avals) for s in self._replica_shardings):
      raise ValueError("parameter tree and its shardings differ in leaf count")
    first = self.replica_meshes[0]
    specs = [s.spec for s in self._replica_shardings[0]]
    self.buckets = plan_buckets(
        [jax.ShapeDtypeStruct(s.shard_shape(a.shape), a.dtype)
         for s, a in zip(self._replica_shardings[0], self._avals)], bucket_bytes)
    trainer = np.asarray(topology.trainer_devices, dtype=object)
    self.num_copies = trainer.size // first.devices.size
    self.send_mesh = Mesh(trainer.reshape((self.num_copies,) + first.devices.shape),
                          ("copies",) + tuple(first.axis_names))
    self._copy_of_replica = [self._choose_copy(r, m) for r, m in enumerate(self.replica_meshes)]
    every_route = self._plan_routes()
    me = topology.process_index
    # a copy inside another process: that process makes it alone
    self._routes = {route: entries for route, entries in every_route.items()
                    if route[0] != route[1] or route[0] == me}
    self._pack = self._packer(specs)
    replica = topology.replica_index
    self._unpack = None if replica is None else self._unpacker(self.replica_meshes[replica])
    bucket_set_bytes = sum(b.nbytes for b in self.buckets)
    self.num_transfers = sum(len(e) for e in every_route.values()) * len(self.buckets)
    self.total_bytes = sum(len(e) for e in every_route.values()) * bucket_set_bytes
    moved: dict[int, int] = {}  # process -> bytes it sends and receives in one sync
    for (source, target), entries in every_route.items():
      for process in {source, target}:
        moved[process] = moved.get(process, 0) + len(entries) * bucket_set_bytes
    self.bytes_per_sync = max(moved.values())  # the busiest process's, the same everywhere
    self.deadline_floor_s = float(deadline_floor_s if deadline_floor_s is not None
                                  else os.environ.get(FLOOR_ENV, DEADLINE_FLOOR_S))
    self.deadline_bytes_per_s = float(deadline_bytes_per_s if deadline_bytes_per_s is not None
                                      else os.environ.get(BYTES_PER_S_ENV, DEADLINE_BYTES_PER_S))
    log.info("weight sync: %d leaves in %d bucket(s) per device pair, %d transfers and %.1f MB "
             "per sync (%d without buckets), deadline %s", len(self._avals), len(self.buckets),
             self.num_transfers, self.total_bytes / 1e6,
             self.num_transfers // max(1, len(self.buckets)) * len(self._avals),
             self.describe_deadline())

  @property
  def deadline_s(self) -> float:
    """Seconds one sync may take before every process stops: floor + bytes / bandwidth floor,
    with the bytes the busiest process sends and receives (routes run side by side)."""
    return self.deadline_floor_s + self.bytes_per_sync / self.deadline_bytes_per_s

  def describe_deadline(self) -> str:
    return (f"{self.deadline_s:.0f} s = {self.deadline_floor_s:g} s + "
            f"{self.bytes_per_sync / 1e6:.1f} MB at {self.deadline_bytes_per_s / 1e6:g} MB/s")

  def peers(self, process: int) -> list[int]:
    """The processes `process` exchanges buckets with (its transfers wait on them)."""
    return sorted({p for route in self._routes for p in route if process in route} - {process})

  def _choose_copy(self, replica: int, mesh: Mesh) -> int:
    process = mesh.devices.flat[0].process_index
    for copy in range(self.num_copies):
      if all(d.process_index == process for d in self.send_mesh.devices[copy].flat):
        return copy
    return replica % self.num_copies

  def _plan_routes(self) -> dict[tuple[int, int], list]:
    """(source process, target process) -> [(replica, position, source device, target device)],
    the same on every process."""
    routes: dict[tuple[int, int], list] = {}
    for replica, mesh in enumerate(self.replica_meshes):
      copy = self.send_mesh.devices[self._copy_of_replica[replica]]
      for position in np.ndindex(mesh.devices.shape):
        source, target = copy[position], mesh.devices[position]
        routes.setdefault((source.process_index, target.process_index), []).append(
            (replica, position, source, target))
    return dict(sorted(routes.items()))

  def _packer(self, specs):
    """jit(trainer leaves) -> buckets on the send mesh, device (c, j) holding its own buckets."""
    buckets, avals = self.buckets, self._avals
    send_shardings = [NamedSharding(self.send_mesh, spec) for spec in specs]
    flat_spec = P(*self.send_mesh.axis_names, None)
    lead = (1,) * len(self.send_mesh.axis_names)

    def local(*shards):
      return [flat.reshape(lead + flat.shape) for flat in pack(shards, buckets)]

    packed = jax.shard_map(local, mesh=self.send_mesh, in_specs=tuple(specs),
                           out_specs=[flat_spec] * len(buckets), check_vma=False)

    def cast_and_pack(*leaves):
      leaves = [jax.lax.with_sharding_constraint(leaf.astype(aval.dtype), sharding)
                for leaf, aval, sharding in zip(leaves, avals, send_shardings)]
      return packed(*leaves)

    return jax.jit(cast_and_pack,
                   out_shardings=[NamedSharding(self.send_mesh, flat_spec)] * len(buckets))

  def _unpacker(self, mesh: Mesh):
    """jit(buckets on the replica mesh) -> the replica's parameter leaves, sharded as it wants."""
    buckets = self.buckets
    shardings = self._replica_shardings[self.topology.replica_index]

    def local(*flats):
      return unpack([flat.reshape(-1) for flat in flats], buckets)

    unpacked = jax.shard_map(local, mesh=mesh,
                             in_specs=(P(None, *mesh.axis_names, None),) * len(buckets),
                             out_specs=[s.spec for s in shardings], check_vma=False)
    return jax.jit(unpacked, out_shardings=shardings)

  def pack(self, params):
    """Trainer processes: the parameters cast, laid out and packed into this process's buckets
    ({device: bucket} per bucket), computed; `send(packed=...)` moves them. Separate so that the
    sync's deadline covers the transfers, not the trainer's own compilation and compute."""
    packed = self._pack(*jax.tree.leaves(params))
    jax.block_until_ready(packed)
    return [{s.device: s.data for s in flat.addressable_shards} for flat in packed]

  def send(self, params=None, *, packed=None):
    """Every process calls this with the same cadence; trainer processes pass the parameters
    (or what `pack` made of them). Returns this process's replica parameters (an nnx.State
    like `params`), or None."""
    me = self.topology.process_index
    lead = (1,) * len(self.send_mesh.axis_names)
    local = [{} for _ in self.buckets]
    if self.topology.is_trainer:
      local = packed if packed is not None else self.pack(params)
    received: dict[tuple, list] = {}
    # One device_put per (source, target) process pair, made by every process in the same order:
    # JAX (0.10, CPU) matches the transfers of one call by their order on each side, so a call
    # mixing several receiving (or sending) processes hands a receiver another's data.
    for route, entries in self._routes.items():
      arrays, targets = [], []
      for _, _, source, target in entries:
        for index, bucket in enumerate(self.buckets):
          if source.process_index == me:
            arrays.append(local[index][source])
          else:  # a placeholder: the bucket lives on another process
            arrays.append(jax.make_array_from_single_device_arrays(
                lead + (bucket.size,), SingleDeviceSharding(source), [], dtype=bucket.dtype))
          targets.append(SingleDeviceSharding(target))
      moved = jax.device_put(arrays, targets, may_alias=False)
      if route[1] == me:
        for number, (replica, position, _, _) in enumerate(entries):
          count = len(self.buckets)
          received[(replica, position)] = moved[number * count:(number + 1) * count]
    replica = self.topology.replica_index
    if replica is None:
      return None
    mesh = self.replica_meshes[replica]
    # the buckets keep the send mesh's leading "copies" axis (of size 1 here)
    flat_sharding = NamedSharding(mesh, P(None, *mesh.axis_names, None))
    flats = [jax.make_array_from_single_device_arrays(
        (1,) + mesh.devices.shape + (bucket.size,), flat_sharding,
        [received[(replica, position)][index] for position in np.ndindex(mesh.devices.shape)])
        for index, bucket in enumerate(self.buckets)]
    return jax.tree.unflatten(self._treedef, self._unpack(*flats))
