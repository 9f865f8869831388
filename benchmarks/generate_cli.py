"""Decode as a user meets it: `launch/generate.py` vs transformers' `generate`, whole processes.

Usage: python -m benchmarks.generate_cli [--num_prompts 64] [--short 16] [--long 144]
           [--ours_args "--max_concurrent_decodes 16"] [--cache off|cold|warm]
           [--skip_transformers] [--repeats 1] [--dtype float32|bfloat16]

Both sides load the SmolLM2-135M-Instruct GGUF (the test fixture's file) in --dtype (float32 by
default; bfloat16 is `launch/generate.py --dtype bfloat16` against transformers' model loaded in
torch.bfloat16, weights and KV cache in bfloat16 on both sides), take the same
64 chat prompts and decode greedily with EOS ignored, as fresh processes: once for --short new
tokens and once for --long. Steady-state throughput = prompts × (long − short) /
(wall(long) − wall(short)): start-up, loading and the first prefill cancel out, and what remains
is what the extra tokens cost, compilations they trigger included. transformers runs the prompts as
one left-padded batch (its own `generate`, KV cache on). Prints a table row per side.

With --repeats N each side runs short, long, short, long, ... N times and the rate comes from the
fastest wall of each length: a single pair is fragile, since one slow start-up of the short
process (seconds of disk or import time) shrinks the difference the rate divides by.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from benchmarks.installed import smollm2_gguf

REPO = pathlib.Path(__file__).resolve().parent.parent

TRANSFORMERS_SCRIPT = r"""
import json, pathlib, sys, torch, transformers
gguf, prompts_file, new_tokens = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dtype = getattr(torch, sys.argv[4])
tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tokenizer.padding_side = "left"
model = transformers.AutoModelForCausalLM.from_pretrained(
    str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()
texts = [tokenizer.apply_chat_template([{"role": "user", "content": json.loads(line)["prompt"]}],
                                       tokenize=False, add_generation_prompt=True)
         for line in open(prompts_file)]
batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
with torch.no_grad():
  out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
print("generated", (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0])
"""


def benchmark_prompts(count: int) -> list[dict]:
  """The benchmark's prompt rows (chat text, 45 tokens each under SmolLM2's template)."""
  return [{"prompt": f"What is {10 + 7 * i % 90} + {11 + 13 * i % 88}? Explain step by step."}
          for i in range(count)]


def wall(command, env=None) -> float:
  start = time.perf_counter()
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
  seconds = time.perf_counter() - start
  if result.returncode != 0:
    raise SystemExit(f"{command[:3]} exited {result.returncode}:\n{result.stderr[-2000:]}")
  return seconds


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--num_prompts", type=int, default=64)
  parser.add_argument("--short", type=int, default=16)
  parser.add_argument("--long", type=int, default=144)
  parser.add_argument("--ours_args", default="", help="extra launch/generate.py flags")
  parser.add_argument("--skip_transformers", action="store_true")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="both sides' weights and KV cache")
  parser.add_argument("--repeats", type=int, default=1,
                      help="runs of each command; the fastest of each length counts")
  parser.add_argument("--cache", choices=("off", "cold", "warm"), default="off",
                      help="our compilation cache (reasoning_rl/compile_cache.py): off; cold (a "
                      "fresh one: the long run reuses what the short one compiled); warm (both "
                      "commands ran once before, untimed)")
  args = parser.parse_args()
  gguf = smollm2_gguf()
  work = pathlib.Path(tempfile.mkdtemp())
  prompts = work / "prompts.jsonl"
  prompts.write_text("".join(json.dumps(row) + "\n" for row in benchmark_prompts(args.num_prompts)))
  sides = {"ours (launch/generate.py)": lambda n: [
      sys.executable, "launch/generate.py", "--checkpoint", str(gguf), "--prompts_file",
      str(prompts), "--max_new_tokens", str(n), "--ignore_eos", "--temperature", "0",
      "--output", str(work / f"out_{n}.jsonl"), "--dtype", args.dtype, *args.ours_args.split()]}
  if not args.skip_transformers:
    sides["transformers generate"] = lambda n: [
        sys.executable, "-c", TRANSFORMERS_SCRIPT, str(gguf), str(prompts), str(n), args.dtype]
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["REASONING_RL_COMPILATION_CACHE"] = "off" if args.cache == "off" else str(work / "cache")
  # what changes XLA's CPU client for our side (torch reads neither): a table must say it
  print("environment: " + ", ".join(f"{k}={env.get(k, '(unset)')}" for k in ("XLA_FLAGS",
                                                                            "PJRT_NPROC")))
  print(f"| side ({args.dtype}; our cache: {args.cache}) | walls short s | walls long s "
        "| steady tok/s |")
  print("| --- | --- | --- | ---: |")
  for name, command in sides.items():
    if args.cache == "warm":
      wall(command(args.short), env)
      wall(command(args.long), env)
    shorts, longs = [], []
    for _ in range(args.repeats):
      shorts.append(wall(command(args.short), env))
      longs.append(wall(command(args.long), env))
    rate = args.num_prompts * (args.long - args.short) / (min(longs) - min(shorts))
    print(f"| {name} | {' '.join(f'{w:.1f}' for w in shorts)} | "
          f"{' '.join(f'{w:.1f}' for w in longs)} | {rate:.0f} |", flush=True)


if __name__ == "__main__":
  main()
