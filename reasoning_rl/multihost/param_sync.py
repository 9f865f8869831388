"""Trainer mesh → sampler replicas, device to device, across processes.

JAX moves an array between processes only when source and destination shardings have the same
layout over the same number of devices. A sampler replica (S devices, its own mesh and partition
rules) and the trainer mesh (T devices) differ, so the sync goes in two moves:

1. On the trainer mesh (one jit, trainer processes only): lay the parameters out as the replicas
   want them, on a "send mesh" = the trainer devices arranged as (T/S copies) × (replica mesh
   shape). Device j of copy c then holds exactly the shard that device j of a replica needs.
2. `jax.device_put` of single-device shards: copy c's device j → replica r's device j,
   with c = the copy on replica r's own process when there is one (colocated runs: the move stays
   on the host) and r mod (T/S) otherwise (split runs: replicas pull from different copies, which
   spreads the traffic). One call per (sending, receiving) process pair, made by every process
   in the same order; the side that does not hold a shard passes a data-less placeholder for it. Each replica then assembles its arrays
   from its local shards (`jax.make_array_from_single_device_arrays`).

Values are bit-identical to the trainer's. Requires S to divide T (`topology.check_sync_shapes`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from reasoning_rl import sharding as sharding_lib


class ParamSync:
  """Sends the trainer's parameters to every sampler replica; `send` returns this process's copy.

  Args:
    abstract_params: the policy's nnx.State (arrays or ShapeDtypeStructs with logical axes).
    topology: the run's `multihost.topology.Topology`.
    replica_meshes: one mesh per replica (same shape for all), in `topology.replicas` order.
  """

  def __init__(self, abstract_params, topology, replica_meshes):
    self.topology = topology
    self.replica_meshes = list(replica_meshes)
    self._treedef = jax.tree.structure(abstract_params)
    self._avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(abstract_params)]
    self._replica_shardings = [jax.tree.leaves(sharding_lib.param_shardings(abstract_params, m))
                               for m in self.replica_meshes]
    if any(len(s) != len(self._avals) for s in self._replica_shardings):
      raise ValueError("parameter tree and its shardings differ in leaf count")
    first = self.replica_meshes[0]
    trainer = np.asarray(topology.trainer_devices, dtype=object)
    self.num_copies = trainer.size // first.devices.size
    self.send_mesh = Mesh(trainer.reshape((self.num_copies,) + first.devices.shape),
                          ("copies",) + tuple(first.axis_names))
    self._send_shardings = tuple(NamedSharding(self.send_mesh, s.spec)
                                 for s in self._replica_shardings[0])
    self._copy_of_replica = [self._choose_copy(r, m) for r, m in enumerate(self.replica_meshes)]
    self._to_send_layout = jax.jit(lambda *leaves: leaves, out_shardings=self._send_shardings)

  def _choose_copy(self, replica: int, mesh: Mesh) -> int:
    process = mesh.devices.flat[0].process_index
    for copy in range(self.num_copies):
      if all(d.process_index == process for d in self.send_mesh.devices[copy].flat):
        return copy
    return replica % self.num_copies

  def send(self, params=None):
    """Every process calls this with the same cadence; trainer processes pass the parameters.
    Returns this process's replica parameters (an nnx.State like `params`), or None."""
    me = self.topology.process_index
    local_shards = [{} for _ in self._avals]
    if self.topology.is_trainer:
      sent = self._to_send_layout(*jax.tree.leaves(params))
      local_shards = [{s.device: s.data for s in leaf.addressable_shards} for leaf in sent]
    # (source process, target process) -> [(leaf, source array, target device)]
    pairs: dict[tuple[int, int], list] = {}
    for leaf, aval in enumerate(self._avals):
      for replica, mesh in enumerate(self.replica_meshes):
        copy = self.send_mesh.devices[self._copy_of_replica[replica]]
        shard_shape = self._replica_shardings[replica][leaf].shard_shape(aval.shape)
        for position in np.ndindex(mesh.devices.shape):
          source, target = copy[position], mesh.devices[position]
          route = (source.process_index, target.process_index)
          if route[0] == route[1] and route[0] != me:
            continue  # a copy inside another process: that process makes it alone
          if source.process_index == me:
            array = local_shards[leaf][source]
          else:  # a placeholder: the array lives on another process
            array = jax.make_array_from_single_device_arrays(
                shard_shape, SingleDeviceSharding(source), [], dtype=aval.dtype)
          pairs.setdefault(route, []).append((leaf, array, target))
    # One device_put per (source, target) process pair, made by every process in the same order:
    # JAX (0.10, CPU) matches the transfers of one call by their order on each side, so a call
    # mixing several receiving (or sending) processes hands a receiver another's data.
    per_leaf = [[] for _ in self._avals]
    for route in sorted(pairs):
      entries = pairs[route]
      moved = jax.device_put([array for _, array, _ in entries],
                             [SingleDeviceSharding(target) for _, _, target in entries],
                             may_alias=False)
      if route[1] == me:
        for (leaf, _, _), array in zip(entries, moved):
          per_leaf[leaf].append(array)
    replica = self.topology.replica_index
    if replica is None:
      return None
    leaves = [jax.make_array_from_single_device_arrays(aval.shape,
                                                       self._replica_shardings[replica][leaf],
                                                       per_leaf[leaf])
              for leaf, aval in enumerate(self._avals)]
    return jax.tree.unflatten(self._treedef, leaves)
