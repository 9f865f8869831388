"""Hub environments through the real trainer (launch/train.py, the debug model): a verifiers
taskset (tests/data/hub_envs/verifiers_addition, configs/debug_verifiers_agent.py) and an OpenEnv
environment (tests/data/hub_envs/openenv_guess), each trained for two steps.

Every trained sample is checked by recomputation: its reward is the environment's rule applied to
the text the rollout server recorded for it (the rollout records' `turns`), its number of model
turns is what the environment's rule allows, no episode failed, and each update moved the weights
(finite loss, gradient norm > 0). The debug model is random, so its answers are mostly wrong; what
matters is that the reward is the rule's on the recorded text.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from tests.support.runs import rollouts

HUB_ENVS = REPO / "tests" / "data" / "hub_envs"
STEPS = 2


@pytest.fixture
def hub_env_path(monkeypatch, tmp_path):
  """Both test environments importable here (sys.path) and in the trainer (PYTHONPATH), and the
  trainer's HOME under tmp_path (verifiers keeps its runtime folders in ~/.cache)."""
  folders = [str(HUB_ENVS / "verifiers_addition"), str(HUB_ENVS / "openenv_guess")]
  for folder in folders:
    monkeypatch.syspath_prepend(folder)
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [str(REPO), *folders, *filter(None, [os.environ.get("PYTHONPATH")])]))
  monkeypatch.setenv("HOME", str(tmp_path / "home"))


def train(config: str, workdir, *overrides):
  command = [sys.executable, str(REPO / "launch" / "train.py"), f"--config={config}",
             f"--config.workdir={workdir}", "--config.logging.progress_bar=False",
             f"--config.total_steps={STEPS}", *overrides]
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, f"train.py exited {result.returncode}:\n{result.stderr[-4000:]}"
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if "episode/failed_frac" in r]
  assert len(steps) == STEPS
  for row in steps:  # every episode finished, nothing split, and an update that moved
    assert row["episode/failed_frac"] == 0.0 and row["episode/split_segments_dropped"] == 0
    assert np.isfinite(row["loss"]) and row["train/grad_norm"] > 0
    assert row["skipped_update"] == 0
  records = rollouts(workdir)
  assert len(records) == STEPS * 4 * 4  # debug_cpu: 4 prompts x 4 samples a step
  return steps, records


# --- verifiers -----------------------------------------------------------------------------------


def addition_tasks(count: int, seed: int) -> list[tuple[int, int]]:
  """The addition taskset's operands, drawn as its load() documents (10..99, Random(seed))."""
  draw = random.Random(seed)
  return [(draw.randint(10, 99), draw.randint(10, 99)) for _ in range(count)]


def addition_rewards(reply: str, answer: int) -> dict[str, float]:
  """The environment's rewards, weight x score: exact_answer (1) and digit_share (0.1)."""
  text = reply.strip()
  digits = sum(c.isdigit() for c in text) / len(text) if text else 0.0
  return {"exact_answer": float(text == str(answer)), "digit_share": 0.1 * digits}


def test_a_verifiers_taskset_trains_through_the_trainer(hub_env_path, tmp_path):
  steps, records = train("configs/debug_verifiers_agent.py", tmp_path / "run")
  tasks = addition_tasks(8, 0)  # the config's env_args: {"taskset": {"count": 8, "seed": 0}}
  for record in records:
    a, b = record["metadata"]["a"], record["metadata"]["b"]
    # the training data are the taskset's tasks, in order (data.train.kind='agent')
    assert (a, b) == tasks[record["prompt_id"] % len(tasks)]
    assert record["metadata"]["answer"] == a + b and record["task"] == "agent"
    assert f"{a} + {b}" in record["prompt"]  # the harness asked this task
    # one model turn (the harness's one request), its text what the reward saw
    [turn] = record["turns"]
    expected = addition_rewards(turn["model_text"], a + b)
    assert record["reward/exact_answer"] == pytest.approx(expected["exact_answer"])
    assert record["reward/digit_share"] == pytest.approx(expected["digit_share"])
    assert record["reward"] == pytest.approx(sum(expected.values())), record
    assert record["completion"] == turn["model_text"]
  assert len({r["reward"] for r in records}) > 1  # the rewards differ, so the updates train
  assert all(row["episode/turns_mean"] == 1.0 for row in steps)


# --- OpenEnv -------------------------------------------------------------------------------------


GUESS_ROWS = [json.loads(line) for line in
              (HUB_ENVS / "openenv_guess" / "guess_tasks.jsonl").read_text().splitlines()]
MAX_TURNS = 4  # configs/debug_openenv_agent.py


def guess_episode(texts: list[str], target: int, max_guesses: int) -> tuple[float, int]:
  """The guess environment's rule on an episode's replies (first digit = guess; +1 ends it,
  -0.25 otherwise; max_guesses guesses end it; a reply without a digit costs a turn, no
  reward): (its total reward, how many model turns it lasts, at most MAX_TURNS)."""
  total, guesses = 0.0, 0
  for turn, text in enumerate(texts[:MAX_TURNS], start=1):
    digits = [c for c in text if c.isdigit()]
    if not digits:
      continue
    guesses += 1
    if int(digits[0]) == target:
      return total + 1.0, turn
    total -= 0.25
    if guesses == max_guesses:
      return total, turn
  return total, MAX_TURNS


@pytest.mark.parametrize("transport", ["in_process", "server"])
def test_an_openenv_environment_trains_through_the_trainer(hub_env_path, tmp_path, transport):
  steps, records = train("configs/debug_openenv_agent.py", tmp_path / "run",
                         f"--config.agent.transport={transport}")
  for record in records:
    row = GUESS_ROWS[record["prompt_id"] % len(GUESS_ROWS)]
    assert record["metadata"]["target"] == row["target"]  # reset's arguments: the row's
    texts = [turn["model_text"] for turn in record["turns"]]
    reward, turns = guess_episode(texts, row["target"], row["max_guesses"])
    assert len(texts) == turns, record  # the environment ended it there, or max_turns did
    assert record["reward"] == pytest.approx(reward), record
    assert all(turn["num_tokens"] <= 4 for turn in record["turns"])  # agent.turn_tokens
  assert len({r["reward"] for r in records}) > 1
  for row in steps:
    assert row["episode/turns_mean"] == pytest.approx(
        np.mean([len(r["turns"]) for r in records if r["step"] == row["step"]]))
