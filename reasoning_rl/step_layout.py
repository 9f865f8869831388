"""The training step's layout, chosen for the machine when the config leaves it open.

Two fields are "memory and speed, not maths": the update is the same whatever they are.
Left at their defaults, `resolve` picks them at start-up, before anything is built
(`memory_plan.resolve_layout` calls it with the memory model's verdicts), and the run logs what
it picked and why:

- `algo.packing=None`: packed rows (padding-free, `rl/packing.py`: the same loss and gradients,
  padding skipped) for RL stages; padded rows for SFT stages.
- `algo.shared_prompts=None`: on for packed RL rows where the training attention is the
  reference (every CPU run, `model.attention_kernel='reference'` elsewhere): a prompt is laid
  out once for the completions of it a row holds (`rl/packing.py`). Off where a mixture of
  experts' load-balancing or z-loss is weighted: those average over the positions computed,
  so they would change (a config may still ask for it). The flash kernels mask by
  segment equality only, so they could not show a completion its prompt: a config that asks for
  shared prompts with one is refused (`require_reference_attention`).
- `algo.packed_row_factor=0`: on a CPU, rows twice a padded row's length with shared prompts
  (room for a prompt and several of its completions; shared prompts in such rows, with the
  head chunk `rl/host_batch.py` halves for them, took the benchmark's training step from 33.5 to
  25.8 s on an Intel Xeon, benchmarks/RESULTS.md "Shared prompts"), a padded row's length without them (two sequences longer than half a row never
  share one, and the attention's cost per token grows with the row); elsewhere a padded row's
  length, the rows the memory planner counts.
- `algo.num_micro_batches=0`: the fewest micro-batches (gradient accumulation) that divide the
  mini-batch and whose step fits one device's memory by the planner's estimate
  (`memory_plan.memory_plan`, with its headroom; the sampler's memory counted where it shares the devices).
  On a CPU, in addition, a micro-batch holds at most `CPU_POSITIONS_PER_MICRO_BATCH` positions
  (rows × (prompt + completion)) per device: XLA:CPU's step runs faster on micro-batches whose
  activations stay near the caches (measured; benchmarks/RESULTS.md, "Fast by default").
  TPUs and GPUs take the biggest micro-batch that fits: larger matmuls, fewer passes.

A config that sets any of these fields keeps its value. The resolved values are what the run uses and
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
from reasoning_rl.errors import ConfigError


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
  """Whether the config leaves a field of the layout to `resolve`."""
  a = config.algo
  packs = a.packing is not False and config.stage == "rl"  # else the other two have no use
  return (a.packing is None or a.num_micro_batches == 0
          or (packs and (a.shared_prompts is None or a.packed_row_factor == 0)))


def reference_attention(config: ml_collections.ConfigDict, backend: str) -> bool:
  """Whether the run's training attention is the reference (`reasoning_rl.kernels`): asked
  for, or 'auto' on a CPU. ('auto' on an accelerator may pick a flash kernel.)"""
  kernel = config.model.attention_kernel
  return kernel == "reference" or (kernel == "auto" and backend == "cpu")


def require_reference_attention(config: ml_collections.ConfigDict, backend: str) -> None:
  """ConfigError where the config asks for shared prompts on a flash kernel (module
  docstring)."""
  if config.algo.shared_prompts and not reference_attention(config, backend):
    raise ConfigError(
        f"config.algo.shared_prompts=True needs the reference attention, and "
        f"model.attention_kernel={config.model.attention_kernel!r} on {backend} is a flash "
        "kernel, whose segment-id mask cannot show a completion the prompt it shares: set "
        "algo.shared_prompts=False (or None), or model.attention_kernel='reference'")


def choose_shared_prompts(config: ml_collections.ConfigDict, backend: str) -> tuple[bool, str]:
  """(shared_prompts, why) for a config that leaves it open; packing already decided."""
  if config.stage != "rl" or not config.algo.packing:
    return False, "padded rows: every row holds its own prompt"
  if not reference_attention(config, backend):
    return False, f"the flash kernels on {backend} mask by segment equality only"
  if config.algo.moe_load_balance_coef or config.algo.moe_router_z_coef:
    return False, ("the experts' auxiliary losses average over positions, where a shared "
                   "prompt would count once instead of once per completion")
  return True, "each prompt once per packed row: the same update, fewer positions"


def choose_row_factor(config: ml_collections.ConfigDict, backend: str, *,
                      batch_split: Callable[[int], int]) -> tuple[int, str]:
  """(packed_row_factor, why) for a config that leaves it open; shared_prompts and the
  micro-batch count decided. Two only on a CPU, where it was measured, where two padded rows fit
  a micro-batch's positions (`CPU_POSITIONS_PER_MICRO_BATCH`), and where each trainer device's
  share of a micro-batch (`batch_split`) is an even number of rows; elsewhere the planner counts
  the attention's memory per padded row."""
  rows = batch_rows(config) // config.algo.num_mini_batches // config.algo.num_micro_batches
  seq = config.rollout.max_prefill_length + config.rollout.max_new_tokens
  if (config.algo.shared_prompts and backend == "cpu" and 2 * seq <= CPU_POSITIONS_PER_MICRO_BATCH
      and rows % (2 * batch_split(rows)) == 0):
    return 2, "rows of two padded rows' length hold a prompt and several of its completions"
  return 1, "rows of a padded row's length: attention costs more per token in longer rows"


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
  if config.algo.packing and config.algo.packed_row_factor:  # 0: chosen after this count
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
  if config.algo.shared_prompts is None:
    shared, why = choose_shared_prompts(config, machine.backend)
    config.algo.shared_prompts = shared
    lines.append(f"algo.shared_prompts = {shared}: {why}")
  if config.algo.num_micro_batches == 0:
    k, why = choose_micro_batches(config, machine, fits=fits, batch_split=batch_split)
    config.algo.num_micro_batches = k
    lines.append(f"algo.num_micro_batches = {k}: {why}")
  if config.algo.packed_row_factor == 0:
    factor, why = choose_row_factor(config, machine.backend, batch_split=batch_split)
    config.algo.packed_row_factor = factor
    lines.append(f"algo.packed_row_factor = {factor}: {why}")
  return lines


def log_choices(lines) -> None:
  """Logs what `resolve` chose (the run's log: launch/train.py calls this once its log file is
  open)."""
  for line in lines:
    log.info("step layout: %s", line)
