"""GRPO training-step throughput on SmolLM2-135M: reasoning_rl's fused step beside torch.

The torch side is the same loss (PPO-clipped surrogate + β·k3 KL, per-sequence token mean, as TRL's
GRPOTrainer computes it) on the transformers model, with a frozen reference forward and AdamW — the
work one TRL GRPO optimizer step does once the completions exist.

Both sides run in one process, so both get the same host allocator: by default glibc is told to
keep freed memory (`reasoning_rl.host_memory`, as `launch/train.py` does); `--system_allocator`
leaves glibc's defaults.

Usage: python -m benchmarks.train_step [--completions 32] [--completion_length 256]
         [--prompt_length 64] [--beta 0.04] [--repeats 2] [--system_allocator]
         [--dtype float32|bfloat16]
With --dtype bfloat16 both sides compute in bfloat16 over float32 weights: ours `model.dtype`
bfloat16 (float32 masters), torch under CPU autocast (what TRL's `bf16=True` default does).
Prints completion tokens/s, seconds per step and achieved GFLOP/s for both, the latter also
as a share of this machine's f32 matmul speed (a 2048³ product measured in the same run).
"""

import argparse
import copy
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.installed import smollm2_gguf
from reasoning_rl import flops


def step_flops(config, step_config, batch: int, prompt: int, completion: int) -> float:
  """Model FLOPs of the step (`reasoning_rl.flops`; recomputation left out, as the torch side
  runs none), the numerator of both sides' GFLOP/s."""
  training, _ = flops.training_flops(
      config, trained_tokens=batch * (prompt + completion), trained_context=prompt + completion,
      completion_tokens=batch * completion, passes=flops.TrainingPasses.of_step(step_config))
  return training


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
  """This machine's f32 matmul speed: the best of `repeats` jitted n³ products, in GFLOP/s."""
  a = jnp.ones((n, n), jnp.float32)
  product = jax.jit(lambda x: x @ x)
  product(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    product(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best / 1e9


def add_step_arguments(parser: argparse.ArgumentParser, *, completions: int, micro_batches: int):
  """The shape of the benchmarked step; shared with benchmarks/profile_step.py."""
  parser.add_argument("--completions", type=int, default=completions)
  parser.add_argument("--completion_length", type=int, default=256)
  parser.add_argument("--prompt_length", type=int, default=64)
  parser.add_argument("--beta", type=float, default=0.04)
  parser.add_argument("--micro_batches", type=int, default=micro_batches)
  parser.add_argument("--remat", action="store_true")
  parser.add_argument("--system_allocator", action="store_true",
                      help="leave glibc's malloc defaults (freed memory goes back to the OS)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="compute dtype over float32 weights (torch: autocast)")


def random_batch(b: int, p: int, t: int, vocab_size: int = 49152) -> dict[str, np.ndarray]:
  """b rows of p prompt + t completion random token ids, every completion token counted."""
  rng = np.random.RandomState(0)
  return dict(tokens=rng.randint(0, vocab_size, (b, p + t)).astype(np.int32),
              attention_mask=np.ones((b, p + t), np.int32),
              completion_mask=np.ones((b, t), np.int32),
              advantages=rng.randn(b).astype(np.float32))


def build_jax_step(args):
  """(model config, TrainStep, its initial state) for SmolLM2-135M; call before any JAX work."""
  if not args.system_allocator:
    from reasoning_rl.host_memory import keep_freed_memory
    keep_freed_memory()  # before the first JAX computation starts the backend's threads
  from reasoning_rl.models import load
  from reasoning_rl.rl.step import TrainStep
  from reasoning_rl.rl.step_config import StepConfig

  model, _ = load(smollm2_gguf(), dtype=args.dtype, weight_dtype="float32")
  graphdef, params = nnx.split(model)
  reference = jax.tree.map(jnp.copy, params) if args.beta > 0 else None
  step = TrainStep(graphdef, StepConfig(beta=args.beta, learning_rate=1e-6,
                                        num_micro_batches=args.micro_batches, remat=args.remat))
  return model.config, step, step.init_state(params, ref_params=reference)


def main():
  parser = argparse.ArgumentParser()
  # Micro-batches on both sides: the full 32 x 320-token batch's activations do not fit 24 GiB.
  add_step_arguments(parser, completions=32, micro_batches=4)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()

  path = smollm2_gguf()
  b, p, t = args.completions, args.prompt_length, args.completion_length
  rows = []
  config, step, state = build_jax_step(args)
  host_batch = random_batch(b, p, t)
  batch = jax.tree.map(jnp.asarray, host_batch)
  tokens, advantages = host_batch["tokens"], host_batch["advantages"]
  completion_mask = host_batch["completion_mask"]
  step_flop_count = step_flops(config, step.config, b, p, t)
  start = time.perf_counter()
  state, stats = step(state, batch)
  jax.block_until_ready(stats)
  compile_and_first = time.perf_counter() - start
  best = float("inf")
  for _ in range(args.repeats):
    start = time.perf_counter()
    state, stats = step(state, batch)
    jax.block_until_ready(stats)
    best = min(best, time.perf_counter() - start)
  rows.append((f"reasoning_rl fused step (jax.jit, {args.dtype})", best))
  del state, step

  import torch
  import transformers

  policy = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32)
  ref_model = copy.deepcopy(policy).eval() if args.beta > 0 else None
  optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
  torch_tokens = torch.tensor(tokens, dtype=torch.long)
  torch_adv = torch.tensor(advantages)
  torch_mask = torch.tensor(completion_mask, dtype=torch.float32)

  def completion_logps(m, ids):
    # As TRL does: project only the positions that predict completion tokens to the vocabulary.
    logits = m(ids, logits_to_keep=t + 1).logits[:, :-1].float()
    return torch.gather(logits.log_softmax(-1), 2, ids[:, p:, None])[..., 0]

  def torch_step():
    optimizer.zero_grad()
    for rows in torch.arange(b).reshape(-1, args.micro_batches).T:  # same row split as ours
      ids, adv, mask = torch_tokens[rows], torch_adv[rows, None], torch_mask[rows]
      with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
        with torch.no_grad():
          ref = completion_logps(ref_model, ids) if ref_model is not None else None
        logps = completion_logps(policy, ids)
      ratio = torch.exp(logps - logps.detach())
      per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
      if ref is not None:
        per_token = per_token + args.beta * (torch.exp(ref - logps) - (ref - logps) - 1)
      # sequence mean of token means over the WHOLE batch: each micro-batch adds its share
      loss = ((per_token * mask).sum(1) / mask.sum(1)).sum() / b
      loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()

  torch_step()
  torch_best = float("inf")
  for _ in range(args.repeats):
    start = time.perf_counter()
    torch_step()
    torch_best = min(torch_best, time.perf_counter() - start)
  rows.append((f"transformers {transformers.__version__} + torch {torch.__version__} "
               f"(TRL GRPO loss, {args.dtype})", torch_best))

  peak = matmul_peak_gflops()
  tokens_per_step = b * t
  print(f"SmolLM2-135M GRPO step: {b} completions x {t} tokens after {p}-token prompts, "
        f"beta={args.beta}, {args.micro_batches} micro-batches, remat={args.remat}, "
        f"{'system' if args.system_allocator else 'kept-memory'} malloc, "
        f"{step_flop_count / 1e12:.2f} TFLOP/step; best of {args.repeats} "
        f"(jax compile + first step {compile_and_first:.0f} s)")
  print(f"matmul peak here: {peak:.0f} GFLOP/s (jitted 2048^3 f32 product, best of 5)")
  print("| implementation | s / step | completion tokens/s | GFLOP/s | % of matmul peak |")
  print("|---|---|---|---|---|")
  for name, seconds in rows:
    achieved = step_flop_count / seconds / 1e9
    print(f"| {name} | {seconds:.1f} | {tokens_per_step / seconds:,.0f} | "
          f"{achieved:.0f} | {achieved / peak:.0%} |")
  print(f"speed-up: {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
  main()
