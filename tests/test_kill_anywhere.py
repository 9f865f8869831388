"""A SIGKILL at any moment of a step, then a rerun, gives the metrics of the uninterrupted run:
killed mid-generation, while sampling ahead (asynchronous rollouts), while the verifier workers
still hold groups, while the update computes, inside the weight sync and while a checkpoint is
written (tests/kill_point.py kills the process at that point). What was in
flight is either in the checkpoint (batches sampled ahead, partial rollouts' samples) or redone
from it: completions depend only on (seed, data position, sample index) and the weights, and
the weights and data position are the checkpoint's."""

import pytest

from reasoning_rl.checkpointing import Checkpointer
from reasoning_rl.metrics import read_metrics
from tests.support.runs import killed_at, killed_then_resumed, stable, train


SHORT = ("--config.total_steps=4", "--config.checkpoint.every_steps=2",
         "--config.eval.every_steps=0", "--config.verifier.num_workers=2",
         "--config.rollout.steps_per_call=4")  # several decode calls per step
ASYNC = ("--config.async_rollouts.enabled=True", "--config.async_rollouts.max_staleness=1")


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("sync")
  train(workdir, *SHORT)
  return read_metrics(workdir / "metrics.jsonl")


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("async")
  train(workdir, *SHORT, *ASYNC)
  return read_metrics(workdir / "metrics.jsonl")


# Where a step can be killed with the sampler at policy version 3 or 4, in the order one run meets
# them when each rerun is killed again: `train` counts the updates its own process dispatched (the
# 4th exists only in a run that starts from scratch), the others name the policy version.
SYNC_KILLS = (
    ("train", 3),  # step 4's update of version 3 is running; the checkpoint holds step 2
    ("generate", 3),  # step 4 samples with version 3 (mid-generation)
    ("scoring", 3),  # the verifier workers hold step 4's groups
    ("sync", 3),  # the sampler already holds version 4, the loop has not counted it
    # step 4's row is written and its save started: the rerun resumes from whichever checkpoint
    # is complete (step 2, or 4 where Orbax's write finished first)
    ("checkpoint", 4),
)


def test_killed_at_every_point_of_a_step_in_turn_then_resumed(sync_run, tmp_path):
  """One run killed inside step 4 at each point of SYNC_KILLS in turn, each rerun resuming from
  what the kill before left (so each point is also a kill of a resumed run); the last rerun ends
  with the metrics of the run never killed. (One chain: 6 processes instead of 10.)"""
  for point, version in SYNC_KILLS:
    killed_at(tmp_path, point, version, *SHORT)
  train(tmp_path, *SHORT)
  assert stable(read_metrics(tmp_path / "metrics.jsonl")) == stable(sync_run)


def test_killed_while_sampling_ahead(async_run, tmp_path):
  # step 3 trains while batch 4 is sampled with version 2; the checkpoint of step 2 holds batch
  # 3, sampled ahead with version 1, in its queue
  resumed = killed_then_resumed(tmp_path, "generate", 2, *SHORT, *ASYNC)
  assert stable(resumed) == stable(async_run)
  assert [r["policy_lag"] for r in resumed] == [0, 1, 1, 1]


def test_killed_after_time_based_checkpoints(sync_run, tmp_path):
  """checkpoint.every_minutes (here 6 ms: every step whose predecessor's save is done) chooses
  the saved steps by the clock, so they differ from run to run; the steps on the every_steps
  cadence (100) never come. Killed in step 4, the rerun resumes from whichever step the clock
  saved and ends with the metrics of the run that saved every 2 steps."""
  timed = [o for o in SHORT if "every_steps" not in o] + [
      "--config.checkpoint.every_steps=100", "--config.checkpoint.every_minutes=0.0001"]
  saved = []

  def time_based_only(workdir):
    saved.extend(Checkpointer(workdir / "checkpoints").all_steps())

  resumed = killed_then_resumed(tmp_path, "generate", 3, *timed, after_kill=time_based_only)
  assert saved and set(saved) <= {1, 2, 3}, saved
  assert stable(resumed) == stable(sync_run)
