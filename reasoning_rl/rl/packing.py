"""Padding-free training batches: sequences packed into rows, micro-batches of a token budget.

The padded layout (`batching.build_batch`) gives every sequence a row of W = P + T positions: the
prompt left-padded to P, the completion right-padded to T. RL completions vary widely in length,
so much of each row is padding the transformer still computes. `pack_batch` turns a padded batch
into the packed layout the training step also accepts, with the SAME array shapes for every batch
of a run (the step compiles once) and work that follows the real token count:

- Mini-batches are the padded step's own (mini-batch k holds rows k, k + M, k + 2M, …), so every
  update's loss normalizers, and therefore its loss and gradient, are unchanged.
- A mini-batch's sequences are packed first-fit-decreasing into rows of W positions (one sequence
  always fits). Each token carries its sequence's segment id (1, 2, … within its row; 0 =
  padding) and its position within its sequence, so attention never crosses sequences and a
  packed sequence computes what it computes alone.
- Shared prompts (`share_prompts`, `algo.shared_prompts`): a GRPO mini-batch holds each prompt
  once per sample. Sequences with the same prompt (and the same recorded experts over it) are
  packed one prompt after another, and a sequence joins a row already holding its prompt for its
  completion's length: the row holds the prompt once, then each completion as a branch after it,
  positions continuing from the prompt's end in every branch. Segment ids say which is which
  (`kernels.reference.shared_prefix_ids`: unit · 2^16 + branch, branch 0 the prompt), and the
  reference attention lets a branch see its own tokens and its unit's prompt, never another
  branch. The prompt's last position predicts each completion's first token (the head reads it
  once per completion), and the gradient into the one prompt copy is the sum the copies would
  get: the same loss and gradients in fewer positions.
- Micro-batches are token budgets, not row counts of sequences: micro-batch j of a mini-batch
  takes its packed rows j·R … j·R + R − 1, R = B / (M·m) rows of W positions, the size of a padded
  micro-batch (same activation memory). A mini-batch needs ⌈rows / R⌉ ≤ m of them; the step skips
  the empty ones (`lax.cond`), so a batch of short completions trains in fewer micro-batches.
- The vocabulary head runs only at the positions that predict a completion token: `head_index`
  lists them, `head_targets` holds the tokens (−1 past the end; the step skips chunks of the head
  that hold none). `token_index` [N, T] then lays the results out per sequence for the losses,
  which keep their [N, T] form (N sequence slots per micro-batch).
- Sampling settings (`algo.truncated_ratio`): a padded batch's per-row settings become
  per-head-position ones (`HEAD_TRUNCATION_FIELDS`, laid out as `head_targets`), since one packed
  row may hold sequences sampled with different settings.
- Recorded experts (mixture-of-experts models, `recorded_experts`) follow their tokens: [R, S, W,
  L_sparse, k] laid out like `tokens`.

Leaves are [rows | groups | slots, S, …] with S = M·m slices (mini-batch k's micro-batch j is slice
k·m + j): the leading axis is the one sharded over the trainer's data devices (G of them). Each
device's rows form one group, and a group's head positions index that group's rows only, so the
head's gather never crosses devices. N, the sequence slots of a micro-batch, is the mini-batch's
row count B / M (all of its sequences may be short enough to share one micro-batch), rounded up
to a multiple of G: no shape depends on the data, so the step compiles once. (Sizing N to the
batch at hand cost a recompilation, ~20 s for SmolLM2 on 2 cores, whenever it changed; the
[N, T] per-sequence arrays are scalars, small beside a micro-batch's activations.)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from reasoning_rl.kernels.reference import shared_prefix_ids
from reasoning_rl.rl.batching import TRUNCATION_FIELDS, UNTRUNCATED

# A padded batch's sampling settings in a packed one: per head position, laid out as
# `head_targets`; a position without a sequence holds the untruncated settings.
HEAD_TRUNCATION_FIELDS = tuple(f"head_{name}" for name in TRUNCATION_FIELDS)

SEQUENCE_FIELDS = ("completion_mask", "advantages", "rewards", "behavior_logprobs")


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """Where each sequence of the padded batch went: `row_of_slot` [S, N] is the padded row held by
  sequence slot (slice, n), −1 for an empty slot; `micro_batches_used` [M] how many of the m
  micro-batches each mini-batch fills."""

  row_of_slot: np.ndarray
  micro_batches_used: np.ndarray
  tokens: int  # positions filled (prompts + completions; a shared prompt once per row)
  rows: int  # packed rows holding them (over every mini-batch)


def _first_fit_decreasing(indices, lengths, width, prompt_keys=None, prompt_lens=None):
  """Rows of units, first-fit by decreasing length. A unit is [sequence indices]: one sequence,
  or with `prompt_keys` every sequence of the row whose prompt is the same (the prompt laid out
  once, module docstring): a sequence joins a row already holding its prompt for its completion's
  length, else the first row with room for all of it."""
  rows, free = [], []
  order = sorted(indices, key=lambda i: (-lengths[i], i))
  if prompt_keys is not None:
    # One prompt's sequences after another (the prompt with the most tokens first), so each
    # fills rows holding its prompt before another prompt's take the room.
    totals = {}
    for i in indices:
      totals[prompt_keys[i]] = totals.get(prompt_keys[i], 0) + lengths[i] - prompt_lens[i]
    first_seen = {}
    for i in order:
      first_seen.setdefault(prompt_keys[i], len(first_seen))
    order.sort(key=lambda i: (-totals[prompt_keys[i]], first_seen[prompt_keys[i]]))
  for i in order:
    if prompt_keys is not None:
      completion = lengths[i] - prompt_lens[i]
      shared = next((r for r, units in enumerate(rows) if free[r] >= completion
                     for unit in units if prompt_keys[unit[0]] == prompt_keys[i]), None)
      if shared is not None:
        next(u for u in rows[shared] if prompt_keys[u[0]] == prompt_keys[i]).append(i)
        free[shared] -= completion
        continue
    for r, space in enumerate(free):
      if lengths[i] <= space:
        rows[r].append([i])
        free[r] -= lengths[i]
        break
    else:
      rows.append([[i]])
      free.append(width - lengths[i])
  return rows


def pack_batch(batch: dict, *, num_mini_batches: int = 1, num_micro_batches: int = 1,
               row_factor: int = 1, row_groups: int = 1, head_chunk: int = 128, pad_id: int = 0,
               share_prompts: bool = False) -> tuple[dict, PackedLayout]:
  """The packed form of a padded batch (module docstring).

  Args:
    batch: `batching.build_batch`'s arrays: tokens, attention_mask [B, P + T], completion_mask
      [B, T], advantages [B] and optionally rewards [B], behavior_logprobs [B, T] and the
      sampling settings (`TRUNCATION_FIELDS`, [B] each; packed per head position).
    num_mini_batches, num_micro_batches: M and m of the step; B must be divisible by M·m.
    row_factor: k, packed rows hold k padded rows' positions (k·W), R / k of them per
      micro-batch: the same positions per micro-batch, and long sequences leave less unusable
      space at the end of a row (two sequences longer than W / 2 never share a W-row).
    row_groups: G, the trainer mesh's data × fsdp devices; R must be divisible by it.
    head_chunk: positions the vocabulary head projects at once, per group: `head_index` and
      `head_targets` are [G, S, chunks, head_chunk] (the step reads the chunk size off them).
    pad_id: token at padding positions.
    share_prompts: sequences of a mini-batch with the same prompt (and, with recorded experts,
      the same prompt routing) that share a row lay the prompt out once (module docstring); the
      segment ids then follow `kernels.reference.shared_prefix_ids`, which only the reference
      attention reads.

  Returns:
    (packed arrays for `TrainStep`, the layout that maps sequence slots back to padded rows).
  """
  tokens, attention = np.asarray(batch["tokens"]), np.asarray(batch["attention_mask"])
  completion_mask = np.asarray(batch["completion_mask"])
  num_rows, completion_length = completion_mask.shape
  prompt_length = tokens.shape[1] - completion_length
  width = tokens.shape[1] * row_factor
  num_slices = num_mini_batches * num_micro_batches
  if num_rows % num_slices:
    raise ValueError(f"{num_rows} rows do not split into {num_mini_batches} mini-batches of "
                     f"{num_micro_batches} micro-batches")
  if (num_rows // num_slices) % (row_factor * row_groups):
    raise ValueError(f"micro-batches of {num_rows // num_slices} rows do not make "
                     f"{row_groups} data devices' equal shares of rows {row_factor} times as long: "
                     "lower algo.packed_row_factor")
  rows_per_micro = num_rows // num_slices // row_factor
  prompt_lens = attention[:, :prompt_length].sum(1)
  # Attended completion tokens: a multi-turn row's loss mask has holes (observations), the
  # sequence does not.
  completion_lens = attention[:, prompt_length:].sum(1)
  if ((completion_lens > 0) & (prompt_lens == 0)).any():
    raise ValueError("a completion without a prompt token has no position predicting its first "
                     "token")
  lengths = [int(p + c) if c else 0 for p, c in zip(prompt_lens, completion_lens)]
  routed = "recorded_experts" in batch
  if routed:
    experts = np.asarray(batch["recorded_experts"])
  prompt_keys = None
  if share_prompts:
    prompt_keys = [tokens[i, :prompt_length][attention[i, :prompt_length] > 0].tobytes()
                   + (experts[i, :prompt_length][attention[i, :prompt_length] > 0].tobytes()
                      if routed else b"") for i in range(num_rows)]
  # Mini-batch k holds rows k, k + M, … (the padded step's `batch_slices.split_rows`); empty rows are dropped.
  slices, used = [], []
  for k in range(num_mini_batches):
    members = [i for i in range(k, num_rows, num_mini_batches) if lengths[i]]
    # Every row but the last holds >= k sequences (each is <= W long, so a row of k·W with fewer
    # has room for the next), so the rows fit the m micro-batches of R / k rows.
    rows = _first_fit_decreasing(members, lengths, width, prompt_keys, prompt_lens)
    used.append(-(-len(rows) // rows_per_micro))
    slices += [rows[j * rows_per_micro:(j + 1) * rows_per_micro]
               for j in range(num_micro_batches)]
  num_slots = -(-(num_rows // num_mini_batches) // row_groups) * row_groups
  rows_per_group = rows_per_micro // row_groups
  group_width = -(-rows_per_group * width // head_chunk) * head_chunk

  out = {
      "tokens": np.full((rows_per_micro, num_slices, width), pad_id, np.int32),
      "positions": np.full((rows_per_micro, num_slices, width), -1, np.int32),
      "segment_ids": np.zeros((rows_per_micro, num_slices, width), np.int32),
      "head_index": np.zeros((row_groups, num_slices, group_width), np.int32),
      "head_targets": np.full((row_groups, num_slices, group_width), -1, np.int32),  # reshaped below
      "token_index": np.full((num_slots, num_slices, completion_length),
                             row_groups * group_width, np.int32),
  }
  if routed:
    out["recorded_experts"] = np.zeros((rows_per_micro, num_slices, width, *experts.shape[2:]),
                                       experts.dtype)
  for name in SEQUENCE_FIELDS:
    if name in batch:
      value = np.asarray(batch[name])
      out[name] = np.zeros((num_slots, num_slices, *value.shape[1:]), value.dtype)
  settings = [(name, head_name, default) for name, head_name, default
              in zip(TRUNCATION_FIELDS, HEAD_TRUNCATION_FIELDS, UNTRUNCATED.values())
              if name in batch]
  for name, head_name, default in settings:
    out[head_name] = np.full((row_groups, num_slices, group_width), default,
                             np.asarray(batch[name]).dtype)
  row_of_slot = np.full((num_slices, num_slots), -1, np.int64)
  packed_tokens = 0
  for s, rows in enumerate(slices):
    slot = 0
    heads = [0] * row_groups  # head positions filled per group
    for r, row in enumerate(rows):
      group, row_in_group = divmod(r, rows_per_group)
      start = 0
      for number, unit in enumerate(row, start=1):
        first = unit[0]
        prompt_span = attention[first, :prompt_length] > 0
        prompt = tokens[first, :prompt_length][prompt_span]
        n_prompt = len(prompt)
        # The prompt once, then each completion; without sharing a unit is one sequence whose
        # tokens all carry its segment id (1, 2, … in the row).
        pieces = [(prompt, np.arange(n_prompt),
                   shared_prefix_ids(number, 0) if share_prompts else number,
                   experts[first, :prompt_length][prompt_span] if routed else None)]
        for branch, i in enumerate(unit, start=1):
          n_completion = int(completion_lens[i])
          pieces.append((tokens[i, prompt_length:prompt_length + n_completion],
                         n_prompt + np.arange(n_completion),
                         shared_prefix_ids(number, branch) if share_prompts else number,
                         experts[i, prompt_length:prompt_length + n_completion] if routed
                         else None))
        piece_starts = np.cumsum([start] + [len(piece[0]) for piece in pieces])
        for (piece_tokens, positions, segment, piece_experts), at in zip(pieces, piece_starts):
          span = slice(at, at + len(piece_tokens))
          out["tokens"][r, s, span] = piece_tokens
          out["positions"][r, s, span] = positions
          out["segment_ids"][r, s, span] = segment
          if routed:
            out["recorded_experts"][r, s, span] = piece_experts
        for (completion, _, _, _), at, i in zip(pieces[1:], piece_starts[1:], unit):
          n_completion = len(completion)
          # Completion token t is predicted by the hidden state of the token before it: the
          # prompt's last token for t = 0, then the completion's own.
          predictors = np.concatenate([[start + n_prompt - 1], at + np.arange(n_completion - 1)])
          head = slice(heads[group], heads[group] + n_completion)
          out["head_index"][group, s, head] = row_in_group * width + predictors
          out["head_targets"][group, s, head] = completion
          for name, head_name, _ in settings:
            out[head_name][group, s, head] = batch[name][i]
          out["token_index"][slot, s, :n_completion] = group * group_width + np.arange(
              head.start, head.stop)
          for name in SEQUENCE_FIELDS:
            if name in out:
              out[name][slot, s] = batch[name][i]
          row_of_slot[s, slot] = i
          heads[group] += n_completion
          slot += 1
        start = int(piece_starts[-1])
        packed_tokens += start - int(piece_starts[0])
  for name in ("head_index", "head_targets", *(head_name for _, head_name, _ in settings)):
    out[name] = out[name].reshape(row_groups, num_slices, -1, head_chunk)
  layout = PackedLayout(row_of_slot=row_of_slot, micro_batches_used=np.array(used),
                        tokens=packed_tokens, rows=sum(len(rows) for rows in slices))
  return out, layout


def unpack_sequences(values, layout: PackedLayout, num_rows: int) -> np.ndarray:
  """A per-sequence array of the packed layout, [N, S, …] (sequence slot n of slice s, as
  `pack_batch` lays out `SEQUENCE_FIELDS`), back in the padded batch's rows: [num_rows, …]. The
  inverse of that placement; rows `pack_batch` left out (no completion token) are zeros."""
  values = np.asarray(values)
  out = np.zeros((num_rows, *values.shape[2:]), values.dtype)
  slices, slots = np.nonzero(layout.row_of_slot >= 0)
  out[layout.row_of_slot[slices, slots]] = values[slots, slices]
  return out


def is_packed(batch) -> bool:
  return "segment_ids" in batch
