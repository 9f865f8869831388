"""Where a decode step of `launch/generate.py` goes: steady step time, ablations and XLA:CPU ops.

Builds the engine generate.py builds (`build.build_sized_engine`) for the SmolLM2-135M-Instruct
GGUF in float32 (--dtype bfloat16: in bfloat16, transformers too) and decodes the prompts of
`benchmarks/generate_cli.py` greedily with EOS ignored, in one process: the first run compiles,
the next ones are steady. Prints, per run, the prefill seconds and the median `generate` call
(steps_per_call steps) in ms per step.

--ablate replaces one part of the step to measure what it costs in wall time (the tokens are then
wrong; only the timing means anything): `attention` (decode attention returns its query),
`sampling` (a bare argmax, no log-probs). --trace profiles one more run under `jax.profiler` and
prints the thread time of the decode loop's ops, grouped by result shape and source op.
--scan_layers decodes with the block stack scanned (`models.transformer.stack_layers`, what
`model.scan_layers=True` loads). --transformers also times transformers' `generate` on the same
GGUF and prompts (one left-padded batch) in one process: steady ms per step =
(wall(new_tokens) − wall(16)) / (new_tokens − 16), after one untimed call, --runs times.

Usage: python -m benchmarks.profile_decode [--rows 64] [--new_tokens 144] [--runs 3]
           [--ablate none|attention|sampling] [--trace] [--top 16] [--scan_layers]
           [--transformers] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

def parse_args():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=64, help="prompts, one decode slot each")
  parser.add_argument("--new_tokens", type=int, default=144)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--ablate", choices=("none", "attention", "sampling"), default="none")
  parser.add_argument("--trace", action="store_true")
  parser.add_argument("--top", type=int, default=16)
  parser.add_argument("--scan_layers", action="store_true")
  parser.add_argument("--transformers", action="store_true")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="weights, compute and KV cache dtype, ours and --transformers'")
  return parser.parse_args()


def ablate(part: str) -> None:
  import jax.numpy as jnp

  from reasoning_rl import kernels
  from reasoning_rl.sampler import sampling

  if part == "attention":
    kernels.decode_attention = lambda q, *args, **kwargs: q
  elif part == "sampling":
    sampling.sample_tokens = lambda logits, *args, **kwargs: (
        sampling.first_argmax(logits), jnp.zeros(logits.shape[:1]), jnp.zeros(logits.shape[:1]))


def op_table(trace_dir: str, hlo_dir: str, top: int) -> None:
  """Thread seconds of the decode loop's ops (module jit_generate), by result shape and op."""
  hlo_file = glob.glob(f"{hlo_dir}/*jit_generate.cpu_after_optimizations.txt")[-1]
  described = {}
  for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) [a-z\-]+\((.*)$",
                       open(hlo_file).read(), re.M):
    source = re.search(r'op_name="([^"]+)"', m.group(3))
    described[m.group(1)] = (m.group(2), "/".join(source.group(1).split("/")[-2:]) if source
                             else "?")
  trace = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
  events = [e for e in json.load(gzip.open(trace))["traceEvents"]
            if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == "jit_generate"
            and not re.match(r"^(while|cond|call)", e["name"])]
  seconds, count = collections.Counter(), collections.Counter()
  for event in events:
    key = described.get(event["name"], ("?", "?"))
    seconds[key] += event["dur"] / 1e6
    count[key] += 1
  total = sum(seconds.values())
  print(f"\n{total:.2f} thread-s in the decode loop's ops\n")
  print("| result | source op | calls | ms per call | share |")
  print("| --- | --- | ---: | ---: | ---: |")
  for (shape, source), s in seconds.most_common(top):
    print(f"| {shape} | {source} | {count[shape, source]} | "
          f"{1000 * s / count[shape, source]:.3f} | {100 * s / total:.1f}% |")


def transformers_steps(gguf, rows: list[dict], new_tokens: int, runs: int, dtype: str) -> None:
  import torch
  import transformers

  tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
  tokenizer.padding_side = "left"
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)).eval()
  texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                         tokenize=False, add_generation_prompt=True) for r in rows]
  batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

  def wall(n):
    start = time.perf_counter()
    with torch.no_grad():
      model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                     pad_token_id=tokenizer.pad_token_id or 0)
    return time.perf_counter() - start

  wall(16)
  for index in range(runs):
    short, long = wall(16), wall(new_tokens)
    print(f"transformers run {index + 1}: 16 tokens {short:.2f} s, {new_tokens} tokens "
          f"{long:.2f} s, {1000 * (long - short) / (new_tokens - 16):.1f} ms per step", flush=True)


def main():
  args = parse_args()
  hlo_dir = tempfile.mkdtemp(prefix="profile_decode_hlo_") if args.trace else None
  if args.trace:  # the optimised HLO names the ops the trace reports
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={hlo_dir}"
                               " --xla_dump_hlo_module_re=.*generate.* --xla_dump_hlo_as_text")
  import jax

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "launch"))
  import generate

  from benchmarks.generate_cli import benchmark_prompts
  from benchmarks.installed import smollm2_gguf
  from reasoning_rl.build import build_sized_engine, load_checkpoint
  from reasoning_rl.models.transformer import stack_layers
  from reasoning_rl.sampler import SamplingParams, generate_groups

  ablate(args.ablate)
  gguf = smollm2_gguf()
  model, tokenizer = load_checkpoint(str(gguf), dtype=args.dtype, mesh=None)
  if args.scan_layers:
    model = stack_layers(model)
  rows = benchmark_prompts(args.rows)
  prompts = [generate.encode_prompt(r, tokenizer, chat_template=True) for r in rows]
  engine = build_sized_engine(model, longest_prompt=max(map(len, prompts)),
                              max_new_tokens=args.new_tokens, num_sequences=args.rows,
                              max_concurrent_decodes=args.rows, steps_per_call=16)
  seconds = collections.defaultdict(list)
  for name in ("generate", "prefill_many"):
    def timed(*a, _call=getattr(engine, name), _name=name, **k):
      start = time.perf_counter()
      result = jax.block_until_ready(_call(*a, **k))
      seconds[_name].append(time.perf_counter() - start)
      return result
    setattr(engine, name, timed)

  def run():
    seconds.clear()
    generate_groups(engine, prompts, prompt_ids=list(range(args.rows)), num_samples=1,
                    sampling=SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0),
                    max_new_tokens=args.new_tokens, stop_ids=(), stop_strings=(),
                    tokenizer=tokenizer, seed=0)

  print(f"rows {args.rows}, {args.new_tokens} new tokens, ablate {args.ablate}, "
        f"{engine.steps_per_call} steps per call{', scanned layers' if args.scan_layers else ''}")
  for index in range(args.runs):
    run()
    step_ms = 1000 * statistics.median(seconds["generate"]) / engine.steps_per_call
    print(f"run {index + 1}{' (compiles)' if index == 0 else ''}: prefill "
          f"{sum(seconds['prefill_many']):.2f} s, decode {sum(seconds['generate']):.2f} s, "
          f"median {step_ms:.1f} ms per step", flush=True)
  if args.trace:
    trace_dir = tempfile.mkdtemp(prefix="profile_decode_trace_")
    with jax.profiler.trace(trace_dir):
      run()
    op_table(trace_dir, hlo_dir, args.top)
    shutil.rmtree(trace_dir, ignore_errors=True)
    shutil.rmtree(hlo_dir, ignore_errors=True)
  if args.transformers:
    transformers_steps(gguf, rows, args.new_tokens, args.runs, args.dtype)


if __name__ == "__main__":
  main()
