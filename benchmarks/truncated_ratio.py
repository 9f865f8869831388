"""The sampler / trainer mismatch of the full-softmax and the truncated ratio (docs/off_policy.md).

Usage: python -m benchmarks.truncated_ratio [--num_prompts 4] [--num_samples 4]
           [--max_new_tokens 32] [--repeats 2]

SmolLM2-135M-Instruct (GGUF, float32, the test fixture's file) samples G completions of short
chat questions on the engine, for each sampling setting (temperature 1 with top_p = 0.9; with
top_k = 20; and temperature 0.7 with both); `batching.build_batch(..., truncation=True)` makes the
batch and one `TrainStep` (GRPO, μ = 1, algo.truncated_ratio) reports, for the tokens sampled:
- mismatch/full/abs_log_diff, mismatch/full/ratio/max: |log π − log μ^W| and max π/μ^W, with π
  the trainer's full softmax and μ^W the sampler's log-prob under the distribution it drew from
  (what the full-softmax ratio takes the behaviour policy to be, against what it was);
- mismatch/truncated/...: the same with π^W, the trainer's rebuild of the truncation.
It also times the step (median of --repeats after a compiling run) with the switch on and off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

from benchmarks.installed import smollm2_gguf
from reasoning_rl.models import load
from reasoning_rl.rl import advantages as advantages_lib
from reasoning_rl.rl import batching
from reasoning_rl.rl.rollout_columns import RolloutColumns
from reasoning_rl.rl.stats import finalize
from reasoning_rl.rl.step import TrainStep
from reasoning_rl.rl.step_config import StepConfig
from reasoning_rl.sampler import SamplingParams
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.rollout import generate_groups
from reasoning_rl.verifiers.rewards import Reward

QUESTIONS = ("What is 17 + 25?", "Name a prime number larger than 50.",
             "Why is the sky blue? Answer briefly.", "Write a haiku about rain.")
SETTINGS = {"top_p=0.9": SamplingParams(temperature=1.0, top_p=0.9),
            "top_k=20": SamplingParams(temperature=1.0, top_k=20),
            "T=0.7,top_p=0.9,top_k=20": SamplingParams(temperature=0.7, top_p=0.9, top_k=20)}
METRICS = ("mismatch/full/abs_log_diff", "mismatch/full/ratio/max",
           "mismatch/truncated/abs_log_diff", "mismatch/truncated/ratio/max")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--num_prompts", type=int, default=4)
  parser.add_argument("--num_samples", type=int, default=4)
  parser.add_argument("--max_new_tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  model, tokenizer = load(smollm2_gguf())
  prompts = [tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS][:args.num_prompts]
  prompt_length = max(len(p) for p in prompts)
  engine = Engine(model, max_concurrent_decodes=args.num_prompts * args.num_samples,
                  max_prefill_length=32, max_decode_length=args.max_new_tokens, steps_per_call=8)
  from flax import nnx  # pylint: disable=import-outside-toplevel

  graphdef, params = nnx.split(model)
  steps = {on: TrainStep(graphdef, StepConfig(truncated_ratio=on, learning_rate=0.0))
           for on in (True, False)}
  states = {on: steps[on].init_state(jax.tree.map(lambda x: x.copy(), params))
            for on in (True, False)}
  results = {}
  for name, sampling in SETTINGS.items():
    completions = generate_groups(engine, prompts, num_samples=args.num_samples,
                                  sampling=sampling, max_new_tokens=args.max_new_tokens,
                                  stop_ids=tokenizer.eos_ids, seed=0)
    groups = []
    for i in range(len(prompts)):
      group = sorted((c for c in completions if c.prompt_id == i), key=lambda c: c.sample_index)
      rewards = [Reward(total=float(j % 2), parts={}, verifier_version="benchmark")
                 for j in range(len(group))]
      groups.append(RolloutColumns.of_group(i, group, [""] * len(group), status="ok",
                                            rewards=rewards, sampling=sampling))
    record = RolloutColumns.concat(groups, group_size=args.num_samples)
    advantages = advantages_lib.batch_advantages(
        record.group_rewards(), num_groups=len(prompts), group_size=args.num_samples,
        estimator="grpo")
    batch = batching.build_batch(
        record.with_advantages(advantages), num_groups=len(prompts),
        group_size=args.num_samples, prompt_length=prompt_length,
        completion_length=args.max_new_tokens, pad_id=tokenizer.pad_id, truncation=True)
    row = {"tokens": int(batch["completion_mask"].sum())}
    for on in (True, False):
      step_batch = batch if on else {k: v for k, v in batch.items()
                                     if not k.startswith("sampling_")}
      seconds = []
      for repeat in range(args.repeats + 1):
        start = time.perf_counter()
        states[on], stats = steps[on](states[on], step_batch)
        stats = finalize(jax.device_get(stats))
        if repeat:
          seconds.append(time.perf_counter() - start)
      row[f"step_s/{'truncated' if on else 'full'}"] = statistics.median(seconds)
      if on:
        row.update({k: float(stats[k]) for k in METRICS})
    results[name] = row
    print(name, json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
