"""Every segment of a split agent episode trains, with its episode's advantage
(`agent.segment_rows`, reasoning_rl/rl/segment_rows.py, agents/collector.py).

The episodes are recorded by the session bookkeeping the server uses (`sessions.Session`, under
`split`), so their segments are the rows a run gets. The expected rows, advantages and the
reference gradient are written out here from the turn scripts and the definitions (Dr. GRPO's
A = r − mean of the group, Liu et al. 2025; token-mean / seq-mean-token-mean aggregation at ratio 1,
where the clipped surrogate's gradient is A·∇log π), not through the code under test.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reasoning_rl import config as config_lib
from reasoning_rl.agents import collector as collector_lib
from reasoning_rl.agents.sessions import Session
from reasoning_rl.data.debug_vocab import debug_arithmetic_tokenizer
from reasoning_rl.errors import ConfigError
from reasoning_rl.loop.rl_stage import with_advantages_and_batch
from reasoning_rl.loop.state import SampledBatch
from reasoning_rl.rl import packing
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.rl.rollout_columns import RolloutColumns
from reasoning_rl.rl.step_config import StepConfig
from reasoning_rl.sampler.sampling import SamplingParams
from tests.support.configs import debug_config
from tests.support.runs import train
from tests.support.steps import assert_same_gradient, fresh_params, step_gradient

G, PROMPT, COMPLETION = 4, 5, 6  # the step helpers' model: rows of 5 + 6 positions


def episode(turns, reward):
  """An episode recorded as the server records it: `turns` are (rendered prompt, drawn tokens);
  a rendered prompt that does not extend the session's tokens splits it."""
  session = Session("s", on_mismatch="split")
  for rendered, drawn in turns:
    session.begin_turn(rendered)
    session.end_turn(tokens=drawn, logprobs=[-0.5] * len(drawn),
                     sampling_logprobs=[-0.5] * len(drawn), versions=[0] * len(drawn),
                     finish_reason="stop_id", text="")
  return collector_lib.Episode(
      session.completions(prompt_id=0, sample_index=0, keep_sampling_logprobs=False),
      collector_lib.reward_of(reward))


FAILED = collector_lib.Episode([], error="RuntimeError: boom")
# Group 10: episode 0 splits once, episode 2 three times (its first segment holds a context token,
# loss mask 0), episode 3 failed (a placeholder row). Group 11: episode 0 splits once; episode 3's
# first prompt is not the group's.
EPISODES = {
    10: [episode([([1, 5, 6], [7, 8]), ([1, 5, 9, 4], [10, 11])], 1.0),
         episode([([1, 5, 6], [7, 2, 3])], 0.0),
         episode([([1, 5, 6], [7, 8]), ([1, 5, 6, 7, 8, 3], [9]),
                  ([1, 5, 2, 3, 4], [12, 13]), ([1, 4, 4], [14, 15, 16])], 0.25),
         FAILED],
    11: [episode([([1, 6, 6], [2]), ([1, 6, 3, 5], [8, 9, 10])], 0.0),
         episode([([1, 6, 6], [4, 4])], 1.0),
         episode([([1, 6, 6], [3])], 1.0),
         episode([([1, 6, 5], [5, 6, 7])], 0.25)],
}
# Dr. GRPO advantages by hand: group 10's rewards 1, 0, 0.25 and the placeholder at their mean
# 5/12; group 11's 0, 1, 1, 0.25 (mean 0.5625).
ADVANTAGE = {(10, 0): 7 / 12, (10, 1): -5 / 12, (10, 2): -2 / 12, (10, 3): 0.0,
             (11, 0): -0.5625, (11, 1): 0.4375, (11, 2): 0.4375, (11, 3): -0.3125}
# The group rows, read off the turn scripts: (episode, prompt, completion, loss mask) of each
# episode's first segment, None for a row that trains nothing (the failed episode's; episode
# (11, 3)'s, whose prompt is not the group's).
GROUP_ROWS = [((10, 0), [1, 5, 6], [7, 8], [1, 1]),
              ((10, 1), [1, 5, 6], [7, 2, 3], [1, 1, 1]),
              ((10, 2), [1, 5, 6], [7, 8, 3, 9], [1, 1, 0, 1]),
              None,
              ((11, 0), [1, 6, 6], [2], [1]),
              ((11, 1), [1, 6, 6], [4, 4], [1, 1]),
              ((11, 2), [1, 6, 6], [3], [1]),
              None]
# The other segments, in the order they fill the extra rows.
OTHERS = [((10, 0), [1, 5, 9, 4], [10, 11], [1, 1]),
          ((10, 2), [1, 5, 2, 3, 4], [12, 13], [1, 1]),
          ((10, 2), [1, 4, 4], [14, 15, 16], [1, 1, 1]),
          ((11, 0), [1, 6, 3, 5], [8, 9, 10], [1, 1, 1]),
          ((11, 3), [1, 6, 5], [5, 6, 7], [1, 1, 1])]
TRAINED = [row for row in GROUP_ROWS if row is not None] + OTHERS


def agent_config(segment_rows):
  return debug_config(**{
      "agent.entry": "tests.support.agents:splitting_agent", "agent.segment_rows": segment_rows,
      "rollout.num_prompts": 2, "rollout.num_samples": G, "rollout.max_prefill_length": PROMPT,
      "rollout.max_new_tokens": COMPLETION, "algo.estimator": "dr_grpo"})


def step_batch(episodes, segment_rows):
  """(sampled batch with advantages, the step's padded batch), as the loop makes them."""
  groups, segments, stats = collector_lib.groups_of(
      episodes, sorted(episodes), group_size=G, min_episodes=2,
      tokenizer=debug_arithmetic_tokenizer(), sampling=SamplingParams(),
      segment_rows=segment_rows)
  sampled = SampledBatch(
      rollouts=RolloutColumns.concat(groups, group_size=G), outcome={}, groups_sampled=2,
      scoring={}, sample_s=0.0, verify_s=0.0, policy_version=0, agent=stats,
      segments=segments if segment_rows else None)
  return with_advantages_and_batch(sampled, agent_config(segment_rows), pad_id=0,
                                   with_behavior_logprobs=False, truncation=False,
                                   with_routing=False)


def padded_row(prompt, completion, mask):
  tokens = [0] * (PROMPT - len(prompt)) + prompt + completion + [0] * (COMPLETION - len(completion))
  return tokens, mask + [0] * (COMPLETION - len(mask))


def test_every_segment_is_a_row_with_its_episodes_advantage():
  sampled, batch = step_batch(EPISODES, segment_rows=6)
  assert sampled.agent["split_segments_trained"] == 5
  assert sampled.agent["split_segments_dropped"] == 0
  assert batch["tokens"].shape == (2 * G + 6, PROMPT + COMPLETION)
  for row, expected in enumerate(GROUP_ROWS + OTHERS):
    if expected is None:  # trains nothing, attends to its group's prompt
      assert batch["completion_mask"][row].sum() == 0 and batch["attention_mask"][row].any()
      continue
    key, prompt, completion, mask = expected
    tokens, completion_mask = padded_row(prompt, completion, mask)
    np.testing.assert_array_equal(batch["tokens"][row], tokens)
    np.testing.assert_array_equal(batch["completion_mask"][row], completion_mask)
    np.testing.assert_array_equal(batch["attention_mask"][row], np.array(tokens) != 0)
    assert batch["advantages"][row] == pytest.approx(ADVANTAGE[key]), row
  assert batch["attention_mask"][-1].sum() == 0 and batch["advantages"][-1] == 0  # unused row
  # every model token of every episode that finished is trained exactly once: the scripts drew
  # 4 + 3 + 8 and 4 + 2 + 1 + 3
  assert batch["completion_mask"].sum() == sum(sum(m) for *_, m in TRAINED) == 25
  # the group rows carry their episodes' rewards and outcomes: every turn, the last one's end
  np.testing.assert_allclose(sampled.rollouts.rewards, [1, 0, 0.25, 5 / 12, 0, 1, 1, 0.25])
  assert [len(e["turns"]) for e in sampled.rollouts.episodes] == [2, 1, 4, 1, 2, 1, 1, 1]
  assert sampled.rollouts.completion_ids[7].tolist() == [6]  # (11, 3): the group's prompt


def test_segments_past_the_rows_are_counted_not_trained():
  sampled, batch = step_batch(EPISODES, segment_rows=4)
  assert sampled.agent["split_segments_trained"] == 4
  assert sampled.agent["split_segments_dropped"] == 1
  assert batch["tokens"].shape[0] == 2 * G + 4
  # rows fill in order: episode (11, 3)'s segment is the one left out
  np.testing.assert_array_equal(batch["tokens"][-1], padded_row(*OTHERS[3][1:3], [])[0])
  # without rows every other segment is counted, and the batch is the groups' rows alone
  sampled, batch = step_batch(EPISODES, segment_rows=0)
  counts = sampled.agent["split_segments_trained"], sampled.agent["split_segments_dropped"]
  assert counts == (0, 5)
  assert batch["tokens"].shape[0] == 2 * G and sampled.segments is None


def reference_gradient(sequences, loss_agg):
  """The objective's gradient from each sequence alone (its own forward, no padding): token-mean
  GRPO at ratio 1 is −Σ_i A_i Σ_t m_it ∇log π / Σ_i Σ_t m_it; seq-mean-token-mean is
  −(1/N) Σ_i A_i Σ_t m_it ∇log π / Σ_t m_it over the N sequences with a trained token — each
  segment one sequence."""
  graphdef, params = fresh_params(0)

  def loss(p):
    model = nnx.merge(graphdef, p)
    terms, weights = [], []
    for key, prompt, completion, mask in sequences:
      tokens = jnp.asarray([prompt + completion])
      logprobs = completion_logprobs(model, tokens, jnp.ones_like(tokens), len(completion))[0][0]
      m = jnp.asarray(mask, jnp.float32)
      terms.append(ADVANTAGE[key] * jnp.sum(logprobs * m))
      weights.append(sum(mask))
    if loss_agg == "token-mean":
      return -sum(terms) / sum(weights)
    return -sum(t / w for t, w in zip(terms, weights)) / len(terms)

  return [np.asarray(g, np.float64) for g in jax.tree.leaves(jax.grad(loss)(params))]


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
def test_the_steps_gradient_is_the_per_segment_objectives(loss_agg):
  _, batch = step_batch(EPISODES, segment_rows=6)
  config = StepConfig(learning_rate=1e-2, loss_agg=loss_agg, num_micro_batches=2)
  expected = reference_gradient(TRAINED, loss_agg)
  padded, stats = step_gradient(config, batch)
  assert_same_gradient(padded, expected)
  # the loss at ratio 1 is the advantages' mean over sequences (or tokens): 11 sequences, the
  # placeholder row not one of them
  weights = [1] * 11 if loss_agg != "token-mean" else [sum(m) for *_, m in TRAINED]
  advantages = [ADVANTAGE[key] for key, *_ in TRAINED]
  np.testing.assert_allclose(stats["loss"], -np.average(advantages, weights=weights), atol=1e-6)
  if loss_agg == "seq-mean-token-mean":  # packed (the RL default): the same gradient
    packed, _ = packing.pack_batch(batch, num_micro_batches=2)
    assert_same_gradient(step_gradient(config, packed)[0], expected)


def test_a_step_without_splits_is_unchanged_and_empty_rows_change_nothing():
  plain = {10: [EPISODES[10][1], episode([([1, 5, 6], [3, 3])], 1.0), FAILED],
           11: EPISODES[11][1:3] + [episode([([1, 6, 6], [5])], 0.5), FAILED]}
  before_sampled, before = step_batch(plain, segment_rows=0)
  # the groups as the collector made them before segments had rows: each episode's one
  # completion, the failed ones filled from the group's first row
  for position, group in zip((10, 11), (before_sampled.rollouts.take_groups([0]),
                                        before_sampled.rollouts.take_groups([1]))):
    done = [e for e in plain[position] if e.error is None]
    rows = [e.completions[0] for e in done]
    rows += [collector_lib._placeholder(rows[0], len(rows)) for _ in range(G - len(rows))]
    rewards = [e.reward.total for e in done]
    expected = RolloutColumns.of_group(
        position, rows, [r.scored_text(debug_arithmetic_tokenizer()) for r in rows],
        status="ok", sampling=SamplingParams(), rewards=[
            collector_lib.reward_of(r) for r in rewards + [np.mean(rewards)] * (G - len(done))])
    assert dataclasses.replace(group, advantages=None) == expected
  sampled, after = step_batch(plain, segment_rows=4)
  assert sampled.agent["split_segments_trained"] == sampled.agent["split_segments_dropped"] == 0
  for name, value in before.items():  # the groups' rows as before, then 4 rows of nothing
    np.testing.assert_array_equal(after[name][:2 * G], value)
    assert not after[name][2 * G:].any()
  config = StepConfig(learning_rate=1e-2, num_micro_batches=2)
  without, without_stats = step_gradient(config, before)
  with_rows, with_stats = step_gradient(config, after)
  assert_same_gradient(with_rows, without, rtol=1e-6)
  assert with_stats["loss"] == pytest.approx(without_stats["loss"], abs=1e-7)


def test_segments_travel_in_the_loop_state():
  sampled, _ = step_batch(EPISODES, segment_rows=6)
  again = SampledBatch.from_json(json.loads(json.dumps(sampled.to_json())))
  assert again.segments == sampled.segments and again.rollouts == sampled.rollouts
  assert again.segments.episode_sample.tolist() == [0, 2, 2, 4, 7]
  # a batch without segments keeps the loop state's earlier form
  assert "segments" not in dataclasses.replace(sampled, segments=None).to_json()


def test_the_setting_is_validated_by_name():
  config_lib.validate(agent_config(8))
  for overrides, needle in (({"agent.history_mismatch": "refuse"}, "never splits"),
                            ({"algo.name": "ppo"}, "PPO"),
                            ({"agent.segment_rows": 3, "algo.num_mini_batches": 2}, "must divide")):
    config = agent_config(8)
    for dotted, value in overrides.items():
      *parents, last = dotted.split(".")
      node = config
      for part in parents:
        node = node[part]
      node[last] = value
    with pytest.raises(ConfigError, match=f"config.agent.segment_rows.*{needle}"):
      config_lib.validate(config)
  assert config_lib.batch_rows(agent_config(8)) == 2 * G + 8


def test_a_debug_run_trains_every_segment(tmp_path):
  train(tmp_path, "--config.total_steps=2",
        "--config.agent.entry=tests.support.agents:splitting_agent",
        "--config.agent.segment_rows=8")
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if "episode/failed_frac" in r]
  assert len(steps) == 2
  for r in steps:  # 16 episodes, each split once: 8 first turns trained, 8 counted
    assert r["episode/failed_frac"] == 0.0
    assert r["episode/split_segments_trained"] == 8 and r["episode/split_segments_dropped"] == 8
    assert np.isfinite(r["loss"]) and r["train/grad_norm"] > 0 and r["skipped_update"] == 0
