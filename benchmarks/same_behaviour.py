"""Does a refactor change what a run computes? The demo's first steps before and after, compared.

  python -m benchmarks.same_behaviour run --tree=/path/to/checkout --out=/tmp/before
  python -m benchmarks.same_behaviour run --tree=. --out=/tmp/after
  python -m benchmarks.same_behaviour compare /tmp/before /tmp/after

`run` trains each mode below for `--steps` steps (3) from the checkout `--tree` (a `git worktree`
of the commit to compare against, so the code under test is what that tree holds), with the
held-out evaluation cut to 8 examples to save time. `compare` prints one line per mode and exits 1
unless every metrics row (less its time/ and throughput/ keys), every rollout file (byte for byte)
and every evaluation summary (less its time/ keys) is the same. Runs take 2-5 min per mode on 2
cores; the SmolLM2 GGUF must be installed (README.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

# mode -> (config file, overrides): the demo in each way a step can be made
MODES = {
    "grpo": ("configs/smollm2_arithmetic.py", ()),
    "ppo": ("configs/smollm2_arithmetic.py", ("--config.algo.name=ppo",)),
    "lora": ("configs/smollm2_arithmetic_lora.py", ()),
    "partial": ("configs/smollm2_arithmetic.py", ("--config.partial_rollouts.enabled=True",)),
    "multiturn": ("configs/smollm2_calculator.py", ()),
}
TIMING = ("time/", "throughput/")  # wall-clock figures: never equal between two runs


def run(tree: pathlib.Path, out: pathlib.Path, steps: int, modes: list[str]) -> int:
  out.mkdir(parents=True, exist_ok=True)
  failed = 0
  for mode in modes:
    config, overrides = MODES[mode]
    command = [sys.executable, "launch/train.py", f"--config={config}", *overrides,
               f"--config.total_steps={steps}", "--config.eval.num_examples=8",
               f"--config.workdir={out / mode}"]
    with open(out / f"{mode}.log", "w") as log:
      code = subprocess.run(command, cwd=tree, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"{mode}: exit {code} ({out / mode})", flush=True)
    failed += code != 0
  return 1 if failed else 0


def _without_timing(row: dict) -> dict:
  return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def _content(path: pathlib.Path):
  if path.suffix == ".json":  # an evaluation summary: its seconds differ
    return _without_timing(json.loads(path.read_text()))
  return path.read_bytes()


def compare(before: pathlib.Path, after: pathlib.Path) -> int:
  different = 0
  for mode in sorted(p.name for p in before.iterdir() if p.is_dir()):
    a, b = before / mode, after / mode
    if not (b / "metrics.jsonl").exists():
      print(f"{mode}: no run in {after}")
      different += 1
      continue
    rows = [[_without_timing(json.loads(line)) for line in (d / "metrics.jsonl").read_text()
             .splitlines()] for d in (a, b)]
    changed = sorted({k for r1, r2 in zip(*rows) for k in set(r1) | set(r2)
                      if r1.get(k) != r2.get(k)})
    if len(rows[0]) != len(rows[1]):
      changed.append(f"(rows: {len(rows[0])} vs {len(rows[1])})")
    files = sorted(p.relative_to(a) for folder in ("rollouts", "eval") for p in
                   (a / folder).glob("*") if p.is_file())
    files_changed = [str(f) for f in files
                     if not (b / f).exists() or _content(a / f) != _content(b / f)]
    same = not changed and not files_changed
    different += not same
    print(f"{mode}: {len(rows[0])} metric rows, {len(files)} files: "
          + ("identical" if same else f"DIFFERENT metrics {changed[:8]} files {files_changed[:8]}"))
  return 1 if different else 0


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  runner = commands.add_parser("run", help="train each mode for a few steps")
  runner.add_argument("--tree", type=pathlib.Path, default=pathlib.Path("."))
  runner.add_argument("--out", type=pathlib.Path, required=True)
  runner.add_argument("--steps", type=int, default=3)
  runner.add_argument("--modes", default=",".join(MODES),
                      help=f"comma-separated, of {', '.join(MODES)}")
  comparer = commands.add_parser("compare", help="compare two `run` outputs")
  comparer.add_argument("before", type=pathlib.Path)
  comparer.add_argument("after", type=pathlib.Path)
  args = parser.parse_args()
  if args.command == "compare":
    return compare(args.before, args.after)
  modes = args.modes.split(",")
  unknown = [m for m in modes if m not in MODES]
  if unknown:
    parser.error(f"--modes: {unknown[0]!r} is not one of {', '.join(MODES)}")
  return run(args.tree.resolve(), args.out.resolve(), args.steps, modes)


if __name__ == "__main__":
  sys.exit(main())
