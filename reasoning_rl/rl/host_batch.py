"""The host arrays a training step is fed: a padded batch as is, or packed for the step's layout.

With `StepConfig.packing` the padded batch of `reasoning_rl.rl.batching` is packed padding-free
(`reasoning_rl.rl.packing.pack_batch`) into the step's M mini-batches of m micro-batches, with row
counts that divide over the mesh's data × fsdp devices; the step itself takes either layout.
"""

from __future__ import annotations

from reasoning_rl import sharding as sharding_lib
from reasoning_rl.rl import packing
from reasoning_rl.rl.batching import TRUNCATION_FIELDS
from reasoning_rl.rl.step_config import StepConfig


def host_batch_with_layout(config: StepConfig, batch: dict, *, mesh=None, pad_id: int = 0
                           ) -> tuple[dict, packing.PackedLayout | None]:
  """The batch the step on `mesh` is fed and, when it packed, the layout that maps the packed
  sequence slots back to the padded rows (`packing.unpack_sequences`, for per-sequence outputs);
  None when padded."""
  c = config
  if not c.packing:
    return batch, None
  batch = _settings_to_pack(batch, c.truncated_ratio and c.algorithm != "sft")
  devices = 1
  if mesh is not None:
    devices = sharding_lib.batch_devices(mesh)
  # The head projects as many positions at once as a padded micro-batch's chunk holds
  # (rows × min(logprob_chunk, completion length)), over the row factor k: no more logits memory
  # than the padded step's, and matmuls as large or 1/k as large. (A chunk longer than the
  # completions would project positions no padded step does.) Why 1/k: rows k times as long,
  # above all with shared prompts, hold more completion tokens per micro-batch than a padded
  # one, which then spill into a second chunk of mostly empty positions; at k = 2 with shared
  # prompts the half-size chunk cut the head's positions 4,608 → 3,328 and the step 28.3 →
  # 25.8 s, a quarter-size one was slower again (benchmarks/RESULTS.md, "Shared prompts").
  rows, width = batch["completion_mask"].shape
  padded_rows = rows // (c.num_mini_batches * c.num_micro_batches)
  padded_chunk = min(c.logprob_chunk, width) * max(1, padded_rows // devices)
  return packing.pack_batch(batch, num_mini_batches=c.num_mini_batches,
                            num_micro_batches=c.num_micro_batches,
                            row_factor=c.packed_row_factor, row_groups=devices,
                            head_chunk=max(1, padded_chunk // c.packed_row_factor),
                            pad_id=pad_id, share_prompts=bool(c.shared_prompts))


def _settings_to_pack(batch: dict, truncated_ratio: bool) -> dict:
  """The padded batch, for packing, with its sampling settings only where the step truncates
  (`truncated_ratio`, which a run turns on only under a rollout that warps). The choice follows
  the config, never the rows: a batch of a run always has the same arrays, or the compiled step
  would refuse the next one (a batch of fully masked rows, where dynamic sampling came up short,
  has no settings to read)."""
  if truncated_ratio or not all(name in batch for name in TRUNCATION_FIELDS):
    return batch
  return {k: v for k, v in batch.items() if k not in TRUNCATION_FIELDS}
