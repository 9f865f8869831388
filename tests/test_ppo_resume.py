"""PPO (value head + GAE) through launch/train.py, SIGKILLed mid-step and resumed: the metrics, the
rollouts and the final train state, value head included, equal the uninterrupted run's bit for bit.

The SIGKILL lands at a chosen moment, not at whatever moment a poll happens to see: the trainer
runs under a small driver that parks it (sleeps) inside one step and leaves a marker file, and the
test kills the parked process from outside. Each process compiles the same programs, so they
share a persistent compilation cache: every run after the first starts in seconds.
"""

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
from tests.test_trainer import rollouts, stable, train

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


def test_ppo_sigkill_mid_step_then_resume_reproduces_the_run(tmp_path):
  baseline = tmp_path / "baseline"
  train(baseline, *PPO)
  expected = read_metrics(baseline / "metrics.jsonl")
  assert [r["step"] for r in expected] == [1, 2, 3, 4, 5]
  # the value head starts at zero (step 1 predicts 0 everywhere) and learns from there
  assert expected[0]["train/value/mean"] == 0.0
  assert all(r["train/value/mean"] != 0.0 for r in expected[1:])

  workdir = tmp_path / "run"
  # killed mid-step 4, once checkpoint 2 is committed (its checksums are written after Orbax's
  # commit): step 3's row and rollouts are on disk, and the rerun drops them and redoes step 3
  kill_mid_step(workdir, 4, after=workdir / "checkpoints" / "2" / "CHECKSUMS.json")
  assert [r["step"] for r in read_metrics(workdir / "metrics.jsonl")] == [1, 2, 3]
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"]
  train(workdir, *PPO)

  assert stable(read_metrics(workdir / "metrics.jsonl")) == stable(expected)
  assert rollouts(workdir) == rollouts(baseline)
  resumed, uninterrupted = final_state(workdir, 5), final_state(baseline, 5)
  head = uninterrupted["value_head"]
  assert head["kernel"].shape == (64,) and np.abs(head["kernel"]).max() > 0  # trained from zeros
  np.testing.assert_array_equal(resumed["value_head"]["kernel"], head["kernel"])
  np.testing.assert_array_equal(resumed["value_head"]["bias"], head["bias"])
  # and everything else: policy, AdamW moments (the value head's among them), counters
  assert jax.tree.structure(resumed) == jax.tree.structure(uninterrupted)
  for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted)):
    np.testing.assert_array_equal(got, want)
