"""Partial rollouts through launch/train.py on the debug config: rounds carry unfinished samples
across weight updates, every trained token's lag is bounded and corrected, and a run killed at
any step (or stopped in the middle of a round) resumes to the metrics of the uninterrupted run."""

import math
import sys

import pytest

from reasoning_rl import config as config_lib
from reasoning_rl.config import base_config
from reasoning_rl.errors import ConfigError
from reasoning_rl.metrics import read_metrics
from tests.conftest import REPO
from tests.support.runs import (  # noqa: F401 (own_signal_handlers: fixture)
    killed_then_resumed, own_signal_handlers, sigterm_in_first_decode_call, stable, train)


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
  # The per-token correction (token-truncate, C = algo.is_threshold = 2), from the logged
  # |d_t| = |log π_old − log μ_t| over the trained tokens: mean m, max M, and the weights'
  # mean w = mean min(e^{d_t}, C). Three relations that hold for any numbers a correct run logs:
  for r in rows:
    mean, worst, weight = (r["train/tis/abs_log_diff"], r["train/tis/abs_log_diff/max"],
                           r["train/tis/weight"])
    # each weight lies in [e^{-|d_t|}, min(e^{|d_t|}, C)]; Jensen on the lower end
    assert math.exp(-mean) - 1e-6 <= weight <= min(math.exp(worst), 2.0) + 1e-6, r
    # a token drawn by the weights that train on it (lag 0) differs only by float32 rounding of
    # two forwards (< 1e-5, as test_trainer bounds it), so the mismatch sits in the stale tokens:
    # m <= stale_frac · M + 1e-5 (which μ_t belongs to which token: the test after this one)
    stale = r["rollout/partial/stale_token_frac"]
    assert mean <= stale * worst + 1e-5, r
  # step 1 trains what the current weights drew: rounding only, and weights of 1 to that bound
  assert rows[0]["train/tis/abs_log_diff/max"] < 1e-5
  assert abs(rows[0]["train/tis/weight"] - 1) <= 2 * rows[0]["train/tis/abs_log_diff/max"] + 1e-6
  # and the stale tokens are corrected: their policy really moved (far above rounding)
  assert any(r["rollout/partial/token_lag_max"] > 0 and r["train/tis/abs_log_diff"] > 1e-4
             for r in rows)


def test_each_tokens_sampler_log_prob_is_that_of_the_policy_version_that_drew_it(
    tmp_path, monkeypatch):
  """The correction weighs token t by π_old / μ_t, so μ_t must be the log-prob under the weights
  that drew it (v_t), also for a sample resumed over rounds. In process, 4 steps: every version's
  weights as the sampler received them, and every trained sample as the round handed it over;
  each token's recorded log-prob is recomputed by the trainer's forward (rl/logprobs) under
  version v_t. Decode and forward round differently: 1e-4 on log-probs of ~1 is far above that
  and far below what a log-prob of another token or version is off by (> 1e-2 here)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from reasoning_rl.build import build
  from reasoning_rl.loop import partial_rollouts
  from reasoning_rl.rl.logprobs import completion_logprobs
  from reasoning_rl.trainer import Trainer

  sys.path.insert(0, str(REPO))
  from configs import debug_cpu

  config = debug_cpu.get_config()
  config.workdir = str(tmp_path)
  config.logging.progress_bar = False
  config.partial_rollouts.enabled = True
  config.total_steps, config.checkpoint.every_steps, config.eval.every_steps = 4, 100, 0
  config.rollout.steps_per_call = 4
  run = build(config)
  weights = {0: jax.tree.map(np.array, run.weight_sync.payload(run.state))}
  push = run.weight_sync.push

  def keep_weights(state, version):
    weights[version] = jax.tree.map(np.array, run.weight_sync.payload(state))
    return push(state, version)

  run.weight_sync.push = keep_weights
  trained, of_group = [], partial_rollouts.RolloutColumns.of_group
  monkeypatch.setattr(partial_rollouts.RolloutColumns, "of_group",
                      lambda position, completions, *rest, **named: trained.extend(completions)
                      or of_group(position, completions, *rest, **named))
  graphdef = run.step_fn.graphdef
  assert Trainer(run).run() == 0
  assert sorted(weights) == [0, 1, 2, 3, 4]
  mixed = [c for c in trained if c.token_versions]
  assert len(mixed) >= 8  # samples drawn over several versions are there to check
  prompt_length = max(len(c.prompt_tokens) for c in trained)
  length = max(len(c.completion_ids) for c in trained)
  tokens = np.zeros((len(trained), prompt_length + length), np.int32)
  mask = np.zeros_like(tokens)
  for row, c in enumerate(trained):  # the batch layout: prompts left-padded, completions right
    start, n = prompt_length - len(c.prompt_tokens), len(c.completion_ids)
    tokens[row, start:prompt_length + n] = list(c.prompt_tokens) + list(c.completion_ids)
    mask[row, start:prompt_length + n] = 1
  forward = jax.jit(lambda params: completion_logprobs(
      nnx.merge(graphdef, params), jnp.asarray(tokens), jnp.asarray(mask), length)[0])
  recomputed = {version: np.asarray(forward(params)) for version, params in weights.items()}
  checked = 0
  for row, c in enumerate(trained):
    versions = c.token_versions or [c.policy_version] * len(c.completion_ids)
    for t, (version, logprob) in enumerate(zip(versions, c.logprobs, strict=True)):
      assert abs(recomputed[version][row, t] - logprob) < 1e-4, (row, t, version)
      checked += 1
  assert checked == sum(len(c.completion_ids) for c in trained) > 0


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
