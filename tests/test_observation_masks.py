"""Environment-observation tokens of multi-turn episodes: in the sequence, out of the loss.

The reference gradient is written out here from its definition (token-mean GRPO at μ = 1, β = 0:
the clipped surrogate's gradient at ratio 1 is A·∇log π summed over the model's tokens, divided by
their count), not through `rl.losses`.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reasoning_rl.rl import batching, packing
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.rl.step_config import StepConfig
from tests.support import rollouts
from tests.support.packing import ragged_batch
from tests.support.steps import T, assert_same_gradient, fresh_params, make_batch, step_gradient


def with_observation_holes(batch, rows=(0, 2, 5), span=(2, 4)):
  """The batch with completion tokens [span) of `rows` turned into observations (loss mask 0)."""
  batch = {k: np.array(v) for k, v in batch.items()}
  for row in rows:
    batch["completion_mask"][row, span[0]:span[1]] = 0
  return batch


def explicit_gradient(batch):
  graphdef, params = fresh_params(0)
  mask = jnp.asarray(batch["completion_mask"], jnp.float32)
  advantages = jnp.asarray(batch["advantages"])

  def loss(p):
    logprobs = completion_logprobs(nnx.merge(graphdef, p), jnp.asarray(batch["tokens"]),
                                   jnp.asarray(batch["attention_mask"]), T)[0]
    return -jnp.sum(advantages[:, None] * logprobs * mask) / jnp.sum(mask)

  return [np.asarray(g, np.float64) for g in jax.tree.leaves(jax.grad(loss)(params))]


def test_observation_tokens_are_context_without_gradient():
  config = StepConfig(learning_rate=1e-2, loss_agg="token-mean")
  holes = with_observation_holes(make_batch(3))
  gradient, stats = step_gradient(config, holes)
  assert_same_gradient(gradient, explicit_gradient(holes))
  # The holes matter: training on every token gives another gradient.
  full, _ = step_gradient(config, {k: np.array(v) for k, v in make_batch(3).items()})
  scale = max(np.abs(g).max() for g in full)
  assert max(np.abs(a - b).max() for a, b in zip(gradient, full)) > 1e-2 * scale


def test_packed_rows_keep_the_observations_in_the_sequence():
  batch = with_observation_holes(ragged_batch(4), rows=(1, 5, 7), span=(1, 3))
  packed, layout = packing.pack_batch(batch, num_micro_batches=2)
  for s in range(packed["tokens"].shape[1]):
    for slot, row in enumerate(layout.row_of_slot[s]):
      if row >= 0:  # the whole completion, observations included, is in the packed sequence
        n = int(batch["attention_mask"][row, 5:].sum())  # ragged_batch's prompt length is 5
        assert int((packed["token_index"][slot, s] < packed["token_index"].max()).sum()) == n
        np.testing.assert_array_equal(packed["completion_mask"][slot, s],
                                      batch["completion_mask"][row])
  config = StepConfig(learning_rate=1e-2, num_micro_batches=2, logprob_chunk=8)
  padded_gradient, padded_stats = step_gradient(config, batch)
  packed_gradient, packed_stats = step_gradient(config, packed)
  assert_same_gradient(packed_gradient, padded_gradient)
  np.testing.assert_allclose(packed_stats["loss"], padded_stats["loss"], rtol=1e-4)


def test_build_batch_writes_the_loss_masks():
  group = rollouts.group(
      [1.0, 0.0], [[1, 2, 3, 4, 5], [7, 8]], prompt=[5, 6],
      logprobs=[[-0.1, -0.2, 0.0, 0.0, -0.3], [-0.5, -0.6]],
      loss_masks=[[1, 1, 0, 0, 1], [1, 1]]).with_advantages([0.5, -0.5])
  batch = batching.build_batch(group, num_groups=1, group_size=2, prompt_length=3,
                               completion_length=6, pad_id=0)
  np.testing.assert_array_equal(batch["completion_mask"], [[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch["attention_mask"][:, 3:], [[1, 1, 1, 1, 1, 0],
                                                                 [1, 1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch["tokens"][0], [0, 5, 6, 1, 2, 3, 4, 5, 0])
