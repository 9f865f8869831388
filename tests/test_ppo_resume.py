"""PPO (value head + GAE) through launch/train.py, SIGKILLed mid-step and resumed: the metrics, the
rollouts and the final train state, value head included, equal the uninterrupted run's bit for bit.

The SIGKILL lands at a chosen moment, not at whatever moment a poll happens to see: the trainer
runs under a small driver that parks it (sleeps) inside one step and leaves a marker file, and the
test kills the parked process from outside. Each process compiles the same programs, so they
share a persistent compilation cache: every run after the first starts in seconds.
"""

import jax
import numpy as np

from reasoning_rl.metrics import read_metrics
from tests.support.runs import (  # noqa: F401 (compile_cache: this module's autouse fixture)
    PPO, compile_cache, final_state, kill_mid_step, rollouts, stable, train)


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
