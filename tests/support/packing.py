"""A ragged batch (prompts and completions of many lengths) for the packed layout. (From
test_packing.py.)"""

import numpy as np

from tests.support.steps import CONFIG


B, P, T = 12, 5, 7


def ragged_batch(seed=0):
  """Prompts of 1–5 tokens, completions of 0–7 tokens (one row empty: a missing group's)."""
  rng = np.random.RandomState(seed)
  tokens = np.zeros((B, P + T), np.int32)
  attention = np.zeros((B, P + T), np.int32)
  completion = np.zeros((B, T), np.int32)
  prompt_lens = rng.randint(1, P + 1, B)
  completion_lens = rng.randint(1, T + 1, B)
  completion_lens[5] = T
  completion_lens[B - 1] = 0  # nothing to train on
  for row in range(B):
    p, c = prompt_lens[row], completion_lens[row]
    tokens[row, P - p:P + c] = rng.randint(1, CONFIG.vocab_size, p + c)
    attention[row, P - p:P + c] = 1
    completion[row, :c] = 1
  if completion_lens[B - 1] == 0:
    attention[B - 1] = 0
  return {"tokens": tokens, "attention_mask": attention, "completion_mask": completion,
              "advantages": rng.randn(B).astype(np.float32),
              "rewards": rng.rand(B).astype(np.float32),
              "behavior_logprobs": (-rng.rand(B, T) * completion).astype(np.float32)}


def assert_packed_logprobs_equal_padded(batch, **pack_options):
  """Packs `batch` (`packing.pack_batch(batch, **pack_options)`, one slice) and checks every
  sequence's log-probs and entropies against the padded forward's; returns (packed, layout,
  number of sequences checked)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from reasoning_rl.models.transformer import create_model
  from reasoning_rl.rl import packing
  from reasoning_rl.rl.logprobs import completion_logprobs, packed_completion_logprobs

  model = create_model(CONFIG, seed=0)
  padded_logprobs, padded_entropy = completion_logprobs(
      model, jnp.asarray(batch["tokens"]), jnp.asarray(batch["attention_mask"]), T)
  packed, layout = packing.pack_batch(batch, **pack_options)
  one_slice = {k: jnp.asarray(v[:, 0]) for k, v in packed.items()}
  logprobs, entropy = packed_completion_logprobs(model, one_slice)
  checked = 0
  for slot, row in enumerate(layout.row_of_slot[0]):
    if row < 0:
      continue
    n = batch["completion_mask"][row].sum()
    np.testing.assert_allclose(logprobs[slot, :n], padded_logprobs[row, :n], atol=2e-5)
    np.testing.assert_allclose(entropy[slot, :n], padded_entropy[row, :n], atol=2e-5)
    assert (logprobs[slot, n:] == 0).all()  # exact: past a sequence's end is masked, not computed
    checked += 1
  return packed, layout, checked


def assert_packed_step_applies_padded_gradient(config, batch, **pack_options):
  """The step's gradient and stats on `batch` packed (`pack_batch` with the config's slices and
  `pack_options`) equal the padded step's; returns the layout."""
  from reasoning_rl.rl import packing  # pylint: disable=import-outside-toplevel
  from tests.support.steps import assert_same_gradient, step_gradient

  ref_seed = 1 if config.beta > 0 else None
  padded, padded_stats = step_gradient(config, batch, ref_seed=ref_seed)
  packed_batch, layout = packing.pack_batch(batch, num_mini_batches=config.num_mini_batches,
                                            num_micro_batches=config.num_micro_batches,
                                            **pack_options)
  packed, packed_stats = step_gradient(config, packed_batch, ref_seed=ref_seed)
  assert_same_gradient(packed, padded)
  for name in ("loss", "kl", "entropy", "clip_frac", "nll"):
    if name in padded_stats:
      np.testing.assert_allclose(packed_stats[name], padded_stats[name], rtol=1e-4, atol=1e-6)
  return layout
