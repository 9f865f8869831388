"""Partial rollouts through launch/train.py on the debug config: rounds carry unfinished samples
across weight updates, every trained token's lag is bounded and corrected, and a run killed at
any step (or stopped in the middle of a round) resumes to the metrics of the uninterrupted run."""

import sys

import pytest

from reasoning_rl import config as config_lib
from reasoning_rl.config import base_config
from reasoning_rl.errors import ConfigError
from reasoning_rl.metrics import read_metrics
from tests.conftest import REPO
from tests.test_kill_anywhere import killed_then_resumed
from tests.test_trainer import (own_signal_handlers, sigterm_in_first_decode_call,  # noqa: F401
                                stable, train)

STEPS = 6
# steps_per_call=4: several decode calls per round. Where a round cuts its samples depends on the
# decode chunking (stop strings are found on the host after each call), so every run here uses it.
PARTIAL = ("--config.partial_rollouts.enabled=True", f"--config.total_steps={STEPS}",
           "--config.checkpoint.every_steps=2", "--config.eval.every_steps=0",
           "--config.rollout.steps_per_call=4")


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("partial")
  train(workdir, *PARTIAL)
  return workdir


def test_rounds_carry_samples_over_and_bound_and_correct_their_lag(partial_run):
  rows = read_metrics(partial_run / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert rows[0]["rollout/partial/groups_carried"] == 0  # nothing was in flight before step 1
  assert rows[0]["rollout/partial/token_lag_max"] == 0
  later = rows[1:]
  assert all(r["rollout/partial/groups_in_flight"] == 8 for r in rows)  # 2 x num_prompts
  assert all(r["rollout/partial/groups_carried"] >= 4 for r in later)
  assert sum(r["rollout/partial/tokens_resumed"] for r in later) > 0
  assert max(r["rollout/partial/token_lag_max"] for r in rows) >= 1  # trained stale tokens
  assert all(r["rollout/partial/token_lag_max"] <= 2 for r in rows)  # max_lag's default
  assert all(r["policy_lag"] == r["rollout/partial/token_lag_max"] for r in rows)
  # the per-token correction ran: weights applied and the old policy differed from μ
  assert all(r["train/tis/weight"] > 0 for r in rows)
  assert any(r["rollout/partial/token_lag_max"] > 0 and r["train/tis/abs_log_diff"] > 1e-4
             for r in rows)


def test_max_lag_zero_restarts_every_stale_sample(tmp_path):
  train(tmp_path, *PARTIAL, "--config.total_steps=3", "--config.partial_rollouts.max_lag=0",
        "--config.checkpoint.every_steps=100")
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert all(r["rollout/partial/token_lag_max"] == 0 for r in rows)
  assert all(r["rollout/partial/stale_token_frac"] == 0 for r in rows)
  assert sum(r["rollout/partial/samples_restarted"] for r in rows[1:]) > 0


def test_sigkill_mid_round_then_resume_reproduces_the_partial_run(partial_run, tmp_path):
  """Killed inside step 4's round (its second decode call), with step 2's checkpoint holding
  the samples in flight after step 2; the rerun redoes steps 3 and 4 from them."""
  resumed = killed_then_resumed(tmp_path, "generate", 3, *PARTIAL)
  assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
  assert stable(resumed) == stable(read_metrics(partial_run / "metrics.jsonl"))


def test_a_stop_in_the_middle_of_a_round_keeps_what_was_in_flight(
    partial_run, tmp_path, own_signal_handlers):  # noqa: F811
  """SIGTERM during step 3's round (after step 2's checkpoint): the round is abandoned, the loop
  state saved at step 2 still holds step 2's in-flight samples, and the rerun equals the
  uninterrupted run."""
  sys.path.insert(0, str(REPO))
  from configs import debug_cpu

  from reasoning_rl.build import build
  from reasoning_rl.trainer import Trainer

  config = debug_cpu.get_config()
  config.workdir = str(tmp_path)
  config.logging.progress_bar = False
  config.partial_rollouts.enabled = True
  config.total_steps, config.checkpoint.every_steps, config.eval.every_steps = STEPS, 2, 0
  config.rollout.steps_per_call = 4
  run = build(config)
  calls = sigterm_in_first_decode_call(run, version=2)  # step 3's round
  assert Trainer(run).run() == 143
  assert len(calls) == 1
  assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
  train(tmp_path, *PARTIAL)
  assert stable(read_metrics(tmp_path / "metrics.jsonl")) == stable(
      read_metrics(partial_run / "metrics.jsonl"))


@pytest.mark.parametrize("overrides, field", [
    ({"rollout.exact_logprobs": True}, "partial_rollouts.enabled"),
    ({"dynamic_sampling.enabled": True}, "partial_rollouts.enabled"),
    ({"async_rollouts.enabled": True}, "async_rollouts.enabled"),
    ({"partial_rollouts.groups_in_flight": 4}, "partial_rollouts.groups_in_flight"),
])
def test_what_partial_rollouts_cannot_be_combined_with_is_refused(overrides, field):
  config = base_config()
  config.workdir, config.model.tokenizer = "/tmp/unused", "debug_arithmetic"
  config.partial_rollouts.enabled = True
  for name, value in overrides.items():
    section, _, key = name.rpartition(".")
    (config[section] if section else config)[key] = value
  with pytest.raises(ConfigError, match=f"^config.{field}"):
    config_lib.validate(config, num_devices=1)
