"""Shared prompts in packed rows (`algo.shared_prompts`): the attention mask of a shared prefix,
each prompt laid out once per row, and the same log-probs and gradients as the padded step."""

import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.kernels import reference
from reasoning_rl.rl import packing
from reasoning_rl.rl.host_batch import host_batch_with_layout
from reasoning_rl.rl.step_config import StepConfig
from tests.support.packing import (
    B, P, T, assert_packed_logprobs_equal_padded, assert_packed_step_applies_padded_gradient,
    ragged_batch)

GROUP = 4  # completions per prompt


def grouped_batch(seed=0):
  """`ragged_batch` whose rows come in groups of GROUP sharing their group's first prompt."""
  batch = ragged_batch(seed)
  tokens, attention = batch["tokens"], batch["attention_mask"]
  for row in range(B):
    first = row - row % GROUP
    if attention[row].any():
      tokens[row, :P], attention[row, :P] = tokens[first, :P], attention[first, :P]
  return batch


def test_a_shared_prefix_is_seen_by_each_branch_and_branches_not_by_each_other():
  # one row: unit 1 = prompt (2 tokens) + completions of 2 and 1 tokens, then a plain sequence
  # of unit 0 (id 3) and a padding position
  ids = np.array([[reference.shared_prefix_ids(1, b) for b in (0, 0, 1, 1, 2)] + [3, 3, 0]])
  positions = np.array([[0, 1, 2, 3, 2, 0, 1, -1]])
  mask = np.asarray(reference.allowed(jnp.asarray(positions), jnp.asarray(positions), window=None,
                                      segment_ids=jnp.asarray(ids)))[0]
  expected = np.zeros((8, 8), bool)
  expected[0, 0] = True
  expected[1, :2] = True
  expected[2, :3] = True
  expected[3, :4] = True
  expected[4, [0, 1, 4]] = True  # the second completion: the prompt and itself, not the first
  expected[5, 5] = True
  expected[6, 5:7] = True
  np.testing.assert_array_equal(mask, expected)


def test_each_prompt_is_laid_out_once_per_row_and_every_completion_once():
  batch = grouped_batch()
  plain, plain_layout = packing.pack_batch(batch, row_factor=2, num_micro_batches=2,
                                           head_chunk=8)
  shared, layout = packing.pack_batch(batch, row_factor=2, num_micro_batches=2, head_chunk=8,
                                      share_prompts=True)
  assert shared["tokens"].shape == plain["tokens"].shape  # the same shapes: one compiled step
  completions = int(batch["completion_mask"].sum())
  ids = shared["segment_ids"]
  prefixes = (ids > 0) & (ids % reference.BRANCHES == 0)
  units = {(r, s, ids[r, s, w]) for r, s, w in zip(*np.nonzero(prefixes))}
  prompt_tokens = sum(int(batch["attention_mask"][row - row % GROUP, :P].sum())
                      for row in range(B) if batch["attention_mask"][row].any())
  assert layout.tokens == (ids > 0).sum() == prefixes.sum() + completions
  assert prefixes.sum() < prompt_tokens == plain_layout.tokens - completions
  assert len(units) < B - 1  # some rows hold a prompt with several of its completions
  for r, s, unit in units:  # a unit's prompt is its group's, once
    members = layout.row_of_slot[s][[slot for slot in range(B)
                                     if layout.row_of_slot[s, slot] >= 0]]
    prompt = shared["tokens"][r, s][ids[r, s] == unit]
    groups = {row // GROUP for row in members
              if np.array_equal(batch["tokens"][row, :P][batch["attention_mask"][row, :P] > 0],
                                prompt)}
    assert len(groups) == 1
  np.testing.assert_array_equal(np.sort(shared["head_targets"][shared["head_targets"] >= 0]),
                                np.sort(batch["tokens"][:, P:][batch["completion_mask"] > 0]))


def test_prompts_routed_differently_are_not_shared():
  batch = grouped_batch()
  experts = np.zeros((B, P + T, 1, 2), np.int32)
  experts[1, :P] = 1  # row 1's prompt went to other experts than its group's
  batch["recorded_experts"] = experts
  shared, _ = packing.pack_batch(batch, row_factor=4, share_prompts=True, head_chunk=8)
  rows_with_experts = shared["recorded_experts"][..., 0, 0] == 1
  # row 1's prompt has a copy of its own, carrying its experts
  assert rows_with_experts.sum() == batch["attention_mask"][1, :P].sum()


def test_shared_prompts_compute_what_each_sequence_computes_alone():
  _, _, checked = assert_packed_logprobs_equal_padded(grouped_batch(1), row_factor=2, head_chunk=8,
                                                      share_prompts=True)
  assert checked == B - 1


STEP_CASES = {
    "grpo seq-mean, 2 micro-batches": {"num_micro_batches": 2},
    "token-mean, 2 mini-batches × 2 epochs": {"loss_agg": "token-mean", "num_mini_batches": 2,
                                                   "num_iterations": 2},
    "beta, importance correction": {"beta": 0.05, "is_correction": "sequence-truncate",
                                    "num_micro_batches": 3},
    "ppo": {"algorithm": "ppo", "num_micro_batches": 2},
}


@pytest.mark.parametrize("overrides", STEP_CASES.values(), ids=STEP_CASES.keys())
def test_shared_prompts_apply_the_padded_steps_gradient(overrides):
  config = StepConfig(learning_rate=1e-2, logprob_chunk=8, **overrides)
  batch = grouped_batch(2)
  layout = assert_packed_step_applies_padded_gradient(config, batch, row_factor=2,
                                                      share_prompts=True)
  assert layout.tokens < int(batch["attention_mask"].sum())  # prompts really were shared


def test_rows_k_times_as_long_project_the_head_in_chunks_a_kth_the_padded_size():
  batch = grouped_batch()
  for factor in (1, 2):
    config = StepConfig(packing=True, packed_row_factor=factor, logprob_chunk=4,
                        shared_prompts=True)
    packed, _ = host_batch_with_layout(config, batch)
    assert packed["head_index"].shape[-1] == 4 * B // factor  # a padded chunk: 4 steps × B rows
