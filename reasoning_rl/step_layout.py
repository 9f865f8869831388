"""The training step's layout, chosen for the machine when the config leaves it open.

Two fields are "memory and speed, not maths": the update is the same whatever they are.
Left at their defaults, `resolve` picks them at start-up, before anything is built
(`memory_plan.resolve_layout` calls it with the memory model's verdicts), and the run logs what
it picked and why:

- `algo.packing=None`: packed rows (padding-free, `rl/packing.py`: the same loss and gradients,
  padding skipped) for RL stages; padded rows for SFT stages.
- `algo.num_micro_batches=0`: the fewest micro-batches (gradient accumulation) that divide the
  mini-batch and whose step fits one device's memory by the planner's estimate
  (`memory_plan.memory_plan`, with its headroom; the sampler's memory counted where it shares the devices).
  On a CPU, in addition, a micro-batch holds at most `CPU_POSITIONS_PER_MICRO_BATCH` positions
  (rows × (prompt + completion)) per device: XLA:CPU's step runs faster on micro-batches whose
  activations stay near the caches (measured; benchmarks/RESULTS.md, "Fast by default").
  TPUs and GPUs take the biggest micro-batch that fits: larger matmuls, fewer passes.

A config that sets either field keeps its value. The resolved values are what the run uses and
logs; the run's fingerprint keeps what the user asked for (`launch/train.py`), so a resume on
another kind of machine may choose again.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Callable

import ml_collections

from reasoning_rl.config import batch_rows


log = logging.getLogger(__name__)

# Positions (rows × sequence length) per micro-batch and device above which a CPU step splits the
# batch further. Measured on the CPU demo's model and shapes (benchmarks/RESULTS.md "Fast by
# default"): ~512–1k positions per micro-batch were the fastest, both larger and smaller slower.
CPU_POSITIONS_PER_MICRO_BATCH = 1024


@dataclasses.dataclass(frozen=True)
class Machine:
  """What the choice depends on: JAX's platform ("cpu", "gpu", "tpu"), the memory of one
  device in bytes, and how the run's devices are spread."""

  backend: str
  device_bytes: float
  num_devices: int
  devices_per_host: int
  num_slices: int = 1


def this_machine(num_slices: int = 1) -> Machine:
  """The machine this process runs on: the memory XLA may allocate on the first device (its
  `memory_stats()`), on a CPU the host's physical memory shared by its local devices."""
  import jax  # pylint: disable=import-outside-toplevel

  device = jax.local_devices()[0]
  backend = device.platform
  stats = None if backend == "cpu" else (device.memory_stats() or {})
  if stats and stats.get("bytes_limit"):
    device_bytes = float(stats["bytes_limit"])
  else:
    device_bytes = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                    / jax.local_device_count())
  return Machine(backend=backend, device_bytes=device_bytes, num_devices=jax.device_count(),
                 devices_per_host=jax.local_device_count(), num_slices=num_slices)


def is_open(config: ml_collections.ConfigDict) -> bool:
  """Whether the config leaves the packing or the micro-batch count to `resolve`."""
  return config.algo.packing is None or config.algo.num_micro_batches == 0


def choose_packing(config: ml_collections.ConfigDict) -> tuple[bool, str]:
  """(packing, why) for a config that leaves it open (module docstring)."""
  if config.stage != "rl":
    return False, f"stage {config.stage!r} trains on padded rows"
  return True, "padding-free rows: the same update, padding skipped"


def choose_micro_batches(config: ml_collections.ConfigDict, machine: Machine, *,
                         fits: Callable[[ml_collections.ConfigDict], bool],
                         batch_split: Callable[[int], int]) -> tuple[int, str]:
  """(num_micro_batches, why) for a config that leaves it open (module docstring). The config's
  packing must already be decided. `fits(trial)`: whether a copy of the config with a concrete
  count fits the machine (the planner's verdict); `batch_split(rows)`: over how many trainer
  devices a micro-batch of `rows` rows is split."""
  if config.stage != "rl":  # the planner sizes RL steps; SFT keeps the old default
    return 1, f"stage {config.stage!r}: one micro-batch (set the field to split its batch)"
  r = config.rollout
  rows = batch_rows(config) // config.algo.num_mini_batches
  seq = r.max_prefill_length + r.max_new_tokens
  candidates = [k for k in range(1, rows + 1) if rows % k == 0]
  if config.algo.packing:
    factor = config.algo.packed_row_factor
    candidates = [k for k in candidates if (rows // k) % factor == 0] or candidates
  trial = copy.deepcopy(config)
  gib = machine.device_bytes / 2**30
  cap = (f", at most {CPU_POSITIONS_PER_MICRO_BATCH} positions per device on a CPU"
         if machine.backend == "cpu" else "")
  for k in candidates:
    micro_rows = rows // k
    per_device = -(-micro_rows // batch_split(micro_rows)) * seq
    if (machine.backend == "cpu" and per_device > CPU_POSITIONS_PER_MICRO_BATCH
        and k != candidates[-1]):
      continue
    trial.algo.num_micro_batches = k
    if fits(trial):
      return k, (f"{micro_rows} rows of {seq} positions per micro-batch: the fewest "
                 f"micro-batches that fit {gib:.1f} GiB per device{cap}")
  return candidates[-1], (
      f"the most micro-batches the batch allows, and even that does not fit {gib:.1f} GiB per "
      "device by the plan: --config.dry_run=True shows where the memory goes")


def resolve(config: ml_collections.ConfigDict, *, machine: Machine,
            fits: Callable[[ml_collections.ConfigDict], bool],
            batch_split: Callable[[int], int]) -> list[str]:
  """Writes the chosen `algo.packing` / `algo.num_micro_batches` into `config` where it leaves
  them open; returns one line per choice ("field = value: why"), for `log_choices`. The memory
  verdicts come from the memory model (`memory_plan.resolve_layout` passes `fits` and `batch_split`)."""
  lines = []
  if config.algo.packing is None:
    packing, why = choose_packing(config)
    config.algo.packing = packing
    lines.append(f"algo.packing = {packing}: {why}")
  if config.algo.num_micro_batches == 0:
    k, why = choose_micro_batches(config, machine, fits=fits, batch_split=batch_split)
    config.algo.num_micro_batches = k
    lines.append(f"algo.num_micro_batches = {k}: {why}")
  return lines


def log_choices(lines) -> None:
  """Logs what `resolve` chose (the run's log: launch/train.py calls this once its log file is
  open)."""
  for line in lines:
    log.info("step layout: %s", line)
