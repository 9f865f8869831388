"""Bad configs fail fast with one ConfigError naming the field; good ones pass validation."""

import subprocess
import sys

import pytest

from reasoning_rl import config as config_lib
from reasoning_rl.errors import ConfigError
from tests.conftest import REPO


def debug_config(**overrides):
  sys.path.insert(0, str(REPO))
  from configs import debug_cpu

  config = debug_cpu.get_config()
  config.workdir = "/tmp/unused"
  for dotted, value in overrides.items():
    node = config
    *parents, last = dotted.split(".")
    for part in parents:
      node = node[part]
    node[last] = value
  return config


def test_debug_config_is_valid():
  config_lib.validate(debug_config(), num_devices=8)


@pytest.mark.parametrize("overrides, field", [
    ({"workdir": ""}, "config.workdir"),
    ({"rollout.num_samples": 1}, "config.rollout.num_samples"),
    ({"algo.num_micro_batches": 3}, "config.algo.num_micro_batches"),
    ({"algo.estimator": "ppo2"}, "config.algo.estimator"),
    ({"algo.loss_type": "gspo_token"}, "config.algo.loss_type"),
    ({"algo.loss_agg": "token_mean"}, "config.algo.loss_agg"),
    ({"algo.kl_estimator": "k4"}, "config.algo.kl_estimator"),
    ({"algo.is_correction": "seq-mask"}, "config.algo.is_correction"),
    ({"algo.num_mini_batches": 3}, "config.algo.num_mini_batches"),
    ({"rollout.top_p": 1.5}, "config.rollout.top_p"),
    ({"rollout.temperature": -0.1}, "config.rollout.temperature"),
    ({"beta": -1.0}, "config.beta"),
    ({"model.dtype": "float8"}, "config.model.dtype"),
    ({"mesh.trainer": (3, 1, 1)}, "config.mesh.trainer"),
    ({"mesh.num_trainer_devices": 8}, "config.mesh.num_trainer_devices"),
    ({"mesh.num_trainer_devices": 4, "mesh.sampler": (1, 1, 3)}, "config.mesh.sampler"),
])
def test_bad_field_is_named(overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.") + r"\b"):
    config_lib.validate(debug_config(**overrides), num_devices=8)


def test_override_checks():
  config = debug_config()
  with pytest.raises(ConfigError, match=r"config\.nonexistent: unknown field"):
    config_lib.check_overrides(config, {"nonexistent": "1"})
  with pytest.raises(ConfigError, match=r"config\.rollout\.bogus: unknown field"):
    config_lib.check_overrides(config, {"rollout.bogus": "1"})
  with pytest.raises(ConfigError, match=r"config\.total_steps='ten': expected int"):
    config_lib.check_overrides(config, {"total_steps": "ten"})
  with pytest.raises(ConfigError, match=r"config\.dynamic_sampling\.enabled='maybe'"):
    config_lib.check_overrides(config, {"dynamic_sampling.enabled": "maybe"})
  config_lib.check_overrides(config, {"total_steps": "3", "beta": "0.1",
                                      "dynamic_sampling.enabled": "True"})


def test_train_cli_exits_2_with_one_line():
  result = subprocess.run(
      [sys.executable, str(REPO / "launch" / "train.py"), "--config=configs/debug_cpu.py",
       "--config.workdir=/tmp/unused", "--config.rollout.bogus=1"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith(
      "error: ConfigError: config.rollout.bogus: unknown field")
