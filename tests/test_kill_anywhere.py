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
from tests.support.runs import killed_then_resumed, stable, train


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


def test_killed_mid_generation(sync_run, tmp_path):
  # step 4 samples with version 3; the checkpoint holds step 2
  assert stable(killed_then_resumed(tmp_path, "generate", 3, *SHORT)) == stable(sync_run)


def test_killed_while_the_verifiers_hold_groups(sync_run, tmp_path):
  assert stable(killed_then_resumed(tmp_path, "scoring", 3, *SHORT)) == stable(sync_run)


def test_killed_while_sampling_ahead(async_run, tmp_path):
  # step 3 trains while batch 4 is sampled with version 2; the checkpoint of step 2 holds batch
  # 3, sampled ahead with version 1, in its queue
  resumed = killed_then_resumed(tmp_path, "generate", 2, *SHORT, *ASYNC)
  assert stable(resumed) == stable(async_run)
  assert [r["policy_lag"] for r in resumed] == [0, 1, 1, 1]


def test_killed_while_the_update_computes(sync_run, tmp_path):
  # step 4's update of version 3 is running; the checkpoint holds step 2
  assert stable(killed_then_resumed(tmp_path, "train", 3, *SHORT)) == stable(sync_run)


def test_killed_inside_the_weight_sync(sync_run, tmp_path):
  # the sampler already holds version 4, the loop has not counted it: step 4 is redone from 2
  assert stable(killed_then_resumed(tmp_path, "sync", 3, *SHORT)) == stable(sync_run)


def test_killed_while_a_checkpoint_is_written(sync_run, tmp_path):
  """Step 4's row is written and its save started: the rerun resumes from whichever checkpoint
  is complete (step 2, or 4 where Orbax's write finished first) and ends with the same rows."""
  assert stable(killed_then_resumed(tmp_path, "checkpoint", 4, *SHORT)) == stable(sync_run)


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
