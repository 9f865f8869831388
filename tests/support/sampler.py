"""A tiny random model with logits far from ties, its prompts, and plain references for the engine
(full-forward greedy decoding, partial-rollout rounds). (From test_sampler_engine.py,
test_partial_rollouts_sampler.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model
from reasoning_rl.sampler import SamplingParams
from reasoning_rl.sampler.rollout import Completion, Unfinished, stream_groups


CONFIG = ModelConfig(model_type="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True)


PROMPTS = [[3, 14, 15, 92, 65], [35, 89], list(range(10, 30)), [7] * 9, [50, 51, 52],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [60]]


GREEDY = SamplingParams(temperature=0.0)


def tiny_model(seed: int):
  """A random model whose weights are perturbed by N(0, 0.1²): logits far from ties."""
  return perturbed(create_model(CONFIG, seed=seed), seed)


def perturbed(model, seed: int):
  """`model` with N(0, 0.1²) added to every weight (in place; returned)."""
  state = nnx.state(model, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(seed + 100), len(jax.tree.leaves(state))))
  nnx.update(model, jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape),
                                 state))
  return model


_forward = jax.jit(lambda state, ids, graphdef: nnx.merge(graphdef, state)(ids),
                   static_argnums=2)


def full_forward_greedy(model, prompt, steps, width=64):
  """Greedy continuation recomputed from scratch with the training forward (no KV cache).

  Rows are right-padded to a fixed width (causal attention: padding after a token cannot change
  its logits), so the forward compiles once.
  """
  graphdef, state = nnx.split(model)
  ids = list(prompt)
  for _ in range(steps):
    padded = np.zeros((1, width), np.int32)
    padded[0, :len(ids)] = ids
    logits = _forward(state, jnp.asarray(padded), graphdef)
    ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
  return ids[len(prompt):]


def by_key(completions):
  return {(c.prompt_id, c.sample_index): c for c in completions}


class AngleTokenizer:
  """Decodes id i as "<i>", so stop strings can name single tokens unambiguously."""

  def decode(self, ids, skip_special_tokens=False):
    return "".join(f"<{int(i)}>" for i in ids)


KWARGS = dict(num_samples=2, sampling=SamplingParams(temperature=1.0, top_k=20),
              max_new_tokens=12, seed=5)


IDS = [40, 41, 42, 43]


def run_rounds(engine, prompts, *, calls_per_round, update=None):
  """Completions of `prompts` over rounds of `calls_per_round` generate calls each, continuing
  every unfinished sample in the next round; `update(round)` may change the weights between."""
  finished, unfinished, rounds = {}, [], 0
  pending = [(p, g) for p in IDS for g in range(KWARGS["num_samples"])]
  while pending:
    calls = iter(range(calls_per_round))
    out = list(stream_groups(engine, prompts, prompt_ids=IDS, samples=pending, resume=unfinished,
                             round_over=lambda: next(calls, None) is None, **KWARGS))
    unfinished = [item for item in out if isinstance(item, Unfinished)]
    finished.update(by_key(c for c in out if isinstance(c, Completion)))
    pending = [(u.prompt_id, u.sample_index) for u in unfinished]
    rounds += 1
    if update is not None and pending:
      update(rounds)
  return finished, rounds
