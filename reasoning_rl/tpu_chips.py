"""What the planner and the launchers know about each accelerator: per-chip facts from Google's
public pages, and the shape of each slice type (chips, hosts, topology): the one table both the
dry-run plan and launch/gcp/commands.py read, so that a plan's hosts are the launch's VMs.

Figures are per JAX device: one per chip (v4 / v5p run their two TensorCores as one device),
except TPU7x (Ironwood), whose two chiplets JAX sees as two devices, each with half the chip. The
pages write HBM sizes as "GB"; the runtime reports them in binary units (a v5e shows ~16 GiB), so
capacities are taken as GiB.
"""

from __future__ import annotations

import dataclasses

GIB = 2**30
GBPS = 1e9 / 8  # bytes per second in one gigabit per second


@dataclasses.dataclass(frozen=True)
class ChipSpec:
  """Per-device facts: HBM capacity (bytes), peak dense bf16 FLOP/s, HBM bandwidth (bytes/s), how
  many devices one host (one JAX process) drives (0: one host drives every device), and the
  data-center network (DCN) bandwidth per chip (bytes/s), the link between slices."""

  name: str
  hbm_bytes: float
  peak_flops: float
  hbm_bandwidth: float
  devices_per_host: int = 0
  dcn_bandwidth: float = 25 * GBPS
  dcn_documented: bool = False  # False: the page gives no DCN figure; 25 Gb/s (v5e's) is assumed
  backend: str = "tpu"  # JAX's platform name: decides the training attention kernel


# Public Cloud TPU documentation, chip specification tables (read 2025-2026):
#   v4:  docs.cloud.google.com/tpu/docs/v4   — 275 TFLOP/s bf16, HBM2 32 GiB, 1200 GB/s; 4 chips
#        per TPU VM (a v4-32 lists process indices 0-3 of 4 devices each); no DCN figure
#   v5e: docs.cloud.google.com/tpu/docs/v5e  — 197 TFLOP/s bf16, HBM2 16 GB, 819 GB/s; DCN 6.4 Tb/s
#        per 256-chip pod and 2 x 100 Gb/s NICs per 8-chip machine: 25 Gb/s per chip. The page's
#        "chips per host" (8) counts the physical machine; a multi-host slice runs on VMs of 4
#        chips (ACCELERATORS below), which is what a JAX process drives
#   v5p: docs.cloud.google.com/tpu/docs/v5p  — 459 TFLOP/s bf16, HBM2e 95 GB, 2765 GB/s; 4 chips
#        per VM (the 2x4x4 slice, v5p-64, is 32 chips on 8 hosts); "Data center network (DCN)
#        bandwidth per chip (Gbps): 50"
#   v6e: docs.cloud.google.com/tpu/docs/v6e  — 918 TFLOP/s bf16, 32 GB, 1638 GB/s; no DCN figure;
#        multi-host slices on VMs of 4 chips, as v5e
#   v7x: docs.cloud.google.com/tpu/docs/tpu7x — per chip 192 GiB HBM, 2307 TFLOP/s bf16, 7380 GB/s,
#        DCN 100 Gb/s, 4 chips per VM; "dual-chiplet": the programming model shows two devices per
#        chip, so per device half of each (96 GiB, 1153.5 TFLOP/s, 3690 GB/s, 50 Gb/s) and 8
#        devices per host (the halves are this table's division, not figures Google prints)
TPU_CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("TPU v4", 32 * GIB, 275e12, 1200e9, devices_per_host=4),
    "v5e": ChipSpec("TPU v5e", 16 * GIB, 197e12, 819e9, devices_per_host=4,
                    dcn_bandwidth=25 * GBPS, dcn_documented=True),
    "v5p": ChipSpec("TPU v5p", 95 * GIB, 459e12, 2765e9, devices_per_host=4,
                    dcn_bandwidth=50 * GBPS, dcn_documented=True),
    "v6e": ChipSpec("TPU v6e", 32 * GIB, 918e12, 1638e9, devices_per_host=4),
    "v7x": ChipSpec("TPU7x (half chip)", 96 * GIB, 1153.5e12, 3690e9, devices_per_host=8,
                    dcn_bandwidth=50 * GBPS, dcn_documented=True),
}
# "cpu": the development machine (24 GiB RAM, ~400 GFLOP/s f32 matmul, ~60 GB/s),
# shared evenly by `num_devices` simulated devices, one process unless the target says otherwise.
CPU_MACHINE = ChipSpec("CPU (2 cores)", 24 * GIB, 400e9, 60e9, backend="cpu")


# The config's `target.tpu` -> (Cloud TPU API prefix of its accelerator types, TensorCores the
# type's number counts per JAX device): v4 / v5p devices are chips of 2 TensorCores, a TPU7x device
# is one TensorCore (one chiplet), v5e (API name v5litepod) / v6e names count chips of one.
ACCELERATOR_NAMING = {"v4": ("v4", 2), "v5p": ("v5p", 2), "v5e": ("v5litepod", 1),
                      "v6e": ("v6e", 1), "v7x": ("tpu7x", 1)}


def slice_name(tpu: str, num_devices: int) -> str:
  """Cloud TPU's accelerator type of a slice of `num_devices` JAX devices (ACCELERATOR_NAMING):
  v5p-64 = 32 chips, v5litepod-256 = 256 v5e chips, tpu7x-16 = 16 devices on 8 chips; "" for a
  target without one (cpu)."""
  if tpu not in ACCELERATOR_NAMING:
    return ""
  prefix, cores_per_device = ACCELERATOR_NAMING[tpu]
  return f"{prefix}-{cores_per_device * num_devices}"


# ---------------------------------------------------------------------------------------------
# Slice types: accelerator type (TPU API name) -> (chips, chips per VM, topology). A host here is
# a VM: one JAX process, one TPU VM worker, one GKE pod.
# v5p / v4: the name counts TensorCores (2 per chip), 4 chips per VM; cloud.google.com/tpu/docs/v5p
#   ("2x4x4 ... 64 cores, 32 chips, 8 machines") and /tpu/docs/v4.
# v5e / v6e: the name counts chips; slices of up to 8 chips are one VM, larger ones VMs of 4 chips
#   (cloud.google.com/tpu/docs/v6e, "Supported configurations": 4x4 = 16 chips on 4 VMs ...
#   16x16 = 256 chips on 64 VMs; the same shapes for v5e in /tpu/docs/v5e and in google/xpk's
#   system_characteristics.py, v5litepod-16: 4 VMs of ct5lp-hightpu-4t).
# TPU7x (Ironwood, "v7x"): the name counts TensorCores, 2 per chip (docs.cloud.google.com/tpu/docs/
#   tpu7x: "Each TPU7x chip contains two TensorCores"); 4 chips per VM, except the one-chip 1x1x1
#   (docs.cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood: "Each Ironwood (TPU7x)
#   VM contains four chips"). Names and topologies from google/xpk (AI-Hypercomputer/xpk at
#   367c838, src/xpk/core/system_characteristics.py): prefix 'tpu7x', tensorcores_per_chip=2,
#   machine tpu7x-standard-1t for 1x1x1 and tpu7x-standard-4t (compute_chips_per_vm: 4) for the
#   rest, whose default topologies include 2x2x1 ... 4x8x8 (tpu7x-8 ... tpu7x-512).
_2D = ((1, "1x1"), (4, "2x2"), (8, "2x4"), (16, "4x4"), (32, "4x8"), (64, "8x8"), (128, "8x16"),
       (256, "16x16"))
ACCELERATORS: dict[str, tuple[int, int, str]] = {
    **{f"v5p-{2 * chips}": (chips, 4, topology) for chips, topology in (
        (4, "2x2x1"), (8, "2x2x2"), (16, "2x2x4"), (32, "2x4x4"), (64, "4x4x4"), (128, "4x4x8"))},
    **{f"v4-{2 * chips}": (chips, 4, topology) for chips, topology in (
        (4, "2x2x1"), (8, "2x2x2"), (16, "2x2x4"), (32, "2x4x4"), (64, "4x4x4"))},
    **{f"v5litepod-{chips}": (chips, chips if chips <= 8 else 4, topology)
       for chips, topology in _2D},
    **{f"v6e-{chips}": (chips, chips if chips <= 8 else 4, topology) for chips, topology in _2D},
    **{f"tpu7x-{2 * chips}": (chips, 1 if chips == 1 else 4, topology) for chips, topology in (
        (1, "1x1x1"), (4, "2x2x1"), (8, "2x2x2"), (16, "2x2x4"), (32, "2x4x4"), (64, "4x4x4"),
        (128, "4x4x8"), (256, "4x8x8"))},
}
# JAX devices per chip where it is not one (v4 / v5p run their two TensorCores as one device):
# a TPU7x chip is two chiplets that JAX sees as two devices (docs.cloud.google.com/tpu/docs/tpu7x,
# "Dual-chiplet architecture": the programming model gives access to two TPU devices per chip).
JAX_DEVICES_PER_CHIP = {"tpu7x": 2}


@dataclasses.dataclass(frozen=True)
class SliceShape:
  """One slice of an accelerator type: its chips, hosts (VMs) and ICI topology."""

  accelerator_type: str
  chips: int
  hosts: int
  topology: str

  @property
  def generation(self) -> str:
    return self.accelerator_type.split("-")[0]

  @property
  def devices(self) -> int:
    """JAX devices of the slice (what a config's target.num_devices counts)."""
    return self.chips * JAX_DEVICES_PER_CHIP.get(self.generation, 1)

  @property
  def devices_per_host(self) -> int:
    return self.devices // self.hosts


def slice_shape(accelerator_type: str) -> SliceShape | None:
  """The shape of a known accelerator type (ACCELERATORS), else None."""
  if accelerator_type not in ACCELERATORS:
    return None
  chips, per_host, topology = ACCELERATORS[accelerator_type]
  return SliceShape(accelerator_type, chips, max(1, chips // per_host), topology)


def devices_per_host(tpu: str, num_devices: int) -> int:
  """JAX devices one host (VM, process) of a slice of `num_devices` drives, as the launchers lay
  the slice out: the slice type's VMs where it is a known type, else the chip's figure (0 for a
  target without hosts of its own, the CPU)."""
  shape = slice_shape(slice_name(tpu, num_devices))
  if shape is not None:
    return shape.devices_per_host
  return TPU_CHIPS[tpu].devices_per_host if tpu in TPU_CHIPS else 0
