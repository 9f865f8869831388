"""The FLOP model against hand counts, the matmuls JAX actually traces, and XLA's own count.

The independent reference is `traced_matmul_flops`: it walks the jaxpr of the real forward (or
gradient) and adds 2·M·N·K for every dot_general, entering remat and scan bodies (times their
length). It knows nothing of `reasoning_rl.flops`, so agreement checks both the formula and the
convention (which positions are projected, how many keys each query is scored against, what the
backward pass and rematerialisation recompute).
"""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from reasoning_rl import flops, planning
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import KVCache, create_model
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.rl.step_config import StepConfig
from tests.support.configs import TINY, _config


# D=16, F=24, V=40, L=2, H=4, K=2, Dh=8 (GQA), untied output projection.
SMALL = ModelConfig(model_type="llama", vocab_size=40, hidden_size=16, intermediate_size=24,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(item, "eqns"):
        yield item
      elif hasattr(getattr(item, "jaxpr", None), "eqns"):
        yield item.jaxpr


def traced_matmul_flops(jaxpr) -> int:
  """2·(output elements)·(contracted size) summed over every dot_general of a jaxpr."""
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    assert name not in ("cond", "while"), f"cannot count a data-dependent {name}"
    if name == "dot_general":
      (contracting, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contracting)
    repeats = eqn.params["length"] if name == "scan" else 1
    total += repeats * sum(traced_matmul_flops(sub) for sub in _sub_jaxprs(eqn))
  return total


def _model(config=SMALL):
  return nnx.split(create_model(config))


def test_matmul_weights_by_hand():
  # Per layer: q, o 16 x 4 x 8 = 512 each; k, v 16 x 2 x 8 = 256 each; gate, up, down 16 x 24 = 384.
  assert flops.matmul_weights(SMALL) == 2 * (2 * 512 + 2 * 256 + 3 * 384)  # 5376
  assert flops.attention_flops_per_key(SMALL) == 4 * 2 * 4 * 8  # 256
  # 3 rows x 10 tokens, all projected (2 x 16 x 40 = 1280 each), 10 keys per query.
  assert flops.forward_flops(SMALL, 30, 10) == 30 * (2 * 5376 + 1280 + 256 * 10)


def test_full_forward_equals_the_traced_matmuls():
  graphdef, params = _model()
  tokens = jnp.zeros((3, 10), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda p, x: nnx.merge(graphdef, p)(x))(params, tokens).jaxpr
  assert traced_matmul_flops(jaxpr) == flops.forward_flops(SMALL, 3 * 10, 10)


def test_decode_step_scores_the_attended_cache_slots(monkeypatch):
  # On a CPU a decode step's attention runs as products and sums (the same multiply-adds, but no
  # dot_general for this count to see); traced as on an accelerator, it is two einsums.
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  graphdef, params = _model()
  cache = KVCache.init(SMALL, 2, 32)
  for key_length in (None, 16):  # whole cache, or only the first 16 slots
    fn = lambda p, c: nnx.merge(graphdef, p).decode(  # noqa: E731
        jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32), c, jnp.zeros(2, jnp.int32),
        key_length=key_length)[0]
    jaxpr = jax.make_jaxpr(fn)(params, cache).jaxpr
    assert traced_matmul_flops(jaxpr) == flops.forward_flops(SMALL, 2, key_length or 32)


@pytest.mark.parametrize("remat", [False, True])
def test_training_update_equals_the_traced_gradient(remat):
  """One update = forward + backward (2x) + the chunks' recomputed logits (+ blocks with remat)."""
  graphdef, params = _model()
  rows, prompt, completion = 2, 4, 8
  tokens = jnp.zeros((rows, prompt + completion), jnp.int32)
  mask = jnp.ones_like(tokens)

  def loss(p):
    return completion_logprobs(nnx.merge(graphdef, p), tokens, mask, completion, chunk_size=4,
                               remat=remat)[0].sum()

  traced = traced_matmul_flops(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
  training, recomputed = flops.training_flops(
      SMALL, trained_tokens=rows * (prompt + completion), trained_context=prompt + completion,
      completion_tokens=rows * completion,
      passes=flops.TrainingPasses(  # chunks of 4 over 8 positions: the second one recomputed
          remat=remat, head_recomputed=flops.head_recomputed_share(4, completion)))
  assert traced == training + recomputed
  forward = traced_matmul_flops(jax.make_jaxpr(loss)(params).jaxpr)
  assert training == 3 * forward


def test_xla_cost_analysis_agrees_within_five_percent():
  """XLA also counts elementwise work (norms, softmax, RoPE): a few per cent at these widths."""
  config = ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=256,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       attention_bias=True)
  graphdef, params = _model(config)
  tokens = jnp.zeros((2, 32), jnp.int32)
  compiled = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)).lower(params, tokens).compile()
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  expected = flops.forward_flops(config, 2 * 32, 32)
  assert analysis["flops"] == pytest.approx(expected, rel=0.05)


def test_rl_step_by_hand():
  passes = flops.TrainingPasses(epochs=2, reference_forward=True, old_logprob_forward=True)
  step = flops.rl_step_flops(SMALL, prompts=2, prompt_tokens=10, prompt_context=8,
                             generated_tokens=12, decode_context=16, trained_tokens=44,
                             trained_context=22, completion_tokens=24, passes=passes)
  per_token, output, per_key = 2 * 5376, 1280, 256
  assert step.prefill == 10 * (per_token + per_key * 8) + 2 * output
  assert step.decode == 12 * (per_token + output + per_key * 16)
  row_forward = 44 * (per_token + per_key * 22) + 24 * output
  assert step.training == (3 * 2 + 1 + 1) * row_forward
  assert step.recomputation == 2 * 24 * output
  assert step.generation == step.prefill + step.decode
  assert step.total == step.generation + step.training
  assert step.executed == step.total + step.recomputation


@pytest.mark.parametrize("kwargs", [
    {}, {"num_iterations": 2}, {"num_mini_batches": 2}, {"algorithm": "ppo"},
    {"algorithm": "sft", "num_iterations": 2}, {"beta": 0.1, "remat": True}])
def test_passes_follow_the_step(kwargs):
  config = StepConfig(**kwargs)
  passes = flops.TrainingPasses.of_step(config)
  assert passes.old_logprob_forward == config.needs_old_logprobs
  assert passes.reference_forward == (config.beta > 0)
  assert (passes.epochs, passes.remat) == (config.num_iterations, config.remat in (True, "full"))


def test_planner_counts_with_the_flop_model():
  c = _config()  # 4 prompts x 4 samples, prompt 32 + completion 16 tokens
  c.beta = 0.1
  expected = flops.rl_step_flops(
      TINY, prompts=4, prompt_tokens=4 * 32, prompt_context=32, generated_tokens=16 * 16,
      decode_context=48, trained_tokens=16 * 48, trained_context=48, completion_tokens=16 * 16,
      passes=flops.TrainingPasses(reference_forward=True, head_recomputed=0.5))  # 8 of 16
  assert planning.step_flops(c, TINY) == expected
  assert planning.plan(c, TINY, target={"tpu": "v5p", "num_devices": 16}).throughput.flops == (
      expected)
