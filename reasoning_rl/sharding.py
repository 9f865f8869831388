"""Device meshes, the trainer / sampler slices, and the one table of partition rules.

Every array dimension in the project is named with a logical axis (`batch`, `vocab`, `embed`, `mlp`,
`heads`, `kv_heads`, `head_dim`, `norm`, `length`, `layers`, `expert`); `LOGICAL_AXIS_RULES` maps each
to mesh axes (`data`, `fsdp`, `tensor`, and `expert` where the mesh has one). Parameters are sharded
FSDP-style over `fsdp` on their embedding dimension and Megatron-style over `tensor` on heads / MLP /
vocabulary; activations split their batch over `data` × `fsdp` (× `expert`). A dimension that a mesh
axis does not divide stays replicated on that axis (e.g. SmolLM2's 3 KV heads on a tensor axis of 2),
so any model fits any mesh.

Expert parallelism (mixture-of-experts models): a mesh given with an `expert` size (a dict with
"expert", or four sizes in `EXPERT_MESH_AXES` order) has the axes (data, fsdp, expert, tensor). A
sparse layer's stacked experts are split over `expert`, and so is the batch: every device computes
the dense parts for its own tokens, and each sparse layer exchanges tokens with the other devices
of its `expert` group (`reasoning_rl.models.moe`). Meshes without it keep the three axes.

Several slices (TPU "Multislice": slices joined by the data-center network, DCN, whose bandwidth
is a small fraction of the chips' own interconnect, ICI): a mesh shape then describes one slice,
and the slices are stacked along `data`. Only data parallelism crosses slices, so the one
collective on DCN is the gradient all-reduce over `data` (as MaxText's default
`dcn_data_parallelism` does); parameters, FSDP gathers and tensor-parallel traffic stay inside a
slice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from reasoning_rl.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
EXPERT_MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_MESH_AXES = ("data", "fsdp", "expert")  # what the batch is split over, where present

# logical axis -> mesh axes (a tuple shards over several mesh axes, None replicates).
LOGICAL_AXIS_RULES: dict[str, tuple[str, ...] | None] = {
    "batch": BATCH_MESH_AXES,
    "length": None,
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": None,
    "norm": None,
    "layers": None,  # the leading axis of a scanned stack's parameters and KV cache
    "expert": ("expert",),  # the leading axis of a sparse layer's stacked experts
}


def mesh_axes_of(shape: Sequence[int] | dict[str, int]) -> tuple[str, ...]:
  """The axis names a mesh given as `shape` has: EXPERT_MESH_AXES for a dict naming "expert" or
  four sizes, MESH_AXES otherwise."""
  if isinstance(shape, dict):
    return EXPERT_MESH_AXES if "expert" in shape else MESH_AXES
  return EXPERT_MESH_AXES if len(tuple(shape)) == len(EXPERT_MESH_AXES) else MESH_AXES


def resolve_mesh_shape(shape: Sequence[int] | dict[str, int], num_devices: int, *,
                       field: str = "mesh") -> tuple[int, ...]:
  """The sizes of `mesh_axes_of(shape)` for `num_devices`: (data, fsdp, tensor), or (data, fsdp,
  expert, tensor) with expert parallelism; `shape` a dict by axis name or a sequence in that
  order, one size may be -1 to take whatever the others leave. ConfigError names `field`."""
  axes = mesh_axes_of(shape)
  if isinstance(shape, dict):
    unknown = set(shape) - set(EXPERT_MESH_AXES)
    if unknown:
      raise ConfigError(f"{field}: unknown mesh axes {sorted(unknown)}; use {EXPERT_MESH_AXES}")
    sizes = [int(shape.get(axis, 1)) for axis in axes]
  else:
    sizes = [int(s) for s in shape]
  if len(sizes) != len(axes) or sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ConfigError(f"{field}={tuple(sizes)}: give {len(MESH_AXES)} positive sizes for "
                      f"{MESH_AXES} (or {len(EXPERT_MESH_AXES)} for {EXPERT_MESH_AXES}), at most "
                      "one of them -1")
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    if num_devices % known:
      raise ConfigError(
          f"{field}={tuple(sizes)}: {num_devices} devices cannot be split so; make the known "
          f"sizes divide {num_devices}")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ConfigError(
        f"{field}: mesh {dict(zip(axes, sizes))} needs {math.prod(sizes)} devices but "
        f"{num_devices} are available; change the sizes so their product is {num_devices} "
        "(or use -1 for one axis)")
  return tuple(sizes)


def slice_device_counts(num_trainer: int, num_devices: int, *,
                        field: str = "num_trainer_devices") -> tuple[int, int]:
  """(trainer, sampler) device counts; num_trainer 0 means both roles share every device."""
  if num_trainer == 0:
    return num_devices, num_devices
  if not 0 < num_trainer < num_devices:
    raise ConfigError(
        f"{field}={num_trainer}: must be 0 (share all devices) or leave at least one of the "
        f"{num_devices} devices to each slice (trainer and sampler): 1..{num_devices - 1}")
  return num_trainer, num_devices - num_trainer


def multi_slice_mesh_shape(shape: Sequence[int] | dict[str, int], num_devices: int,
                           num_slices: int = 1, *, field: str = "mesh") -> tuple[int, ...]:
  """The sizes (`resolve_mesh_shape`) of a mesh over `num_devices` on `num_slices` slices: `shape`
  is resolved against one slice's devices, then `data` is multiplied by the slice count."""
  if num_slices < 1 or num_devices % num_slices:
    raise ConfigError(f"{field}: {num_devices} devices do not form {num_slices} equal slices")
  data, *rest = resolve_mesh_shape(shape, num_devices // num_slices, field=field)
  return (data * num_slices, *rest)


def make_mesh(shape: Sequence[int] | dict[str, int], devices: Sequence[jax.Device] | None = None,
              *, field: str = "mesh", num_slices: int = 1) -> Mesh:
  """A mesh with axes (data, fsdp, tensor), or (data, fsdp, expert, tensor) (`mesh_axes_of`), over
  `devices` (default: all); see resolve_mesh_shape.

  With `num_slices` > 1, `devices` lists the slices one after another (slice-major: process-major
  order is, since processes are numbered slice by slice) and `shape` is one slice's mesh; the
  slices are stacked along `data`, so data-parallel index s·data + i is slice s's i-th.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = multi_slice_mesh_shape(shape, len(devices), num_slices, field=field)
  return Mesh(np.asarray(devices, dtype=object).reshape(sizes), mesh_axes_of(shape))


def device_slice_ids(devices: Sequence[jax.Device], num_slices: int = 0, *,
                     field: str = "config.mesh.num_slices") -> list[int]:
  """The slice of each of `devices` (all of a run's devices, in process-major order).

  TPU devices of a multi-slice run carry `slice_index`, which decides. Elsewhere `num_slices`
  (0 or 1: one slice) simulates slices as equal consecutive groups: whole processes when the
  devices belong to several (a host is never cut, as on TPU), else devices of the one process.
  """
  real = [getattr(d, "slice_index", None) for d in devices]
  if None not in real and len(set(real)) > 1:
    if num_slices not in (0, len(set(real))):
      raise ConfigError(f"{field}={num_slices}: the devices form {len(set(real))} slices; "
                        "leave it 0 (the devices' own slices)")
    return [int(s) for s in real]
  num_slices = max(num_slices, 1)
  processes = sorted({d.process_index for d in devices})
  if len(processes) > 1:
    if len(processes) % num_slices:
      raise ConfigError(f"{field}={num_slices}: the {len(processes)} processes cannot form "
                        f"{num_slices} equal slices; use a divisor of {len(processes)}")
    per_slice = len(processes) // num_slices
    return [processes.index(d.process_index) // per_slice for d in devices]
  if len(devices) % num_slices:
    raise ConfigError(f"{field}={num_slices}: the {len(devices)} devices cannot form "
                      f"{num_slices} equal slices; use a divisor of {len(devices)}")
  return [i * num_slices // len(devices) for i in range(len(devices))]


def count_slices(devices: Sequence[jax.Device], num_slices: int = 0, *,
                 field: str = "config.mesh.num_slices") -> int:
  return len(set(device_slice_ids(devices, num_slices, field=field)))


def slices_spanned(first_devices: int, num_devices: int, num_slices: int, *,
                   field: str = "config.mesh.num_trainer_devices") -> int:
  """How many slices the first `first_devices` of `num_devices` (equal slices, in order) cover:
  one slice or part of it, or whole slices; anything else is a ConfigError naming `field`."""
  per_slice = num_devices // num_slices
  if first_devices <= per_slice:
    return 1
  if first_devices % per_slice:
    raise ConfigError(
        f"{field}={first_devices}: covers {first_devices // per_slice} slices of {per_slice} "
        f"devices and part of another; the trainer takes part of one slice or whole slices "
        f"(a multiple of {per_slice}), so that only its data parallelism crosses slices")
  return first_devices // per_slice


def split_devices(num_trainer: int, devices: Sequence[jax.Device] | None = None,
                  *, field: str = "num_trainer_devices"):
  """Splits devices into (trainer, sampler) lists; 0 < num_trainer < len(devices).

  With a single device both roles share it (returned as the same one-element list), which is how the
  CPU demo runs.
  """
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) == 1:
    return devices, devices
  trainer, _ = slice_device_counts(num_trainer, len(devices), field=field)
  if num_trainer == 0:
    raise ConfigError(f"{field}=0: splitting needs a trainer device count; 0 means sharing all "
                      "devices, which needs no split")
  return devices[:trainer], devices[trainer:]


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """PartitionSpec for an array whose dimensions carry logical `axes`.

  A mesh axis is used at most once per array, and only where it divides the dimension; otherwise the
  dimension stays replicated on it.
  """
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
  used: set[str] = set()
  spec = []
  for name, size in zip(axes, shape):
    if name is not None and name not in LOGICAL_AXIS_RULES:
      raise ValueError(f"logical axis {name!r} has no rule in LOGICAL_AXIS_RULES")
    chosen = []
    for mesh_axis in (LOGICAL_AXIS_RULES.get(name) or ()) if name else ():
      if mesh_axis not in mesh.shape:  # `expert` on a mesh without expert parallelism
        continue
      factor = math.prod(mesh.shape[a] for a in chosen) * mesh.shape[mesh_axis]
      if mesh_axis not in used and mesh.shape[mesh_axis] > 1 and size % factor == 0:
        chosen.append(mesh_axis)
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return PartitionSpec(*spec)


def sharding_for(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))


def param_shardings(abstract_state, mesh: Mesh):
  """NamedSharding of every parameter of an nnx state (abstract or concrete) on `mesh`."""
  from flax import nnx  # local: keeps this module importable without flax for planning tools

  def one(variable):
    return sharding_for(variable.get_metadata()["logical_axes"], variable.shape, mesh)

  return jax.tree.map(one, abstract_state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def reshard(tree, shardings):
  """Moves a tree of arrays onto new shardings (e.g. trainer mesh -> sampler mesh).

  `jax.device_put` copies device to device, shard by shard; values are bit-identical. The result
  never aliases the input, even where source and target sharding coincide (trainer and sampler
  sharing devices): the trainer donates its buffers to the next step, and the sampler's copy must
  survive that.
  """
  return jax.device_put(tree, shardings, may_alias=False)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Pins an activation to the sharding of its logical `axes` while a jitted function is traced
  under `jax.sharding.use_abstract_mesh` (the training step does); a no-op otherwise.

  Without these pins XLA's sharding propagation is free to meet a batch-sharded activation and an
  fsdp-sharded weight by gathering the activation instead of the weight: measured on a 4-device
  fsdp mesh, the MLP intermediates and the logits were then held for the whole batch on every
  device (2x the step's memory).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh))


def batch_axes(mesh) -> tuple[str, ...]:
  """The mesh axes a batch is split over: data, fsdp and, with expert parallelism, expert."""
  return tuple(axis for axis in BATCH_MESH_AXES if axis in mesh.shape)


def batch_devices(mesh) -> int:
  """How many ways a batch is split (the product of `batch_axes`)."""
  return math.prod(mesh.shape[axis] for axis in batch_axes(mesh))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Activations / data: batch over `batch_axes`, the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(batch_axes(mesh), *([None] * (ndim - 1))))
