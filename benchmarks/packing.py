"""The training step on padded vs packed rows (algo.packing), SmolLM2-135M, in one run.

Usage: python -m benchmarks.packing [--repeats 3] [--rows 32] [--prompt_length 64]
         [--completion_length 128] [--micro_batches 4] [--betas 0,0.04] [--seed 0]
         [--temperature 1.0] [--samples 8] [--shared_prompts] [--logprob_chunks 128]
         [--skip_padded] [--shared_only]

The batch is an RL batch of the CPU demo's shape: `rows` completions of a `completion_length`
budget after prompts left-padded to `prompt_length`; prompt lengths 30–45 tokens (the demo's chat
prompts are ~39) and completion lengths drawn from the demo's spread (a quarter at the budget, the
rest uniform in 8 … budget), random token ids; rows come in groups of `samples` sharing their
prompt, as a GRPO batch's G completions do. With `--shared_prompts` each packed layout also runs
with `algo.shared_prompts` (each prompt once per row). Each layout runs the same batch through
`TrainStep` (AdamW; the packed one through `TrainStep.host_batch`), compiled first, then timed
`repeats` times, interleaved padded / packed so load on the machine hits both alike; the table
gives medians, the positions each layout computes (rows × width of the micro-batches it runs),
the positions the vocabulary head projects (whole chunks when packed), and the loss of
both (equal to float tolerance: the same update). With `--temperature` other than 1 the rows
were sampled at that temperature: the batch carries each row's sampling settings and the step
rebuilds them (`algo.truncated_ratio`), padded rows per row, packed rows per head position.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.installed import smollm2_gguf


def ragged_batch(args, vocab_size: int):
  rng = np.random.RandomState(args.seed)
  rows, p, t = args.rows, args.prompt_length, args.completion_length
  tokens = np.zeros((rows, p + t), np.int32)
  attention = np.zeros((rows, p + t), np.int32)
  completion = np.zeros((rows, t), np.int32)
  prompt_lens = rng.randint(30, 46, rows)
  completion_lens = np.where(rng.rand(rows) < 0.25, t, rng.randint(8, t + 1, rows))
  for row in range(rows):
    n_p, n_c = prompt_lens[row - row % args.samples], completion_lens[row]
    if row % args.samples == 0:
      prompt = rng.randint(1, vocab_size, n_p)
    tokens[row, p - n_p:p] = prompt
    tokens[row, p:p + n_c] = rng.randint(1, vocab_size, n_c)
    attention[row, p - n_p:p + n_c] = 1
    completion[row, :n_c] = 1
  batch = {"tokens": tokens, "attention_mask": attention, "completion_mask": completion,
           "advantages": rng.randn(rows).astype(np.float32)}
  if args.temperature != 1.0:  # what batching.build_batch(..., truncation=True) adds
    batch.update(sampling_temperature=np.full(rows, args.temperature, np.float32),
                 sampling_top_p=np.ones(rows, np.float32), sampling_top_k=np.zeros(rows, np.int32),
                 sampling_min_p=np.zeros(rows, np.float32),
                 behavior_logprobs=(-rng.rand(rows, t) * completion).astype(np.float32))
  return batch


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--prompt_length", type=int, default=64)
  parser.add_argument("--completion_length", type=int, default=128)
  parser.add_argument("--micro_batches", default="4", help="comma-separated m values to run")
  parser.add_argument("--betas", default="0,0.04")
  parser.add_argument("--row_factors", default="1,2", help="packed_row_factor values to run")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--temperature", type=float, default=1.0,
                      help="the rows' sampling temperature (not 1: the truncated ratio)")
  parser.add_argument("--samples", type=int, default=8,
                      help="rows per prompt (a GRPO group); 1: every row its own prompt")
  parser.add_argument("--shared_prompts", action="store_true",
                      help="also run each packed layout with algo.shared_prompts")
  parser.add_argument("--logprob_chunks", default="128",
                      help="algo.logprob_chunk values to run each packed layout with")
  parser.add_argument("--skip_padded", action="store_true", help="run the packed layouts only")
  parser.add_argument("--shared_only", action="store_true",
                      help="with --shared_prompts: only the packed layouts that share prompts")
  args = parser.parse_args()

  from reasoning_rl.host_memory import keep_freed_memory

  keep_freed_memory()
  from reasoning_rl.models import load
  from reasoning_rl.rl.stats import finalize
  from reasoning_rl.rl.step import TrainStep
  from reasoning_rl.rl.step_config import StepConfig

  model, _ = load(smollm2_gguf())
  graphdef, params = nnx.split(model)
  batch = ragged_batch(args, model.config.vocab_size)
  real = int(batch["attention_mask"].sum())
  print(f"SmolLM2-135M, {args.rows} rows of {args.prompt_length} + {args.completion_length}, "
        f"{real:,} real tokens ({batch['completion_mask'].sum():,} completion tokens), "
        f"sampled at temperature {args.temperature:g}, jax {jax.__version__}, {args.repeats} "
        "timed runs per layout (medians)")
  print("| β | m | layout | s / step | micro-batches run | positions computed | head positions "
        "| loss |")
  print("|---|---|---|---|---|---|---|---|")
  factors = [int(k) for k in args.row_factors.split(",")]
  chunks = [int(c) for c in args.logprob_chunks.split(",")]
  packed = ([] if args.shared_only else [(k, False) for k in factors]) + (
      [(k, True) for k in factors] if args.shared_prompts else [])
  layouts = [] if args.skip_padded else [("padded", 0, False, chunks[0])]
  layouts += [(f"packed, k={k}" + (", shared prompts" if shared else "")
               + (f", chunk {chunk}" if len(chunks) > 1 else ""), k, shared, chunk)
              for k, shared in packed for chunk in chunks]
  width = args.prompt_length + args.completion_length
  for beta in (float(b) for b in args.betas.split(",")):
    for micro in (int(m) for m in args.micro_batches.split(",")):
      steps, runs = {}, {}
      for name, factor, shared, chunk in layouts:
        config = StepConfig(beta=beta, learning_rate=1e-6, num_micro_batches=micro,
                            packing=factor > 0, packed_row_factor=max(factor, 1),
                            shared_prompts=shared, logprob_chunk=chunk,
                            truncated_ratio=args.temperature != 1.0)
        step = TrainStep(graphdef, config)
        copy = lambda: jax.tree.map(lambda x: x.copy(), params)
        state = step.init_state(copy(), ref_params=copy() if beta > 0 else None)
        host = step.host_batch(batch)
        state, stats = step(state, host)  # compile
        jax.block_until_ready(state)
        steps[name] = [step, state, host, finalize(jax.device_get(stats))["loss"]]
        runs[name] = []
      for _ in range(args.repeats):
        for name, *_ in layouts:
          step, state, host, _ = steps[name]
          start = time.perf_counter()
          state, _ = step(state, host)
          jax.block_until_ready(state)
          runs[name].append(time.perf_counter() - start)
          steps[name][1] = state
      for name, factor, *_ in layouts:
        _, _, host, loss = steps[name]
        if factor == 0:
          run, positions, heads = micro, args.rows * width, args.rows * args.completion_length
        else:
          run = int(np.any(host["completion_mask"] > 0, axis=(0, 2)).sum())
          positions = run * host["tokens"].shape[0] * host["tokens"].shape[2]
          targets = host["head_targets"]  # [groups, slices, chunks, chunk]; skipped when empty
          heads = int(np.any(targets >= 0, axis=(0, 3)).sum()) * targets.shape[3]
        print(f"| {beta:g} | {micro} | {name} | {statistics.median(runs[name]):.2f} | "
              f"{run} of {micro} | {positions:,} | {heads:,} | {loss:.6f} |", flush=True)


if __name__ == "__main__":
  main()
