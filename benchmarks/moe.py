"""Mixture-of-experts speed: the grouped matmul's implementations at a layer's shape, and one
sparse layer's forward + backward against the dense MLP of the same active FLOPs.

Usage:
  python -m benchmarks.moe                      # SmolLM2 upcycled: D 576, F 1536, E 4, k 2
  python -m benchmarks.moe --shape qwen3_30b    # Qwen3-30B-A3B's layer: D 2048, F 768, E 128, k 8
  python -m benchmarks.moe --tokens 4096 --repeats 3

Rows of the first table (one projection, [N·k, D] x [E, D, F], routed as a random router would):
- dense (same FLOPs): one [N·k, D]·[D, F] matmul, the floor a grouped matmul can reach;
- ragged_dot / tiled / megablox: `reasoning_rl.kernels.grouped_matmul` (megablox runs in Pallas
  interpret mode off TPU and is left out there unless --megablox);
- dense per expert (loop): every expert multiplies every row and a mask keeps its own, the
  dense-per-expert baseline (E times the FLOPs).
The second table times a whole sparse layer (`reasoning_rl.models.moe.MoE`, router included)
forward and forward + backward against the dense MLP a token runs through k times; the third a
small model's whole training step (`rl.step.TrainStep`) and the engine's decoding, MoE against
the dense model of the same active width.
Results (date, CPU, command) go in benchmarks/RESULTS.md.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from reasoning_rl.kernels.grouped_matmul import grouped_matmul

SHAPES = {"smollm2_upcycled": dict(hidden=576, intermediate=1536, experts=4, top_k=2),
          "qwen3_30b": dict(hidden=2048, intermediate=768, experts=128, top_k=8)}


def best_seconds(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # compile
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def dense_per_expert(lhs, rhs, group_sizes):
  """Every expert on every row, each row keeping its own expert's product."""
  ends = jnp.cumsum(group_sizes)
  expert_of_row = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")
  out = jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype)
  for e in range(rhs.shape[0]):
    out = jnp.where((expert_of_row == e)[:, None], lhs @ rhs[e], out)
  return out


def grouped_table(shape, tokens: int, repeats: int, megablox: bool):
  rng = np.random.RandomState(0)
  d, f, e, k = shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"]
  rows = tokens * k
  lhs = jnp.asarray(rng.randn(rows, d), jnp.float32)
  rhs = jnp.asarray(rng.randn(e, d, f) * 0.02, jnp.float32)
  sizes = jnp.asarray(np.bincount(rng.randint(0, e, rows), minlength=e), jnp.int32)
  dense_rhs = rhs[0]
  variants = [("dense (same FLOPs)", lambda a, b: a @ dense_rhs)]
  names = ["ragged_dot", "tiled"] + (["megablox"] if megablox else [])
  variants += [(name, lambda a, b, name=name: grouped_matmul(a, b, sizes, implementation=name))
               for name in names]
  if e <= 16:
    variants.append(("dense per expert (loop)", lambda a, b: dense_per_expert(a, b, sizes)))
  flops = 2.0 * rows * d * f
  print(f"grouped matmul: {rows} rows ({tokens} tokens x top-{k}) x [{e}, {d}, {f}]")
  print(f"  {'implementation':<26}{'forward ms':>12}{'fwd+bwd ms':>12}{'GFLOP/s fwd':>13}")
  for name, fn in variants:
    forward = jax.jit(fn)
    backward = jax.jit(jax.grad(lambda a, b, fn=fn: jnp.sum(fn(a, b) ** 2), argnums=(0, 1)))
    fwd = best_seconds(lambda: forward(lhs, rhs), repeats)
    both = best_seconds(lambda: backward(lhs, rhs), repeats)
    print(f"  {name:<26}{fwd * 1e3:12.1f}{both * 1e3:12.1f}{flops / fwd / 1e9:13.1f}")


def layer_table(shape, tokens: int, repeats: int):
  from flax import nnx

  from reasoning_rl.models.config import ModelConfig, MoEConfig
  from reasoning_rl.models.transformer import MLP
  from reasoning_rl.models.moe import MoE

  d, f, e, k = shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"]
  config = ModelConfig(model_type="mixtral", vocab_size=8, hidden_size=d, intermediate_size=f,
                       num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                       moe=MoEConfig(num_experts=e, experts_per_token=k, intermediate_size=f,
                                     sparse_layers=(True,), normalize_top_k=True))
  rngs = nnx.Rngs(params=0)
  sparse, dense = MoE(config, param_dtype=jnp.float32, rngs=rngs), MLP(
      config, param_dtype=jnp.float32, rngs=rngs)
  x = jnp.asarray(np.random.RandomState(1).randn(1, tokens, d), jnp.float32)
  mask = jnp.ones((1, tokens), bool)
  print(f"\nlayer: {tokens} tokens, D {d}; a sparse layer of {e} experts (top-{k}, width {f}) "
        f"against the dense MLP of width {f} run {k} times (the same matmul FLOPs)")
  print(f"  {'layer':<26}{'forward ms':>12}{'fwd+bwd ms':>12}")
  for name, module, run in (
      ("sparse (router + experts)", sparse, lambda m, x: m(x, mask)[0]),
      (f"dense MLP x {k}", dense, lambda m, x: sum(m(x) for _ in range(k)))):
    graphdef, state = nnx.split(module)

    def loss(state, x, graphdef=graphdef, run=run):
      return jnp.sum(run(nnx.merge(graphdef, state), x) ** 2)

    forward = jax.jit(lambda state, x, graphdef=graphdef, run=run:
                      run(nnx.merge(graphdef, state), x))
    grad = jax.jit(jax.grad(loss))
    fwd = best_seconds(lambda: forward(state, x), repeats)
    both = best_seconds(lambda: grad(state, x), repeats)
    print(f"  {name:<26}{fwd * 1e3:12.1f}{both * 1e3:12.1f}")


def model_table(repeats: int):
  """A whole training step and decoding of a small MoE model against the dense model with the same
  attention and the active MLP width (k experts' worth), on this machine."""
  import dataclasses

  import optax
  from flax import nnx

  from reasoning_rl.models.config import ModelConfig, MoEConfig
  from reasoning_rl.models.transformer import create_model
  from reasoning_rl.rl.step import TrainStep
  from reasoning_rl.rl.step_config import StepConfig
  from reasoning_rl.sampler.engine import Engine
  from reasoning_rl.sampler.rollout import generate_groups
  from reasoning_rl.sampler.sampling import SamplingParams

  base = ModelConfig(model_type="qwen3", vocab_size=4096, hidden_size=256, intermediate_size=512,
                     num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, qk_norm=True)
  moe = dataclasses.replace(base, model_type="qwen3_moe", moe=MoEConfig(
      num_experts=8, experts_per_token=2, intermediate_size=256, sparse_layers=(True,) * 4,
      normalize_top_k=True))
  rows, prompt, completion = 16, 64, 64
  rng = np.random.RandomState(0)
  batch = dict(tokens=jnp.asarray(rng.randint(1, 4096, (rows, prompt + completion))),
               attention_mask=jnp.ones((rows, prompt + completion), jnp.int32),
               completion_mask=jnp.ones((rows, completion), jnp.int32),
               advantages=jnp.asarray(rng.randn(rows).astype(np.float32)))
  prompts = [list(rng.randint(1, 4096, 48)) for _ in range(8)]
  print(f"\nmodel: 4 layers, D 256, 8 heads; dense MLP 512 vs 8 experts of 256 (top-2: the same "
        f"active width); step on {rows} rows of {prompt} + {completion}; decode of 8 prompts x 4 "
        "samples x 32 tokens")
  print(f"  {'model':<26}{'params (M)':>11}{'step s':>9}{'decode tok/s':>14}")
  for name, config in (("dense", base), ("MoE 8 experts, top-2", moe)):
    model = create_model(config, seed=0)
    graphdef, params = nnx.split(model)
    step = TrainStep(graphdef, StepConfig())
    step.optimizer = optax.sgd(lambda count: 1e-3)
    state = [step.init_state(jax.tree.map(jnp.array, params))]

    def run_step():
      state[0], stats = step(state[0], batch)
      return stats["loss"]

    step_s = best_seconds(run_step, repeats)
    engine = Engine(model, max_concurrent_decodes=32, max_prefill_length=64,
                    max_decode_length=32, steps_per_call=16)

    def decode():
      return generate_groups(engine, prompts, num_samples=4, max_new_tokens=32,
                             sampling=SamplingParams(temperature=1.0), seed=1)

    decode()  # compile
    start = time.perf_counter()
    tokens = sum(len(c.completion_ids) for c in decode())
    print(f"  {name:<26}{config.num_params() / 1e6:11.2f}{step_s:9.3f}"
          f"{tokens / (time.perf_counter() - start):14.0f}")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2_upcycled")
  parser.add_argument("--tokens", type=int, default=2048)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--megablox", action="store_true",
                      help="also time the Pallas TPU kernel (interpret mode off TPU: slow)")
  args = parser.parse_args()
  print(f"backend {jax.default_backend()}, {jax.device_count()} device(s)")
  grouped_table(SHAPES[args.shape], args.tokens, args.repeats, args.megablox)
  layer_table(SHAPES[args.shape], args.tokens, args.repeats)
  model_table(args.repeats)


if __name__ == "__main__":
  main()
