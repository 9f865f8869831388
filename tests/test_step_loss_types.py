"""The training step with GSPO / CISPO loss types and the sampler importance correction."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from reasoning_rl.errors import ConfigError
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.rl.step_config import StepConfig
from tests.support.steps import T, flat_params, fresh_params, make_batch, rolled_updates, run_step


def with_sampler_logprobs(batch, shift):
  """The batch plus behavior_logprobs = the initial policy's own log-probs - shift."""
  graphdef, params = fresh_params()
  own, _ = completion_logprobs(nnx.merge(graphdef, params), batch["tokens"],
                               batch["attention_mask"], T)
  return dict(batch, behavior_logprobs=own - shift)


@pytest.mark.parametrize("loss_type, clip", [
    ("ppo", dict(epsilon_low=0.2, epsilon_high=0.28)),
    ("gspo", dict(epsilon_low=3e-4, epsilon_high=4e-4)),  # the GSPO paper's ranges
    ("cispo", dict(epsilon_low=1.0, epsilon_high=0.28)),  # MiniMax-M1: no floor
])
def test_second_inner_update_clips(loss_type, clip):
  config = StepConfig(loss_type=loss_type, learning_rate=5e-2, num_iterations=2, **clip)
  batch = make_batch()
  state, stats = run_step(config, batch, optimizer=optax.sgd(lambda count: 1.0))
  # The first update runs at π = π_old (ratio 1, nothing clipped); the second sees the moved
  # policy and clips: every clip and ratio statistic is that of the two SGD updates rolled here.
  expected = rolled_updates(batch, 2, 1.0, loss_type=loss_type, loss_agg=config.loss_agg, **clip)
  assert expected["clip_frac"] > 0.05, expected
  clip_keys = ("clip_frac", "clip_frac/low", "clip_frac/high")
  assert {k: stats[k] for k in clip_keys} == {k: expected[k] for k in clip_keys}
  ratio_keys = ("ratio/min", "ratio/mean", "ratio/max", "loss") + (
      ("seq_ratio/min", "seq_ratio/mean", "seq_ratio/max") if loss_type == "gspo" else ())
  for key in ratio_keys:
    assert stats[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
  assert int(state.skipped_updates) == 0


def test_sampler_weights_compare_with_the_trainers_own_recomputation():
  batch = with_sampler_logprobs(make_batch(), shift=0.1)
  config = StepConfig(learning_rate=1e-3, is_correction="token-truncate", is_threshold=2.0)
  _, stats = run_step(config, batch)
  # π_old is the trainer's forward, not the sampler's log-probs: every weight is e^0.1.
  assert stats["ratio/min"] == pytest.approx(1.0, abs=1e-6)
  assert stats["ratio/max"] == pytest.approx(1.0, abs=1e-6)
  assert stats["tis/abs_log_diff"] == pytest.approx(0.1, abs=1e-5)
  assert stats["tis/weight"] == pytest.approx(np.exp(0.1), rel=1e-5)
  assert stats["tis/capped_token_frac"] == 0.0


def test_sequence_mask_drops_a_far_off_sampler_and_needs_its_logprobs():
  # π_old / π_behavior = e^5 on every token: every sequence weight is far above C = 2.
  batch = with_sampler_logprobs(make_batch(), shift=5.0)
  config = StepConfig(learning_rate=1e-2, num_iterations=2, is_correction="sequence-mask",
                      is_threshold=2.0)
  before = [np.asarray(x) for x in jax.tree.leaves(fresh_params()[1])]
  state, stats = run_step(config, batch)
  assert stats["tis/capped_seq_frac"] == 1.0 and stats["tis/weight"] == 0.0
  for a, b in zip(before, flat_params(state)):  # no policy-gradient signal: nothing moves
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ConfigError, match="batch has no behavior_logprobs"):
    run_step(config, make_batch())


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="grpo"), r"config.algo.loss_type='grpo': unknown policy loss; use one of "
     r"\['ppo'"),
    (dict(is_correction="seq-mask"), r"config.algo.is_correction='seq-mask': unknown"),
    (dict(is_threshold=0.0), r"config.algo.is_threshold=0.0 must be > 0"),
    (dict(algorithm="ppo", loss_type="gspo"), r"use 'gspo-token'"),
    (dict(loss_type="cispo", dual_clip=3.0), r"config.algo.dual_clip=3.0 does not apply"),
])
def test_step_config_names_the_bad_field(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    StepConfig(**kwargs)


def test_sampler_correction_is_off_by_default_and_needs_sampler_logprobs_when_on():
  config = StepConfig()
  assert (config.loss_type, config.is_correction) == ("ppo", "none")
  assert config.sampler_correction(True) == ("none", 2.0)
  assert config.sampler_correction(False) == ("none", 2.0)
  with pytest.raises(ConfigError, match="batch has no behavior_logprobs"):
    StepConfig(is_correction="token-truncate").sampler_correction(False)
  assert StepConfig(is_correction="sequence-mask", is_threshold=1.5).sampler_correction(True) == (
      "sequence-mask", 1.5)
