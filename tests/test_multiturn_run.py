"""A multi-turn run through launch/train.py (configs/debug_calculator.py: a tiny random model
calling the `calculator` environment): episodes with observations reach the batch and the records,
and a SIGKILL mid-step then a rerun reproduce the uninterrupted run bit for bit (metrics,
rollout records with every turn, final train state)."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from reasoning_rl.data.debug_vocab import debug_arithmetic_tokenizer
from reasoning_rl.metrics import read_metrics
from reasoning_rl.replay import replay
from tests.conftest import REPO
from tests.support.multihost import assert_same_training
from tests.support.runs import (  # noqa: F401
    compile_cache, final_state, kill_mid_step, rollouts, stable)


CONFIG = "configs/debug_calculator.py"
TOKENIZER = debug_arithmetic_tokenizer()
RUN = ("--config.total_steps=4", "--config.checkpoint.every_steps=2",
       "--config.eval.num_examples=4", "--config.logging.rollouts_every_steps=1")


def train(workdir, *overrides):
  command = [sys.executable, str(REPO / "launch" / "train.py"), f"--config={CONFIG}",
             f"--config.workdir={workdir}", "--config.logging.progress_bar=False", *overrides]
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, f"train.py exited {result.returncode}:\n{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("calculator") / "baseline"
  train(workdir, *RUN)
  return workdir


def test_episodes_reach_the_batch_records_and_evaluation(baseline):
  rows = read_metrics(baseline / "metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert max(r["episode/turns_mean"] for r in rows) > 1.0  # the random model called the tool
  assert max(r["episode/observation_tokens_mean"] for r in rows) > 0
  records = rollouts(baseline)
  called = [r for r in records if len(r["turns"]) > 1]
  assert called
  for record in called:
    turns = record["turns"]
    # every answered turn ended at "=" and got the value of the expression before it
    for turn in turns[:-1]:
      assert turn["model_text"].endswith("=") and turn["observation"]
    # the verifiers read the whole conversation (calculator values are trusted results); the
    # debug vocabulary has no letters, so "error" is five <unk> tokens that decoding skips
    assert record["completion"] == "".join(
        t["model_text"] + (t["observation"] or "").replace("error", "") for t in turns)
    assert record["observation_tokens"] == sum(len(TOKENIZER.encode(t["observation"] or ""))
                                               for t in turns)
    assert record["num_tokens"] == sum(t["num_tokens"] for t in turns)
    for turn in turns:  # a turn's text leaves out special tokens the random model drew
      assert len(TOKENIZER.encode(turn["model_text"])) <= turn["num_tokens"]
  result = json.loads(sorted((baseline / "eval").glob("*.json"))[-1].read_text())
  assert result["turns/mean"] >= 1.0
  # the records hold what the verifiers scored: replaying them changes no reward
  rewards = json.loads((baseline / "run_config.json").read_text())["rewards"]
  assert replay(baseline, rewards).changed == []


def test_sigkill_mid_step_then_resume_reproduces_the_multi_turn_run(baseline, tmp_path):
  workdir = tmp_path / "run"
  kill_mid_step(workdir, 3, after=workdir / "checkpoints" / "2" / "CHECKSUMS.json",
                config=CONFIG, overrides=RUN)
  assert [r["step"] for r in read_metrics(workdir / "metrics.jsonl")] == [1, 2]
  train(workdir, *RUN)
  assert stable(read_metrics(workdir / "metrics.jsonl")) == stable(
      read_metrics(baseline / "metrics.jsonl"))
  assert rollouts(workdir) == rollouts(baseline)
  resumed, uninterrupted = final_state(workdir, 4), final_state(baseline, 4)
  for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
    np.testing.assert_array_equal(got, want)


def test_multi_turn_episodes_split_over_four_processes_train_like_one(tmp_path):
  """Trainer on processes 0-1, episode samplers (with their environments) on 2-3: each replica
  plays its share of the prompts, the turns travel with the rollouts, and steps 1-2 equal the
  one-process run, records included."""
  from tests import multihost_runs as runs  # pylint: disable=import-outside-toplevel

  steps = ["--config.total_steps=2", "--config.eval.num_examples=4",
           "--config.async_rollouts.enabled=False", "--config.logging.progress_bar=False"]
  reference = tmp_path / "single"
  result = runs.run_single(reference, steps, devices=8, config=CONFIG)
  assert result.returncode == 0, result.stderr[-3000:]
  workdir = tmp_path / "run"
  processes = runs.start_processes(workdir, steps + ["--config.mesh.num_trainer_devices=4"],
                                   config=CONFIG)
  codes = runs.wait_all(processes)
  assert codes == [0, 0, 0, 0], "\n".join(
      p.read_text(errors="replace")[-3000:] for p in sorted(tmp_path.glob("*.log")))
  rows, want = read_metrics(workdir / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
  assert_same_training(rows, want)
  assert [r["episode/turns_mean"] for r in rows] == [r["episode/turns_mean"] for r in want]
  assert max(r["episode/turns_mean"] for r in rows) > 1.0  # the tool was called
  assert rollouts(workdir) == rollouts(reference)
