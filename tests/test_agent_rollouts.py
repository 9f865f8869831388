"""Agent programs as rollouts (reasoning_rl/agents/collector.py): failures dropped and counted,
short groups skipped or filled with rows that train nothing, the guard, and a debug run that
trains on an agent's episodes."""

import dataclasses
import json
import time
import types

import numpy as np
import pytest

from reasoning_rl import guards as guards_lib
from reasoning_rl.agents import collector as collector_lib
from reasoning_rl.data.debug_vocab import debug_arithmetic_tokenizer
from reasoning_rl.errors import ConfigError, PhaseInterrupted
from reasoning_rl.models.transformer import create_model
from reasoning_rl.sampler.api import Completion
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.sampling import SamplingParams
from tests.support import agents
from tests.support.runs import train
from tests.support.sampler import CONFIG, perturbed


def row(tokens, mask):
  return Completion(prompt_id=0, sample_index=0, prompt_tokens=[1, 5], completion_ids=tokens,
                    logprobs=[-1.0 * m for m in mask], sampling_logprobs=None,
                    finish_reason="stop_id", truncated=False, policy_version=0, loss_mask=mask,
                    turns=[{"model_text": "7", "num_tokens": sum(mask),
                            "finish_reason": "stop_id"}], episode_end="agent",
                    scored_response="7")


def test_failed_episodes_are_dropped_short_groups_skipped_or_filled():
  ok = lambda r, malformed=0: collector_lib.Episode(
      [row([9, 2], [1, 1])], collector_lib.reward_of(r), malformed_tool_calls=malformed)
  bad = collector_lib.Episode([], error="RuntimeError: boom", malformed_tool_calls=1)
  episodes = {10: [ok(1.0), ok(0.0, malformed=2), ok({"agent": 0.25, "bonus": 0.25}), bad],
              11: [ok(1.0), bad, bad, bad]}
  groups, segments, stats = collector_lib.groups_of(
      episodes, [10, 11], group_size=4, min_episodes=2, tokenizer=debug_arithmetic_tokenizer(),
      sampling=SamplingParams())
  assert len(segments) == 0
  assert stats == {"failed_frac": 4 / 8, "failed": 4, "groups_skipped": 1,
                   "placeholder_rows": 1, "split_segments_trained": 0,
                   "split_segments_dropped": 0,
                   # botched tool calls of every episode, failed ones included: 2 + 4 × 1
                   "malformed_tool_calls": 6}
  [group] = groups
  # the filled row: the group's mean reward, no trained token
  np.testing.assert_allclose(group.rewards, [1.0, 0.0, 0.5, 0.5])
  assert group.rewards.mean() == pytest.approx(np.mean([1.0, 0.0, 0.5]))
  # every part on every row (0 where an episode did not return it), the filled row's the mean
  np.testing.assert_allclose(group.parts["agent"], [1.0, 0.0, 0.25, 1.25 / 3])
  np.testing.assert_allclose(group.parts["bonus"], [0.0, 0.0, 0.25, 0.25 / 3])
  assert group.completion_ids[3].tolist() == [5] and group.loss_mask[3].tolist() == [0]
  assert group.loss_mask[0].tolist() == [1, 1]


def test_reward_of_numbers_and_parts():
  assert collector_lib.reward_of(0.5).parts == {"agent": 0.5}
  reward = collector_lib.reward_of({"correct": 1.0, "style": 0.25})
  assert (reward.total, reward.parts) == (1.25, {"correct": 1.0, "style": 0.25})
  with pytest.raises(TypeError):
    collector_lib.reward_of("1")


def test_entries_are_loaded_or_refused_by_name():
  assert collector_lib.load_entry("tests.support.agents:two_turns") is agents.two_turns
  for bad in ("tests.support.agents", "tests.support.agents:missing",
              "tests.support.agents:sync_function"):
    with pytest.raises(ConfigError, match="config.agent.entry"):
      collector_lib.load_entry(bad)


def test_the_failure_guard_trips_above_agent_max_failed_frac():
  guards = guards_lib.Guards({}, max_failed_episode_frac=0.25)
  assert guards.check_step(1, {"episode/failed_frac": 0.25}) is None
  trip = guards.check_step(2, {"episode/failed_frac": 0.5})
  assert trip.guard == "max_failed_frac" and "agent.max_failed_frac=0.25" in trip.message
  assert guards_lib.Guards({}).check_step(1, {"episode/failed_frac": 1.0}) is None  # off


def test_agents_that_raise_or_time_out_are_counted_and_dropped():
  tokenizer = debug_arithmetic_tokenizer().with_chat_template(agents.PLAIN_TEMPLATE)
  model = perturbed(create_model(dataclasses.replace(CONFIG, vocab_size=tokenizer.vocab_size),
                                 seed=1), 1)
  engine = Engine(model, max_concurrent_decodes=8, max_prefill_length=32, max_decode_length=8,
                  steps_per_call=4)
  settings = collector_lib.AgentSettings(entry="tests.support.agents:flaky",
                                         episode_timeout_s=10.0, min_episodes_per_group=2)
  collector = collector_lib.AgentCollector(
      types.SimpleNamespace(engine=engine), tokenizer, settings, num_samples=2,
      max_new_tokens=8, sampling=SamplingParams(), seed=0)
  try:
    # compiled first (the deadline counts an episode's whole wall time): the same requests
    examples = [(0, {"prompt": "1+2"}), (1, {"prompt": "7+1"}), (2, {"prompt": "3+1"})]
    collector.run_episodes(examples)
    examples[2] = (2, {"prompt": "9+1"})
    batch = collector.sample_batch(lambda n: examples[:n], num_prompts=3,
                                   dynamic_sampling=False, max_rounds=1, policy_version=0)
    # a stop request (preemption) ends the step's episodes at once
    started = time.perf_counter()
    with pytest.raises(PhaseInterrupted, match="agent episodes stopped on request"):
      collector.run_episodes([(5, {"prompt": "9+9"})], should_stop=lambda: True)
    assert time.perf_counter() - started < 5.0
  finally:
    collector.close()
  assert batch.agent["failed"] == 4 and batch.agent["failed_frac"] == pytest.approx(4 / 6)
  assert batch.agent["groups_skipped"] == 2
  assert batch.rollouts.num_groups == 1 and batch.rollouts.data_position.tolist() == [0]


def test_a_debug_run_trains_on_an_agents_episodes(tmp_path):
  train(tmp_path, "--config.total_steps=2",
        "--config.agent.entry=tests.support.agents:completion_agent",
        )
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if "episode/failed_frac" in r]
  assert len(steps) == 2
  assert all(r["episode/failed_frac"] == 0.0 and "reward/correct" in r for r in steps)
  # an update that moved the weights, on the agent's tokens
  assert all(np.isfinite(r["loss"]) and r["train/grad_norm"] > 0 and r["skipped_update"] == 0
             for r in steps)
  assert steps[0]["episode/turns_mean"] == 2.0
  records = [json.loads(line) for line in
             (tmp_path / "rollouts" / "step_00000001.jsonl").read_text().splitlines()]
  assert {r["verifier_version"] for r in records} == {
      "agent=tests.support.agents:completion_agent"}
  assert all(len(r["turns"]) == 2 for r in records)
