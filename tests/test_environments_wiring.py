"""The environment red team at a run's start-up (`build.enforce_environment_redteam`)."""

import logging
import sys

import pytest

from reasoning_rl import build
from reasoning_rl import config as config_lib
from reasoning_rl.config import base_config
from reasoning_rl.environments import Turn, build_environment
from reasoning_rl.environments import redteam as env_redteam
from reasoning_rl.errors import VerifierError
from reasoning_rl.sampler import EpisodeSettings
from tests.conftest import REPO
from tests.support.configs import demo_config


sys.path.insert(0, str(REPO))  # configs/ import each other as `configs.…`


def episodes_of(name, settings=None):
  return EpisodeSettings(environment=build_environment(name, settings),
                         format_observation=str, max_turns=2, turn_tokens=8)


def test_a_sound_python_tool_passes_its_red_team_at_start_up():
  config = base_config()
  results = build.enforce_environment_redteam(config, episodes_of("python_tool",
                                                                  {"timeout_s": 1.0}))
  assert len(results) >= 5 and all(r.held for r in results)
  assert build.enforce_environment_redteam(config, episodes_of("calculator")) == []  # none to run
  config.verifier.redteam = False
  assert build.enforce_environment_redteam(config, episodes_of("python_tool")) == []


def test_a_probe_that_does_not_hold_stops_the_run_unless_allowed(monkeypatch, caplog):
  broken = env_redteam.ProbeResult("printed_answer", False, "correct=1.0, not 0.0",
                                   {"correct": 1.0}, ("42",), 0.1)
  monkeypatch.setattr(build, "run_python_tool_redteam", lambda environment: [broken])
  config = base_config()
  with pytest.raises(VerifierError, match=r"printed_answer: correct=1.0, not 0.0"):
    build.enforce_environment_redteam(config, episodes_of("python_tool"))
  config.verifier.allow_exploits = True
  with caplog.at_level(logging.WARNING, logger="reasoning_rl"):
    assert build.enforce_environment_redteam(config, episodes_of("python_tool")) == [broken]
  assert "RED TEAM OVERRIDDEN" in caplog.text


def test_the_calculator_demo_plays_the_demo_task_with_the_tool_and_validates():
  config = demo_config("smollm2_calculator")
  demo = demo_config("smollm2_arithmetic")
  assert config.data.train == demo.data.train and config.data.eval == demo.data.eval
  config_lib.validate(config, num_devices=8)
  # what the run builds from the config: an episode whose turns end at "=" and get the exact
  # value back, at most max_calls (4) times, then the episode ends without an observation
  episodes = build.build_episodes(config, tokenizer=None)
  assert (episodes.max_turns, episodes.turn_tokens) == (5, 64)
  assert episodes.environment.turn_stop_strings == ("=",)
  episode = episodes.environment.reset(None, seed=0)
  values = [episode.step(text) for text in ("17 + 25 =", "42 * 3 =", "7 / 2 =", "1 - 9 =")]
  assert [episodes.format_observation(t.observation) for t in values] == ["42", "126", "7/2", "-8"]
  assert episode.step("5 + 5 =") == Turn(None, True, {}, {"calls": 4})  # the fifth call
  # the demo's verifier scores the whole conversation: the tool's value then the final answer
  reward_fn = build.build_reward_fn(config, redteam=False)
  conversation = "17 + 25 =42, so the answer is 42."
  scored = [reward_fn({"prompt": "What is 17 + 25?", "completion": text, "ground_truth": "42"})
            for text in (conversation, conversation.replace("is 42", "is 43"))]
  assert [r.total for r in scored] == [1.0, 0.0]


def test_replay_rescores_an_environment_part_from_the_record(tmp_path):
  from reasoning_rl.metrics import MetricsWriter  # pylint: disable=import-outside-toplevel
  from reasoning_rl.replay import replay  # pylint: disable=import-outside-toplevel

  def record(index, correct):
    return {"step": 1, "prompt_id": index, "group_id": index, "sample_index": 0,
            "prompt": "p", "task_prompt": "What is the secret?", "completion": "It is 7.",
            "reward": correct, "reward/correct": correct, "advantage": 0.0, "num_tokens": 4,
            "truncated": False, "policy_version": 0, "verifier_version": "correct=environment-1",
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16, "seed": 0},
            "ground_truth": "7", "task": "guess_number", "metadata": {}, "tests": [],
            "environment_parts": {"correct": correct}}

  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write_rollouts(1, [record(0, 1.0), record(1, 0.0)])
  rewards = {"correct": {"weight": 1.0, "kind": "environment", "part": "correct"}}
  assert replay(tmp_path, rewards).changed == []
  halved = replay(tmp_path, {"correct": dict(rewards["correct"], weight=0.5)})
  assert [(c.prompt_id, c.old_total, c.new_total) for c in halved.changed] == [(0, 1.0, 0.5)]
