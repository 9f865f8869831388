"""Runs of launch/train.py on the debug config as the end-to-end tests start them: train, read back,
compare, interrupt and resume. (From test_trainer.py, test_kill_anywhere.py, test_ppo_resume.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from reasoning_rl.metrics import read_metrics
from tests.conftest import REPO


VOLATILE = ("time/", "throughput/", "verifier/pool/")
# The logged loss of two runs (or a run and its reference rolled in the test) whose programs
# round differently: packed vs padded, sharded vs one device, scanned vs looped layers, π_old from
# the sampler vs the trainer's. The loss is a near-cancelling mean of O(1) terms (advantage ×
# ratio, |A| ~ 1), so its rounding is absolute, on the terms' scale; and AdamW's early updates
# (≈ lr · sign(g)) carry a rounding difference in a near-zero gradient component into the
# weights, so a step after an update inherits it. How the float32 sums are ordered (vector
# width, FMA) differs by CPU kind: 1.4e-6 apart on an AVX2 EPYC after 4 AdamW updates
# (test_trainer's rolled epochs; -0.0055064 vs -0.0055050), under 5e-7 on AVX-512 hosts. A wrong
# clip, ratio, advantage or π_old moves the loss by ~clip_frac · ε ≈ 1e-3 or more, a hundred
# times this bound. Two runs of one program on one batch are compared exactly instead.
LOSS_ABS = 1e-5


def train_command(workdir, *overrides) -> list[str]:
  """launch/train.py on configs/debug_cpu.py in `workdir`, without the progress bar."""
  return [sys.executable, str(REPO / "launch" / "train.py"), "--config=configs/debug_cpu.py",
          f"--config.workdir={workdir}", "--config.logging.progress_bar=False", *overrides]


def train(workdir, *overrides, check=True, timeout=600):
  result = subprocess.run(train_command(workdir, *overrides), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
  if check and result.returncode != 0:
    # the head too: an abort's cause is printed before the threads' stacks that end stderr
    err = result.stderr
    shown = err if len(err) <= 6000 else f"{err[:3000]}\n[...]\n{err[-3000:]}"
    raise AssertionError(f"train.py exited {result.returncode}:\n{shown}")
  return result


def start_train(workdir, *overrides) -> subprocess.Popen:
  """`train_command` started in the background, its output discarded."""
  return subprocess.Popen(train_command(workdir, *overrides), cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def signal_after_rows(process, metrics, rows: int, signum, *, after_step: int = 0) -> None:
  """Sends `signum` to `process` once `metrics` (a metrics.jsonl) holds `rows` rows and its last
  row is past `after_step` (a resumed run first cuts the file back to its checkpoint's step, which
  may be after_step); returns without a signal if the process ends first or after 300 s."""
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None:
    if metrics.exists():
      lines = metrics.read_text().splitlines()
      if len(lines) >= rows and json.loads(lines[-1])["step"] > after_step:
        os.kill(process.pid, signum)
        return
    time.sleep(0.01)


def stable(rows):
  return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def rollouts(workdir):
  records = []
  for path in sorted((workdir / "rollouts").glob("*.jsonl")):
    records += [json.loads(line) for line in path.read_text().splitlines()]
  return records


def assert_evaluate_cli_reproduces(workdir, output, step: int):
  """launch/evaluate.py on the run's newest checkpoint gives its in-training evaluation of
  `step`: the same examples and accuracy."""
  result = subprocess.run(
      [sys.executable, str(REPO / "launch" / "evaluate.py"), f"--checkpoint={workdir}",
       "--config=configs/debug_cpu.py", f"--output={output}"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  standalone = json.loads(output.read_text())
  in_training = json.loads((workdir / "eval" / f"step_{step:08d}.json").read_text())
  assert standalone["examples"] == in_training["examples"]
  assert standalone["accuracy"] == in_training["accuracy"]


def sigterm_in_first_decode_call(run, *, version):
  """Makes `run`'s engine send this process SIGTERM inside its first decode call with policy
  `version`; returns the list that gets one entry per decode call of that version."""
  engine = run.backend.engine
  generate, calls = engine.generate, []

  def generate_then_sigterm(*args, **kwargs):
    if engine.policy_version == version:
      calls.append(1)
      if len(calls) == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return generate(*args, **kwargs)

  engine.generate = generate_then_sigterm
  return calls


@pytest.fixture
def own_signal_handlers():
  """Puts SIGTERM / SIGINT handling and the stop flag back after an in-process preempted run
  (which keeps the trainer's handlers installed, as a process about to exit does)."""
  from reasoning_rl import stop_signals

  before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  yield
  signal.signal(signal.SIGTERM, before[0])
  signal.signal(signal.SIGINT, before[1])
  stop_signals.clear_preemption_request()


def killed_at(workdir, point, version, *overrides):
  """Runs debug_cpu in `workdir` (a new run, or resuming the one there) until tests/kill_point.py
  SIGKILLs it at `point` with the sampler at policy `version`; checks it died in step version + 1."""
  command = [sys.executable, str(REPO / "tests" / "kill_point.py"), point, str(version), "--",
             "--config=configs/debug_cpu.py", f"--config.workdir={workdir}",
             "--config.logging.progress_bar=False", *overrides]
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == -signal.SIGKILL, (
      f"never reached {point} at version {version} (exit {result.returncode}):\n"
      f"{result.stderr[-3000:]}")
  rows = read_metrics(workdir / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, version + 1)), point  # died in step v + 1


def killed_then_resumed(workdir, point, version, *overrides, after_kill=None):
  killed_at(workdir, point, version, *overrides)
  if after_kill is not None:
    after_kill(workdir)
  train(workdir, *overrides)
  return read_metrics(workdir / "metrics.jsonl")


# 5 steps, checkpoints 2, 4 and 5; the final evaluation looks at 4 held-out examples
PPO = ("--config.algo.name=ppo", "--config.total_steps=5", "--config.checkpoint.every_steps=2",
       "--config.eval.num_examples=4")


# Runs launch/train.py as its own __main__, parked (asleep) right after its K-th train step was
# dispatched: mid-step, the step's batch sampled and scored, its update running, nothing logged.
DRIVER = """
import runpy, sys, time

from reasoning_rl.rl import step as step_lib

park_after, marker, train_py = int(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.argv = sys.argv[3:]
# every step goes through call_with_outputs (`__call__` too)
call, calls = step_lib.TrainStep.call_with_outputs, []


def train_then_park(self, *args, **kwargs):
  out = call(self, *args, **kwargs)
  calls.append(1)
  if len(calls) == park_after:
    open(marker, "w").close()
    time.sleep(600)  # the test SIGKILLs this process
  return out


step_lib.TrainStep.call_with_outputs = train_then_park
runpy.run_path(train_py, run_name="__main__")
"""


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
  """One persistent compilation cache for this module's runs (inherited by the subprocesses):
  the uninterrupted run fills it, the interrupted runs and the resumes load from it."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("jax_cache")))
    patch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    patch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    yield


def kill_mid_step(workdir, step, *, after, config="configs/debug_cpu.py", overrides=PPO):
  """Starts the run of `config` + `overrides` and SIGKILLs it while it is parked in `step` (a
  fresh run's) and `after` (a path) exists."""
  marker = workdir.parent / f"{workdir.name}.parked"
  command = [sys.executable, "-c", DRIVER, str(step), str(marker),
             str(REPO / "launch" / "train.py"), f"--config={config}",
             f"--config.workdir={workdir}", "--config.logging.progress_bar=False", *overrides]
  process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None:
    if marker.exists() and after.exists():
      break
    time.sleep(0.01)
  if process.poll() is not None:
    raise AssertionError(f"the run ended ({process.returncode}) before it parked in step {step}:"
                         f"\n{process.stderr.read()[-3000:]}")
  os.kill(process.pid, signal.SIGKILL)
  process.communicate()
  assert marker.exists() and after.exists(), f"not parked in step {step} with {after} after 300 s"


def final_state(workdir, step):
  """The train state in checkpoint `step` as numpy arrays (Orbax's own layout: no target)."""
  state = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")
  return jax.tree.map(np.asarray, state)
