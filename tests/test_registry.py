"""The catalogue of named choices: every config field that names one is checked against it before
anything is loaded, and a choice registered from outside the package is used like a built-in."""

import subprocess
import sys

import numpy as np
import pytest

from reasoning_rl import config as config_lib
from reasoning_rl import registry
from reasoning_rl.errors import ConfigError
from reasoning_rl.rl.advantages import group_advantages
from reasoning_rl.rl.losses import PolicyTerm, policy_loss
from tests.conftest import REPO
from tests.support.configs import debug_config


@pytest.mark.parametrize("field, value, kind, names", [
    ("algo.estimator", "grpo2", "advantage estimator", ["grpo", "dr_grpo", "rloo",
                                                        "reinforce_pp"]),
    ("algo.loss_type", "gspo_token", "policy loss", ["ppo", "gspo", "gspo-token", "cispo",
                                                     "dppo-tv", "dppo-kl"]),
    ("algo.loss_agg", "token_mean", "loss aggregation",
     ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]),
    ("algo.kl_estimator", "k4", "KL estimator", ["k1", "k2", "k3"]),
    ("algo.is_correction", "tis", "sampler importance correction",
     ["none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask", "icepop"]),
    ("data.train.kind", "parquet", "task source",
     ["synthetic_arithmetic", "reasoning_gym", "jsonl", "mixture", "agent", "guess_number"]),
])
def test_a_misspelt_choice_names_the_field_and_the_valid_names(field, value, kind, names):
  config = debug_config()
  if field == "data.train.kind":
    config.data.train = dict(config.data.train.to_dict(), kind=value)
  else:
    config.algo[field.split(".")[1]] = value
  with pytest.raises(ConfigError) as error:
    config_lib.validate(config)
  assert str(error.value) == f"config.{field}={value!r}: unknown {kind}; use one of {names}"


def test_a_misspelt_reward_kind_is_refused_by_validate():
  config = debug_config()
  config.rewards = {"correct": {"weight": 1.0}, "style": {"weight": 0.1, "kind": "formatting"}}
  with pytest.raises(ConfigError, match=r"^config\.rewards\.style\.kind='formatting': unknown "
                     r"reward part; use one of \['correct', 'format', 'language', 'length', "
                     r"'environment', 'judge', 'reward_model'\]"):
    config_lib.validate(config)


def test_the_launcher_refuses_a_misspelt_name_before_the_workdir_or_the_model(tmp_path):
  result = subprocess.run(
      [sys.executable, str(REPO / "launch" / "train.py"), "--config=configs/debug_cpu.py",
       f"--config.workdir={tmp_path / 'run'}", "--config.algo.kl_estimator=k4"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "error: ConfigError: config.algo.kl_estimator='k4': unknown KL estimator; use one of "
      "['k1', 'k2', 'k3']"]
  assert not (tmp_path / "run").exists()


@pytest.fixture
def custom_choices():
  """A policy loss and an advantage estimator registered from outside the package."""

  @registry.LOSS_TYPES.register("reinforce-test", summary="plain REINFORCE, −A·logp (a test)")
  def reinforce(logp, logp_old, adv, valid, *, epsilon_low, epsilon_high, dual_clip, xp):
    del logp_old, valid, epsilon_low, epsilon_high, dual_clip
    zeros = xp.zeros(logp.shape, dtype=bool)
    return PolicyTerm(-adv * logp, {"clip_frac/low": zeros, "clip_frac/high": zeros})

  @registry.ADVANTAGE_ESTIMATORS.register("max-baseline-test", summary="r − group max (a test)")
  def max_baseline(rewards, eps, xp):
    del eps
    return rewards - xp.max(rewards, axis=1, keepdims=True)

  yield
  registry.LOSS_TYPES.remove("reinforce-test")
  registry.ADVANTAGE_ESTIMATORS.remove("max-baseline-test")


def test_a_registered_choice_is_used_and_accepted_by_validate(custom_choices):
  logp = np.array([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
  mask = np.array([[1, 1, 1], [1, 1, 0]])
  advantages = np.array([0.5, -2.0])
  loss, stats = policy_loss(logp, logp - 0.1, advantages, mask, loss_type="reinforce-test",
                            loss_agg="token-mean")
  expected = -(0.5 * (-1.0 - 2.0 - 0.5) - 2.0 * (-0.3 - 0.7)) / 5
  assert float(loss) == pytest.approx(expected, abs=1e-12)
  assert float(stats["clip_frac"][0]) == 0.0
  rewards = np.array([[1.0, 0.0, 0.5], [2.0, 2.0, 2.0]])
  np.testing.assert_array_equal(group_advantages(rewards, estimator="max-baseline-test"),
                                [[0.0, -1.0, -0.5], [0.0, 0.0, 0.0]])
  config = debug_config(**{"algo.loss_type": "reinforce-test",
                           "algo.estimator": "max-baseline-test"})
  config_lib.validate(config)
  assert "reinforce-test" in registry.catalogue()


def test_a_name_registers_once():
  with pytest.raises(ValueError, match="policy loss 'ppo' is registered twice"):
    registry.LOSS_TYPES.add("ppo", None, summary="again")


# The built-in choices, written out here rather than read back from the registry under test.
BUILT_IN = {
    "algo.estimator": ["dr_grpo", "grpo", "reinforce_pp", "rloo"],
    "algo.kl_estimator": ["k1", "k2", "k3"],
    "algo.loss_type": ["cispo", "dppo-kl", "dppo-tv", "gspo", "gspo-token", "ppo"],
    "algo.loss_agg": ["seq-mean-token-mean", "seq-mean-token-sum-norm", "token-mean"],
    "algo.is_correction": ["icepop", "none", "sequence-mask", "sequence-truncate", "token-mask",
                           "token-truncate"],
    "algo.rejection": ["none", "seq-geo-mean", "seq-mean-k3"],
    "rewards.<name>.kind": ["correct", "environment", "format", "judge", "language", "length",
                            "reward_model"],
    "rewards.<name>.verifier": ["auto", "code", "countdown", "math", "reasoning_gym"],
    "data.<split>.kind": ["agent", "guess_number", "jsonl", "mixture", "reasoning_gym",
                          "synthetic_arithmetic"],
    "rollout.backend": ["engine"],
    "environment.name": ["calculator", "guess_number", "python_tool"],
}


def test_the_catalogue_lists_every_built_in_choice_with_a_summary():
  text = registry.catalogue()
  sections = text.split("\n\n")
  assert len(sections) == len(BUILT_IN)
  for section, (field, names) in zip(sections, BUILT_IN.items()):
    heading, *lines = section.strip().splitlines()
    assert heading.endswith(f"(config.{field}):"), heading
    listed = [line.split()[0] for line in lines]
    assert sorted(listed) == names, field
    for line in lines:  # every choice has a summary after its name
      assert len(line.split(maxsplit=1)) == 2, line