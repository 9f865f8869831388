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
