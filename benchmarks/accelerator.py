"""The GRPO training step and greedy decoding on an accelerator, attention kernels on vs off, beside
torch / transformers doing the same work on the same device.

Made for a lent GPU (or TPU) where the SmolLM2 GGUF is not installed: the model is SmolLM2-135M's
shape (Llama, 30 layers, 576 wide, 9 query / 3 KV heads, 49152-token vocabulary) with random
weights on both sides — speed does not depend on the values. bfloat16 compute over float32
master weights on our side (the trainer's mixed precision, reasoning_rl/precision.py); torch
trains float32 weights under `torch.autocast(bfloat16)`, the same arithmetic.

Usage: PYTHONPATH=. python -m benchmarks.accelerator [--steps B×P+T,…] [--decode B×P+T,…]
           [--kernels reference,auto] [--micro_batches 4] [--beta 0.04] [--repeats 3]
           [--out FILE.json] [--small]

1. Step: one `reasoning_rl.rl.step.TrainStep` call (π_old, reference and policy forwards per
   micro-batch, PPO-clipped surrogate + β·k3 KL, backward, AdamW) on B rows of P prompt + T
   completion random tokens, per `model.attention_kernel`; median seconds of `repeats` after a
   warm-up, and the compiled program's temporary bytes. torch: the same loss as TRL's
   GRPOTrainer computes it (the frozen reference forward, the policy forward projecting only
   completion positions, backward, gradient clipping, AdamW) with SDPA attention.
2. Decode: the sampler `Engine` (B slots, greedy, exactly T new tokens after P-token prompts),
   decode tokens/s (prefills excluded) and end to end (prompts prefilled `--prefill_batch` per
   call, as rollouts do; 'one' per call before 2026-11-29); transformers `generate` on the same
   device (static shapes: no EOS, `min_new_tokens = T`), end to end.
`--small` shrinks the model and shapes so the script runs on a CPU as a check of itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.sampler import run_ours
from benchmarks.train_step import random_batch
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64, vocab_size=49152)
SMALL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, vocab_size=256)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
  """"64x256+1024,16x256+4096" → [(B, P, T), …]."""
  shapes = []
  for item in filter(None, text.split(",")):
    rows, lengths = item.split("x")
    prompt, completion = lengths.split("+")
    shapes.append((int(rows), int(prompt), int(completion)))
  return shapes


def _median_s(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # warm-up: compilation and first-call allocations
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def our_step(config: ModelConfig, kernel: str, shape, args) -> dict:
  rows, prompt, completion = shape
  model = create_model(config, dtype=jnp.bfloat16).use_attention_kernel(kernel)
  graphdef, params = nnx.split(model)
  reference = jax.tree.map(jnp.copy, params) if args.beta > 0 else None
  step = TrainStep(graphdef, StepConfig(beta=args.beta, learning_rate=1e-6,
                                        num_micro_batches=args.micro_batches,
                                        compute_dtype="bfloat16"))
  state = step.init_state(params, ref_params=reference)
  batch = jax.tree.map(jnp.asarray, random_batch(rows, prompt, completion, config.vocab_size))
  holder = {"state": state}

  def once():
    holder["state"], stats = step(holder["state"], batch)
    return stats

  result = {"part": "step", "side": f"reasoning_rl attention_kernel={kernel}", "rows": rows,
            "prompt": prompt, "completion": completion}
  try:
    seconds = _median_s(once, args.repeats)
    result.update(s=seconds, completion_tokens_per_s=rows * completion / seconds)
  except Exception as error:  # an out-of-memory reference is a result, not a crash
    result["error"] = f"{type(error).__name__}: {str(error)[:200]}"
  return result


def _llama_config(transformers, shape_kwargs: dict):
  """transformers' Llama of the benchmarked shape, with SDPA attention."""
  return transformers.LlamaConfig(
      vocab_size=shape_kwargs["vocab_size"], hidden_size=shape_kwargs["hidden_size"],
      intermediate_size=shape_kwargs["intermediate_size"],
      num_hidden_layers=shape_kwargs["num_layers"], num_attention_heads=shape_kwargs["num_heads"],
      num_key_value_heads=shape_kwargs["num_kv_heads"], head_dim=shape_kwargs["head_dim"],
      tie_word_embeddings=True, attn_implementation="sdpa")


def torch_step(shape_kwargs: dict, shape, args) -> dict:
  import torch
  import transformers

  rows, prompt, completion = shape
  device = "cuda" if torch.cuda.is_available() else "cpu"
  hf_config = _llama_config(transformers, shape_kwargs)
  torch.manual_seed(0)
  policy = transformers.LlamaForCausalLM(hf_config).to(device)
  reference = transformers.LlamaForCausalLM(hf_config).to(device).eval()
  optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
  host = random_batch(rows, prompt, completion, shape_kwargs["vocab_size"])
  tokens = torch.tensor(host["tokens"], dtype=torch.long, device=device)
  advantages = torch.tensor(host["advantages"], device=device)
  mask = torch.tensor(host["completion_mask"], dtype=torch.float32, device=device)

  def completion_logps(model, ids):
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
      logits = model(ids, logits_to_keep=completion + 1).logits[:, :-1].float()
    return torch.gather(logits.log_softmax(-1), 2, ids[:, prompt:, None])[..., 0]

  def once():
    optimizer.zero_grad()
    for part in torch.arange(rows).reshape(-1, args.micro_batches).T:
      ids, adv, m = tokens[part], advantages[part, None], mask[part]
      with torch.no_grad():
        ref = completion_logps(reference, ids) if args.beta > 0 else None
      logps = completion_logps(policy, ids)
      ratio = torch.exp(logps - logps.detach())
      per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
      if ref is not None:
        per_token = per_token + args.beta * (torch.exp(ref - logps) - (ref - logps) - 1)
      loss = ((per_token * m).sum(1) / m.sum(1)).sum() / rows
      loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    if device == "cuda":
      torch.cuda.synchronize()

  result = {"part": "step", "side": f"torch {torch.__version__} transformers "
            f"{transformers.__version__} sdpa, autocast bf16", "rows": rows, "prompt": prompt,
            "completion": completion}
  try:
    once()
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      once()
      times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    result.update(s=seconds, completion_tokens_per_s=rows * completion / seconds)
  except Exception as error:
    result["error"] = f"{type(error).__name__}: {str(error)[:200]}"
  finally:
    del policy, reference, optimizer
    if device == "cuda":
      torch.cuda.empty_cache()
  return result


def our_decode(config: ModelConfig, shape, args) -> dict:
  rows, prompt, completion = shape
  model = create_model(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  prompts = np.random.RandomState(rows).randint(0, config.vocab_size,
                                                (rows, prompt)).astype(np.int32)
  prefill_batch = None if args.prefill_batch == "one" else int(args.prefill_batch)
  decode_s, total_s = run_ours(model, prompts, completion, args.steps_per_call,
                               prefill_batch=prefill_batch)
  tokens = rows * completion
  return {"part": "decode", "side": "reasoning_rl Engine, bf16 weights + KV cache", "rows": rows,
          "prompt": prompt, "completion": completion, "decode_tokens_per_s": tokens / decode_s,
          "end_to_end_tokens_per_s": tokens / total_s}


def torch_decode(shape_kwargs: dict, shape) -> dict:
  import torch
  import transformers

  rows, prompt, completion = shape
  device = "cuda" if torch.cuda.is_available() else "cpu"
  hf_config = _llama_config(transformers, shape_kwargs)
  model = transformers.LlamaForCausalLM(hf_config).to(device, torch.bfloat16).eval()
  ids = torch.tensor(np.random.RandomState(rows).randint(0, shape_kwargs["vocab_size"],
                                                         (rows, prompt)), device=device)

  def once():
    with torch.inference_mode():
      out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=completion,
                           min_new_tokens=completion, do_sample=False, pad_token_id=0)
    if device == "cuda":
      torch.cuda.synchronize()
    assert out.shape == (rows, prompt + completion)

  once()
  start = time.perf_counter()
  once()
  seconds = time.perf_counter() - start
  del model
  return {"part": "decode", "side": f"transformers {transformers.__version__} generate, bf16, "
          "sdpa", "rows": rows, "prompt": prompt, "completion": completion,
          "end_to_end_tokens_per_s": rows * completion / seconds}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", default="64x256+1024,16x256+4096")
  parser.add_argument("--decode", default="64x256+512,256x256+512")
  parser.add_argument("--kernels", default="reference,auto")
  parser.add_argument("--micro_batches", type=int, default=4)
  parser.add_argument("--beta", type=float, default=0.04)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--steps_per_call", type=int, default=32)
  parser.add_argument("--prefill_batch", default="8",
                      help="prompts per prefill call ('one': a call per prompt, as before "
                           "2026-11-29; 8: what rollouts use)")
  parser.add_argument("--skip_torch", action="store_true")
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  if args.small:
    args.steps, args.decode, args.repeats = "4x8+16", "4x8+8", 1
  shape_kwargs = SMALL_SHAPE if args.small else SMOLLM2_SHAPE
  config = ModelConfig(model_type="llama", tie_word_embeddings=True, **shape_kwargs)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; model {shape_kwargs}",
        flush=True)
  results = []

  def record(row):
    results.append(row)
    print(json.dumps(row), flush=True)
    if args.out:
      with open(args.out, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "results": results}, f, indent=1)

  for shape in parse_shapes(args.steps):
    for kernel in args.kernels.split(","):
      record(our_step(config, kernel, shape, args))
    if not args.skip_torch:
      record(torch_step(shape_kwargs, shape, args))
  for shape in parse_shapes(args.decode):
    record(our_decode(config, shape, args))
    if not args.skip_torch:
      record(torch_decode(shape_kwargs, shape))


if __name__ == "__main__":
  main()
