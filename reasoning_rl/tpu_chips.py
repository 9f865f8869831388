"""What the planner knows about each accelerator: per-chip facts from Google's public pages.

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
#   v5e: docs.cloud.google.com/tpu/docs/v5e  — 197 TFLOP/s bf16, HBM2 16 GB, 819 GB/s; 8 chips per
#        host ("Chips per host"; the 16x16 slice of 256 chips has 32 hosts); DCN 6.4 Tb/s per
#        256-chip pod and 2 x 100 Gb/s NICs per 8-chip host: 25 Gb/s per chip
#   v5p: docs.cloud.google.com/tpu/docs/v5p  — 459 TFLOP/s bf16, HBM2e 95 GB, 2765 GB/s; 4 chips
#        per VM (the 2x4x4 slice, v5p-64, is 32 chips on 8 hosts); "Data center network (DCN)
#        bandwidth per chip (Gbps): 50"
#   v6e: docs.cloud.google.com/tpu/docs/v6e  — 918 TFLOP/s bf16, 32 GB, 1638 GB/s; 8 chips per
#        host; no DCN figure
#   v7x: docs.cloud.google.com/tpu/docs/tpu7x — per chip 192 GiB HBM, 2307 TFLOP/s bf16, 7380 GB/s,
#        DCN 100 Gb/s, 4 chips per VM; "dual-chiplet": the programming model shows two devices per
#        chip, so per device half of each (96 GiB, 1153.5 TFLOP/s, 3690 GB/s, 50 Gb/s) and 8
#        devices per host (the halves are this table's division, not figures Google prints)
TPU_CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("TPU v4", 32 * GIB, 275e12, 1200e9, devices_per_host=4),
    "v5e": ChipSpec("TPU v5e", 16 * GIB, 197e12, 819e9, devices_per_host=8,
                    dcn_bandwidth=25 * GBPS, dcn_documented=True),
    "v5p": ChipSpec("TPU v5p", 95 * GIB, 459e12, 2765e9, devices_per_host=4,
                    dcn_bandwidth=50 * GBPS, dcn_documented=True),
    "v6e": ChipSpec("TPU v6e", 32 * GIB, 918e12, 1638e9, devices_per_host=8),
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
