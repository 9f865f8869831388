"""Padding-free training: the packed layout holds every sequence once, packed sequences compute
what they compute alone, and the step's gradient on a packed batch equals the padded step's."""

import jax
import numpy as np
import pytest

from reasoning_rl import sharding
from reasoning_rl.rl import packing
from reasoning_rl.rl.step_config import StepConfig
from tests.support.packing import (
    B, P, T, assert_packed_logprobs_equal_padded, assert_packed_step_applies_padded_gradient,
    ragged_batch)
from tests.support.steps import (
    assert_same_gradient, gradient_probe, run_step, step_gradient)


@pytest.mark.parametrize("mini, micro, groups", [(1, 1, 1), (2, 2, 1), (1, 3, 2), (1, 2, 3)])
def test_every_sequence_is_packed_once_in_its_own_mini_batch(mini, micro, groups):
  batch = ragged_batch()
  packed, layout = packing.pack_batch(batch, num_mini_batches=mini, num_micro_batches=micro,
                                      row_groups=groups, head_chunk=8)
  slices, rows_per_micro = mini * micro, B // (mini * micro)
  assert packed["tokens"].shape == (rows_per_micro, slices, P + T)  # a padded micro-batch's
  assert packed["head_index"].shape[0] == groups
  assert packed["token_index"].shape[0] % groups == 0
  assert sorted(layout.row_of_slot[layout.row_of_slot >= 0].tolist()) == list(range(B - 1))
  head_index = packed["head_index"].reshape(groups, slices, -1)
  head_targets = packed["head_targets"].reshape(groups, slices, -1)
  group_width = head_index.shape[2]
  rows_per_group = rows_per_micro // groups
  for s in range(slices):
    for slot, row in enumerate(layout.row_of_slot[s]):
      if row < 0:
        assert not packed["completion_mask"][slot, s].any()
        continue
      assert row % mini == s // micro  # mini-batch k holds rows k, k + M, …
      n = batch["completion_mask"][row].sum()
      group, entry = np.divmod(packed["token_index"][slot, s, :n], group_width)
      assert (group == group[0]).all()
      completion = batch["tokens"][row, P:P + n]
      np.testing.assert_array_equal(head_targets[group, s, entry], completion)
      # The head reads the position before each completion token, in the group's own rows.
      packed_row, column = np.divmod(head_index[group, s, entry], P + T)
      packed_row += group[0] * rows_per_group
      np.testing.assert_array_equal(packed["tokens"][packed_row, s, column + 1], completion)
      segments = packed["segment_ids"][packed_row, s, column + 1]
      assert (segments == segments[0]).all() and segments[0] > 0
      prompt = batch["tokens"][row, :P][batch["attention_mask"][row, :P] > 0]
      begin = column[0] + 1 - len(prompt)
      r = packed_row[0]
      np.testing.assert_array_equal(packed["tokens"][r, s, begin:begin + len(prompt)], prompt)
      np.testing.assert_array_equal(packed["positions"][r, s, begin:begin + len(prompt) + n],
                                    np.arange(len(prompt) + n))
      np.testing.assert_array_equal(packed["behavior_logprobs"][slot, s],
                                    batch["behavior_logprobs"][row])
      assert packed["advantages"][slot, s] == batch["advantages"][row]
      assert (packed["token_index"][slot, s, n:] == groups * group_width).all()
  assert layout.tokens == int(batch["attention_mask"].sum())
  assert (packed["head_targets"] >= 0).sum() == batch["completion_mask"].sum()


def test_short_sequences_fill_fewer_micro_batches():
  batch = ragged_batch()
  batch["completion_mask"][:, 2:] = 0  # completions of at most 2 tokens
  batch["attention_mask"][:, P + 2:] = 0
  packed, layout = packing.pack_batch(batch, num_micro_batches=4)
  used = layout.micro_batches_used[0]
  assert used == -(-layout.rows // 3) < 4  # micro-batches of 3 rows; the padded step fills 4
  assert packed["completion_mask"][:, :used].any(axis=(0, 2)).all()
  assert not packed["completion_mask"][:, used:].any()


def test_packed_sequences_compute_what_they_compute_alone():
  packed, _, _ = assert_packed_logprobs_equal_padded(ragged_batch(1), head_chunk=8)
  assert packed["segment_ids"].max() > 1  # rows really hold several sequences


STEP_CASES = {
    "grpo seq-mean, 2 micro-batches": {"num_micro_batches": 2},
    "token-mean, 2 mini-batches × 2 epochs": {"loss_agg": "token-mean", "num_mini_batches": 2,
                                                   "num_iterations": 2},
    "dr-grpo, beta, importance correction": {
        "loss_agg": "seq-mean-token-sum-norm", "beta": 0.05, "is_correction": "sequence-truncate",
        "num_micro_batches": 3},
    "gspo": {"loss_type": "gspo", "num_micro_batches": 2},
    "sft": {"algorithm": "sft", "num_micro_batches": 2},
}


@pytest.mark.parametrize("overrides", STEP_CASES.values(), ids=STEP_CASES.keys())
def test_packed_step_applies_the_padded_steps_gradient(overrides):
  # 8-position head chunks: most of a group's chunks hold no completion token and are skipped
  config = StepConfig(learning_rate=1e-2, logprob_chunk=8, **overrides)
  assert_packed_step_applies_padded_gradient(config, ragged_batch(2))


def test_skipped_micro_batches_change_nothing():
  config = StepConfig(learning_rate=1e-2, num_micro_batches=4, beta=0.04, logprob_chunk=8)
  batch = ragged_batch(5)
  batch["completion_mask"][:, 2:] = 0
  batch["attention_mask"][:, P + 2:] = 0
  packed_batch, layout = packing.pack_batch(batch, num_micro_batches=4)
  assert layout.micro_batches_used[0] < 4
  padded, padded_stats = step_gradient(config, batch, ref_seed=1)
  packed, packed_stats = step_gradient(config, packed_batch, ref_seed=1)
  assert_same_gradient(packed, padded)
  for name in ("loss", "kl", "entropy", "ratio/min", "ratio/max"):
    np.testing.assert_allclose(packed_stats[name], padded_stats[name], rtol=1e-4, atol=1e-6)


def test_packed_ppo_equals_padded_ppo():
  """PPO: per-token values read off the packed hidden states, GAE and whitening per sequence."""
  config = StepConfig(algorithm="ppo", learning_rate=1e-2, num_micro_batches=2)
  batch = ragged_batch(3)
  packed_batch, _ = packing.pack_batch(batch, num_micro_batches=2)
  padded, padded_stats = step_gradient(config, batch)
  packed, packed_stats = step_gradient(config, packed_batch)
  assert_same_gradient(packed, padded)
  np.testing.assert_allclose(packed_stats["loss"], padded_stats["loss"], rtol=1e-4)
  heads = [run_step(config, b, optimizer=gradient_probe())[0].value_head
           for b in (batch, packed_batch)]
  assert_same_gradient(*[[np.asarray(x, np.float64) for x in jax.tree.leaves(h)] for h in heads])


def test_sharded_packed_step_equals_one_device():
  config = StepConfig(learning_rate=1e-2, num_micro_batches=3, beta=0.04, logprob_chunk=8)
  batch = ragged_batch(4)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  packed_batch, _ = packing.pack_batch(batch, num_micro_batches=3, row_groups=4, head_chunk=8)
  sharded, _ = step_gradient(config, packed_batch, mesh=mesh, ref_seed=1)
  alone, _ = step_gradient(config, packed_batch, ref_seed=1)
  assert_same_gradient(sharded, alone)


def test_a_batch_packed_for_other_slices_is_refused():
  packed_batch, _ = packing.pack_batch(ragged_batch(), num_micro_batches=2)
  config = StepConfig(num_micro_batches=4)
  with pytest.raises(Exception, match="num_micro_batches"):
    run_step(config, packed_batch)


def test_packed_shapes_do_not_depend_on_the_lengths():
  """One compiled step for a run: batches of other lengths pack to the same shapes."""
  shapes = []
  for seed, budget in ((0, T), (1, 2), (2, T)):
    batch = ragged_batch(seed)
    batch["completion_mask"][:, budget:] = 0
    batch["attention_mask"][:, P + budget:] = 0
    packed, _ = packing.pack_batch(batch, num_micro_batches=2, row_groups=2, head_chunk=8)
    shapes.append({name: value.shape for name, value in packed.items()})
  assert shapes[0] == shapes[1] == shapes[2]
