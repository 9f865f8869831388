"""Compile time of the training step vs depth: the block stack as a Python loop vs scanned.

A Qwen2.5-7B-shaped model (hidden 3584, MLP 18944, 28 query / 4 KV heads of 128, vocabulary
152064, q/k/v biases; bfloat16 compute, float32 master weights) cut to a few layers or many; its
GRPO step (`reasoning_rl.rl.step.TrainStep`, β = 0.04 with the frozen reference) is lowered and
compiled ahead of time from abstract shapes (`jax.ShapeDtypeStruct` leaves via `jax.eval_shape`),
so no weight is ever allocated and a 7B-wide model compiles on a small machine. Prints, per depth,
the seconds of `lower` and of `compile` for each layout, the loop / scan ratio, and the compiled
step's temporary memory (XLA's analysis) in each layout.

Usage: python -m benchmarks.scan_compile [--layers 2 4 8 16 28] [--remat full]
         [--rows 8] [--prompt_length 256] [--completion_length 256]
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import REMAT_POLICIES, abstract_model
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig

QWEN25_7B = ModelConfig(
    model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
    num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1e6, attention_bias=True, tie_word_embeddings=False)


def abstract_batch(rows: int, prompt: int, completion: int) -> dict:
  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)

  return dict(tokens=spec((rows, prompt + completion), jnp.int32),
              attention_mask=spec((rows, prompt + completion), jnp.int32),
              completion_mask=spec((rows, completion), jnp.int32),
              advantages=spec((rows,), jnp.float32))


def compile_seconds(num_layers: int, scan_layers: bool, args) -> tuple[float, float, float]:
  """(lower s, compile s, the compiled step's temporary GiB by XLA's memory analysis) of one
  step of the model cut to `num_layers`."""
  config = dataclasses.replace(QWEN25_7B, num_layers=num_layers, layer_types=None)
  graphdef, params = abstract_model(config, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                    scan_layers=scan_layers)
  step = TrainStep(graphdef, StepConfig(beta=0.04, learning_rate=1e-6, remat=args.remat,
                                        compute_dtype="bfloat16"))
  reference = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
  state = jax.eval_shape(lambda p, r: step.init_state(p, ref_params=r), params, reference)
  batch = abstract_batch(args.rows, args.prompt_length, args.completion_length)
  start = time.perf_counter()
  lowered = jax.jit(step._step_on_mesh).lower(state, batch)  # pylint: disable=protected-access
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  compiled_at = time.perf_counter()
  temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
  return lowered_at - start, compiled_at - lowered_at, temp


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 28])
  parser.add_argument("--remat", default="full", choices=REMAT_POLICIES)
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--prompt_length", type=int, default=256)
  parser.add_argument("--completion_length", type=int, default=256)
  args = parser.parse_args()
  print(f"backend {jax.default_backend()}, remat {args.remat}, {args.rows} rows of "
        f"{args.prompt_length} + {args.completion_length} tokens")
  print("| layers | loop: lower s | loop: compile s | scan: lower s | scan: compile s "
        "| loop / scan (total) | loop: temp GiB | scan: temp GiB |")
  print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
  for layers in args.layers:
    loop = compile_seconds(layers, False, args)
    scan = compile_seconds(layers, True, args)
    print(f"| {layers} | {loop[0]:.1f} | {loop[1]:.1f} | {scan[0]:.1f} | {scan[1]:.1f} "
          f"| {sum(loop[:2]) / sum(scan[:2]):.1f} | {loop[2]:.1f} | {scan[2]:.1f} |", flush=True)


if __name__ == "__main__":
  main()
