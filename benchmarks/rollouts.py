"""Group rollouts with mixed completion lengths: the sampler before vs after its throughput change.

Usage: python -m benchmarks.rollouts [--models tiny,smollm2] [--repeats 3] [--slots 16]
           [--num_prompts 16] [--num_samples 4] [--max_new_tokens 128] [--steps_per_call 16]
           [--before_rev REV] [--ablate] [--whole_tree]

Workloads (G samples per prompt at temperature 1, so the completions of a group differ):
- tiny: a random Qwen2-shaped model (4 layers, d=256, vocab 512) on random prompts of 8–64 tokens;
  eight fixed token ids stop a completion, so lengths spread roughly geometrically (mean ~60 tokens
  when the model's distribution is near uniform) and some run to the budget.
- smollm2: SmolLM2-135M-Instruct (GGUF, float32) on short chat questions; its own EOS ids stop a
  completion, so lengths are the model's.

Before = `reasoning_rl/sampler/sampling.py`, `engine.py` and `rollout.py` as of --before_rev
(default: the last commit before the change), read with `git show` into temporary modules (the
model code is the working tree's); after = the working tree. Both run the same model, prompts,
seeds and engine sizes. Each variant is run once to compile, then the timed runs interleave
(before, after, before, after, ...) and the table gives medians, so load from other processes on
the machine hits both alike. tokens/s = completion tokens of all groups /
wall seconds of `generate_groups` (prefills, inserts, decoding and host work included); "first
run" is the untimed compiling run. "same tokens" counts completions whose ids equal the before
run's (the change must not alter them).
--ablate adds the new engine with one change turned off: "full-length attention"
(live_length_attention=False) and "all slots decoded" (compact_live_slots=False).
--whole_tree compares whole packages instead: before = all of `reasoning_rl/` at --before_rev
(the model code of that revision too, so the model-side decode changes count), after = the
working tree, each in its own child process (`git archive` of the package into a temporary
directory first on the child's path) that builds the same workload, runs once to compile and
then `repeats` timed runs; the children run one after the other (before, then after).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
BEFORE_REV = "ea5871bac4a4c51d01989970655fec2611f93396"  # the last commit before the throughput change (early return, live length)
TINY_STOP_IDS = (11, 97, 150, 233, 301, 377, 420, 499)
QUESTIONS = ["What is {a} + {b}?", "What is {a} times {b}?", "Is {a} a prime number?",
             "Name a colour.", "Write a haiku about the number {a}.",
             "Explain in a few words why {a} is even or odd.", "Count from {a} to {b}.",
             "What is {a} minus {b}? Show your working."]


def load_before(rev: str):
  """(Engine class, generate_groups) of sampling.py, engine.py and rollout.py at git revision
  `rev` (each importing the others of that revision; the model is the working tree's)."""
  modules = {}
  for name in ("sampling", "engine", "rollout"):
    path = f"reasoning_rl/sampler/{name}.py"
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True,
                            capture_output=True, text=True).stdout
    for sibling in ("sampling", "engine"):
      source = source.replace(f"from reasoning_rl.sampler import {sibling} as",
                              f"import before_sampler_{sibling} as")
      source = source.replace(f"from reasoning_rl.sampler.{sibling} import",
                              f"from before_sampler_{sibling} import")
    module = types.ModuleType(f"before_sampler_{name}")
    module.__file__ = f"{rev}:{path}"
    sys.modules[module.__name__] = module  # dataclasses look their module up while decorating
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # pylint: disable=exec-used
    modules[name] = module
  return modules["engine"].Engine, modules["rollout"].generate_groups


def tiny_workload(num_prompts: int, seed: int = 0):
  """(model, prompts, stop ids) of the tiny workload."""
  from reasoning_rl.models.config import ModelConfig
  from reasoning_rl.models.transformer import create_model

  config = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=1024,
                       num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                       attention_bias=True, tie_word_embeddings=True)
  rng = np.random.RandomState(seed)
  prompts = [rng.randint(0, config.vocab_size, rng.randint(8, 65)).tolist()
             for _ in range(num_prompts)]
  return create_model(config, seed=seed), prompts, TINY_STOP_IDS


def smollm2_workload(num_prompts: int, seed: int = 0):
  """(model, prompts, stop ids) of the SmolLM2 workload: chat-template questions, EOS stops."""
  from benchmarks.installed import smollm2_gguf
  from reasoning_rl.models import load

  model, tokenizer = load(smollm2_gguf())
  rng = np.random.RandomState(seed)
  prompts = []
  for index in range(num_prompts):
    question = QUESTIONS[index % len(QUESTIONS)].format(a=rng.randint(2, 100),
                                                       b=rng.randint(2, 100))
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    prompts.append(tokenizer.encode(text, add_special_tokens=False))
  return model, prompts, tuple(tokenizer.eos_ids)


def run_once(engine, generate_groups, prompts, args, stop_ids):
  """(seconds, completions) of one group rollout."""
  from reasoning_rl.sampler import SamplingParams

  start = time.perf_counter()
  completions = generate_groups(engine, prompts, num_samples=args.num_samples,
                                sampling=SamplingParams(temperature=1.0),
                                max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, seed=1)
  return time.perf_counter() - start, completions


WORKLOADS = {"tiny": tiny_workload, "smollm2": smollm2_workload}


def engine_sizes(args, prompts, prefill_bucket) -> dict:
  return {"max_concurrent_decodes": args.slots, "max_decode_length": args.max_new_tokens,
          "max_prefill_length": prefill_bucket(max(map(len, prompts)), 1 << 30),
          "steps_per_call": args.steps_per_call}


def child_main(args) -> None:
  """--whole_tree's child: the workload on whichever `reasoning_rl` is first on the path."""
  import reasoning_rl
  from reasoning_rl.sampler import Engine, generate_groups
  from reasoning_rl.sampler.engine import prefill_bucket

  model, prompts, stop_ids = WORKLOADS[args.child](args.num_prompts)
  engine = Engine(model, **engine_sizes(args, prompts, prefill_bucket))
  first_run, outputs = run_once(engine, generate_groups, prompts, args, stop_ids)
  seconds = [run_once(engine, generate_groups, prompts, args, stop_ids)[0]
             for _ in range(args.repeats)]
  print("RESULT " + json.dumps({
      "package": str(pathlib.Path(reasoning_rl.__file__).parent), "first_run": first_run,
      "seconds": seconds, "completions": [c.completion_ids for c in outputs]}), flush=True)


def run_child(args, name: str, package_root: pathlib.Path) -> dict:
  """Runs `child_main` with `package_root/reasoning_rl` as the package it imports."""
  forwarded = [f"--{key}={getattr(args, key)}" for key in
               ("repeats", "slots", "num_prompts", "num_samples", "max_new_tokens",
                "steps_per_call")]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package_root), str(ROOT)]))
  # cwd = package_root: `python -m` puts the working directory first on sys.path
  done = subprocess.run([sys.executable, "-m", "benchmarks.rollouts", f"--child={name}",
                         *forwarded], cwd=package_root, env=env, capture_output=True, text=True,
                        check=False)
  results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
  if done.returncode or not results:
    raise SystemExit(f"the {name} child in {package_root} failed:\n{done.stderr[-3000:]}")
  result = json.loads(results[-1][len("RESULT "):])
  expected = package_root / "reasoning_rl"
  if pathlib.Path(result["package"]).resolve() != expected.resolve():
    raise SystemExit(f"the child imported {result['package']}, not {expected}")
  return result


def whole_tree_main(args) -> None:
  print(f"before = reasoning_rl/ at {args.before_rev} (model code included), after = working "
        f"tree, each in a child process; {args.num_prompts} prompts x {args.num_samples} samples, "
        f"T=1, max_new_tokens={args.max_new_tokens}, {args.slots} slots, "
        f"steps_per_call={args.steps_per_call}; medians of {args.repeats}")
  print("| model | variant | tokens | tok/s (median) | runs (s) | first run (s) | speed-up | "
        "same tokens |")
  print("|---|---|---|---|---|---|---|---|")
  with tempfile.TemporaryDirectory(prefix="rollouts-before-") as before_root:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before_rev, "reasoning_rl"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", before_root], input=archive, check=True)
    for name in args.models.split(","):
      if name not in WORKLOADS:
        raise SystemExit(f"--models: unknown model {name!r}; use tiny or smollm2")
      results = {"before": run_child(args, name, pathlib.Path(before_root)),
                 "after": run_child(args, name, ROOT)}
      reference = results["before"]["completions"]
      tokens = sum(map(len, reference))
      base_rate = tokens / statistics.median(results["before"]["seconds"])
      for variant, result in results.items():
        rate = tokens / statistics.median(result["seconds"])
        same = sum(a == b for a, b in zip(reference, result["completions"]))
        runs = ", ".join(f"{s:.2f}" for s in result["seconds"])
        print(f"| {name} | {variant} | {tokens} | {rate:,.0f} | {runs} | "
              f"{result['first_run']:.1f} | {rate / base_rate:.2f}x | {same}/{len(reference)} |",
              flush=True)
      after_tokens = sum(map(len, results["after"]["completions"]))
      if after_tokens != tokens:
        print(f"  {name}: after generated {after_tokens} tokens (rates above use before's count)")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="tiny,smollm2")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--slots", type=int, default=16, help="max_concurrent_decodes")
  parser.add_argument("--num_prompts", type=int, default=16)
  parser.add_argument("--num_samples", type=int, default=4, help="G, completions per prompt")
  parser.add_argument("--max_new_tokens", type=int, default=128)
  parser.add_argument("--steps_per_call", type=int, default=16)
  parser.add_argument("--before_rev", default=BEFORE_REV)
  parser.add_argument("--ablate", action="store_true",
                      help="also run the new engine with full-length attention")
  parser.add_argument("--whole_tree", action="store_true",
                      help="before = the whole package at --before_rev, in child processes")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return child_main(args)
  if args.whole_tree:
    return whole_tree_main(args)

  from reasoning_rl.sampler import Engine, generate_groups
  from reasoning_rl.sampler.engine import prefill_bucket

  before_engine_class, before_generate_groups = load_before(args.before_rev)
  print(f"before = {args.before_rev}, after = working tree; {args.num_prompts} prompts x "
        f"{args.num_samples} samples, T=1, max_new_tokens={args.max_new_tokens}, "
        f"{args.slots} slots, steps_per_call={args.steps_per_call}; medians of {args.repeats}")
  print("| model | variant | tokens | tok/s (median) | runs (s) | first run (s) | generate calls | "
        "speed-up | same tokens |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name in args.models.split(","):
    if name not in WORKLOADS:
      raise SystemExit(f"--models: unknown model {name!r}; use tiny or smollm2")
    model, prompts, stop_ids = WORKLOADS[name](args.num_prompts)
    sizes = engine_sizes(args, prompts, prefill_bucket)
    variants = {"before": (before_engine_class(model, **sizes), before_generate_groups),
                "after": (Engine(model, **sizes), generate_groups)}
    if args.ablate:
      for variant, flag in (("after, full-length attention", "live_length_attention"),
                            ("after, all slots decoded", "compact_live_slots")):
        variants[variant] = (Engine(model, **{flag: False}, **sizes), generate_groups)
    seconds = {variant: [] for variant in variants}
    outputs, calls, first_run = {}, {}, {}
    for variant, (engine, run) in variants.items():  # compiles every shape the runs meet
      first_run[variant], outputs[variant] = run_once(engine, run, prompts, args, stop_ids)
    for _ in range(args.repeats):
      for variant, (engine, run) in variants.items():
        calls_before = engine.num_generate_calls
        elapsed, _ = run_once(engine, run, prompts, args, stop_ids)
        seconds[variant].append(elapsed)
        calls[variant] = engine.num_generate_calls - calls_before
    reference = [c.completion_ids for c in outputs["before"]]
    lengths = [len(ids) for ids in reference]
    tokens = sum(lengths)
    base_rate = tokens / statistics.median(seconds["before"])
    for variant in variants:
      rate = tokens / statistics.median(seconds[variant])
      same = sum(a == c.completion_ids for a, c in zip(reference, outputs[variant]))
      runs = ", ".join(f"{s:.2f}" for s in seconds[variant])
      print(f"| {name} | {variant} | {tokens} | {rate:,.0f} | {runs} | "
            f"{first_run[variant]:.1f} | {calls[variant]} | {rate / base_rate:.2f}x | "
            f"{same}/{len(reference)} |", flush=True)
    print(f"  {name} completion lengths: min {min(lengths)}, median "
          f"{int(np.median(lengths))}, max {max(lengths)}, at budget "
          f"{sum(n == args.max_new_tokens for n in lengths)}/{len(lengths)}")


if __name__ == "__main__":
  main()
