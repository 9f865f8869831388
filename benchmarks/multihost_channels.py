"""Bytes and seconds per step through each host channel of a 4-process split run: the
coordination service's key-value store (process 0's memory, every value read by every process)
and the bulk files in the workdir (`reasoning_rl.multihost.bulk`), before and after rollouts and
evaluation records moved to the files.

Usage: python -m benchmarks.multihost --channels [--steps 5] [--revert COMMIT] [--large]

debug_cpu as 4 processes × 2 CPU devices, processes 0-1 train, 2-3 sample, run twice: "before" is
this working tree with COMMIT's changes to reasoning_rl/ reverted (default: the commit that added
reasoning_rl/multihost/bulk.py), and `ALSO_REVERTED`'s, traced from outside
(`benchmarks/exchange_trace.py`); "after" is the working tree, which traces itself
(`REASONING_RL_EXCHANGE_TRACE`). Each process appends one line per store value or file it writes
or reads; the table sums them over the run's processes and divides by the steps (start-up,
restore and evaluations included). Seconds: encode + write, and transfer + decode once the value
is complete (not the wait for its writer). `--large` also runs larger rollouts (16 prompts × 8
samples × 96 new tokens instead of 4 × 4 × 12).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from reasoning_rl.multihost import bulk
from tests import multihost_runs as runs

REPO = runs.REPO
TREE_PARTS = ("reasoning_rl", "launch", "configs")
# Changes of this work that landed in another commit: (file, method, a revision before them)
ALSO_REVERTED = (("reasoning_rl/multihost/cluster.py", "evaluate", "36ba146~1"),)
LARGE = ["--config.rollout.num_prompts=16", "--config.rollout.num_samples=8",
         "--config.rollout.max_new_tokens=96", "--config.rollout.steps_per_call=32",
         "--config.rollout.max_concurrent_decodes=128"]


def _git(*args) -> str:
  return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True,
                        text=True).stdout


def before_tree(commit: str, directory: pathlib.Path) -> pathlib.Path:
  """A copy of this working tree's code with `commit`'s changes to reasoning_rl/ reverted."""
  for part in TREE_PARTS:
    shutil.copytree(REPO / part, directory / part,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  for added in _git("show", "--format=", "--name-only", "--diff-filter=A", commit, "--",
                    "reasoning_rl").split():
    (directory / added).unlink()
  patch = _git("show", "--format=", "--diff-filter=M", commit, "--", "reasoning_rl")
  subprocess.run(["git", "apply", "-R"], cwd=directory, input=patch, text=True, check=True)
  for file, method, revision in ALSO_REVERTED:
    target = directory / file
    target.write_text(_with_method(target.read_text(), _git("show", f"{revision}:{file}"),
                                   method))
  return directory


def _with_method(text: str, source: str, method: str) -> str:
  """`text` with the method `method` (and the module constants it needs) as in `source`."""
  def span(code):
    start = code.index(f"\n  def {method}(")
    return start, code.index("\n  def ", start + 1)

  (a, b), (c, d) = span(text), span(source)
  return text[:a] + source[c:d] + text[b:]


def run(tree: pathlib.Path, workdir: pathlib.Path, trace: pathlib.Path, overrides) -> None:
  """The 4 processes of a split debug_cpu run on `tree`'s code, traced into `trace`."""
  port = runs.free_port_block(6)
  env = {**runs.environment(runs.DEVICES_PER_PROCESS), bulk.TRACE_ENV: str(trace),
         "PYTHONPATH": str(tree)}
  processes = []
  for index in range(4):
    log = open(f"{workdir}.p{index}.log", "ab")  # noqa: SIM115
    processes.append(subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "exchange_trace.py"),
         str(tree / "launch" / "train.py"), "--config=configs/debug_cpu.py",
         f"--config.workdir={workdir}", *overrides, f"--coordinator_address=127.0.0.1:{port}",
         "--num_processes=4", f"--process_id={index}"],
        cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT))
  codes = runs.wait_all(processes, timeout_s=1800)
  if any(codes):
    sys.exit(f"run failed with exit codes {codes}; logs beside {workdir}")


def summarize(trace: pathlib.Path, steps: int) -> dict:
  """{channel: figures per step} from the trace lines of the 4 processes."""
  totals = collections.defaultdict(collections.Counter)
  for process in range(4):
    file = trace / f"p{process}.jsonl"
    for line in file.open() if file.exists() else ():
      r = json.loads(line)
      t = totals[r["channel"]]
      t[f"{r['op']}_bytes"] += r["bytes"]
      t[f"{r['op']}_s"] += r["s"]
      t["largest"] = max(t["largest"], r["bytes"])
      if r["op"] == "read" and process >= 2:  # the sampler-only processes
        t["sampler_read_bytes"] += r["bytes"]
      if r["op"] == "read" and r["name"] == "rollouts":
        t["rollouts_bytes"] += r["bytes"]
  return {channel: collections.Counter({k: v / steps if k != "largest" else v
                                        for k, v in t.items()})
          for channel, t in totals.items()}


def main(steps: int = 5, revert: str | None = None, large: bool = False) -> None:
  revert = revert or _git("log", "--diff-filter=A", "--format=%h", "--",
                          "reasoning_rl/multihost/bulk.py").split()[-1]
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="channels_bench_"))
  print(f"workdirs, traces and logs under {tmp}; before = working tree with {revert} reverted")
  common = [f"--config.total_steps={steps}", "--config.eval.num_examples=4",
            "--config.checkpoint.every_steps=1000", "--config.logging.tensorboard=False",
            "--config.mesh.num_trainer_devices=4"]
  before = before_tree(revert, tmp / "before_tree")
  print("| rollouts | code | channel | written B/step | read B/step (all processes) | "
        "of which rollouts | read by processes 2-3 | largest value B | write s/step | "
        "read s/step |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for size, overrides in (("4×4×12", []),) + ((("16×8×96", LARGE),) if large else ()):
    for name, tree in (("before", before), ("after", REPO)):
      label = f"{name}_{size.replace('×', 'x')}"
      os.makedirs(tmp / label, exist_ok=True)
      run(tree, tmp / label / "run", tmp / label / "trace", common + overrides)
      figures = summarize(tmp / label / "trace", steps)
      for channel in ("store", "file"):
        f = figures.get(channel, collections.Counter())
        print(f"| {size} | {name} | {channel} | {f['write_bytes']:,.0f} | {f['read_bytes']:,.0f} | "
              f"{f['rollouts_bytes']:,.0f} | {f['sampler_read_bytes']:,.0f} | "
              f"{f['largest']:,.0f} | {f['write_s']:.4f} | {f['read_s']:.4f} |", flush=True)


if __name__ == "__main__":
  main()
