"""Bad configs fail fast with one ConfigError naming the field; good ones pass validation."""

import os
import subprocess
import sys

import pytest

from reasoning_rl import config as config_lib
from reasoning_rl.errors import ConfigError
from tests.conftest import REPO
from tests.multihost_runs import xla_flags
from tests.support.configs import debug_config


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
    ({"model.attention_kernel": "flash"}, "config.model.attention_kernel"),
    ({"mesh.trainer": (3, 1, 1)}, "config.mesh.trainer"),
    ({"mesh.num_trainer_devices": 8}, "config.mesh.num_trainer_devices"),
    ({"mesh.num_trainer_devices": 4, "mesh.sampler": (1, 1, 3)}, "config.mesh.sampler"),
])
def test_bad_field_is_named(overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.") + r"\b"):
    config_lib.validate(debug_config(**overrides), num_devices=8)


_AGENT = {"agent.entry": "tests.support.agents:two_turns"}


@pytest.mark.parametrize("overrides, field", [
    ({"agent.entry": "tests.support.agents.two_turns"}, "config.agent.entry"),
    ({**_AGENT, "agent.min_episodes_per_group": 99}, "config.agent.min_episodes_per_group"),
    ({**_AGENT, "environment.name": "calculator"}, "config.environment.name"),
    ({**_AGENT, "partial_rollouts.enabled": True}, "config.partial_rollouts.enabled"),
    ({**_AGENT, "dynamic_sampling.enabled": True}, "config.dynamic_sampling.enabled"),
    ({**_AGENT, "rollout.kv_page_size": 16}, "config.rollout.kv_page_size"),
    ({**_AGENT, "teacher.path": "runs/demo"}, "config.teacher.path"),
])
def test_agent_rollouts_refuse_what_they_do_not_run_with(overrides, field):
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


def _numeric_leaves(node, prefix=""):
  for key, value in node.items():
    dotted = prefix + key
    if hasattr(value, "items"):
      yield from _numeric_leaves(value, dotted + ".")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      yield dotted


def test_every_numeric_field_has_a_range_its_default_satisfies():
  """A numeric field added to base_config without a range in FIELD_RANGES fails here."""
  base = config_lib.base_config()
  numeric = {f for f in _numeric_leaves(base) if not f.startswith(("data.", "rewards."))}
  numeric.add("algo.dual_clip")  # None by default (off), a number when on
  assert numeric == set(config_lib.FIELD_RANGES)
  for dotted in numeric:
    config_lib.check_range(dotted, config_lib._field(base, dotted))


def _outside(bounds: config_lib.Range) -> list:
  """Values of the field's kind just outside `bounds` (and NaN / inf for reals)."""
  step = 1 if bounds.kind is int else 1e-3
  values = [] if bounds.kind is int else [float("nan")] + ([] if bounds.infinite_ok
                                                           else [float("inf")])
  if bounds.low is not None:
    values.append(bounds.low if bounds.low_open else bounds.low - step)
  if bounds.high is not None:
    values.append(bounds.high if bounds.high_open else bounds.high + step)
  return [bounds.kind(v) if bounds.kind is int else float(v) for v in values]


@pytest.mark.parametrize("dotted", sorted(config_lib.FIELD_RANGES))
def test_every_numeric_field_refuses_values_outside_its_range(dotted):
  bounds = config_lib.FIELD_RANGES[dotted]
  for value in _outside(bounds):
    with pytest.raises(ConfigError) as error:
      config_lib.validate(debug_config(**{dotted: value}))
    assert str(error.value) == f"config.{dotted}={value!r}: must be {bounds.describe()}"
  # values a config file could hold that are no number of the field's kind
  for value in ["ten", True] + ([1.5] if bounds.kind is int else []) + \
      ([] if bounds.none_ok else [None]):
    with pytest.raises(ConfigError, match=f"^config\\.{dotted}="):
      config_lib.check_range(dotted, value)


@pytest.mark.parametrize("dotted, value, message", [
    ("optim.learning_rate", -0.1, "config.optim.learning_rate=-0.1: must be a number >= 0"),
    ("algo.num_micro_batches", -1, "config.algo.num_micro_batches=-1: must be an integer >= 0 "
     "(0 = chosen for the machine)"),
    ("eval.num_examples", 0, "config.eval.num_examples=0: must be an integer >= 1"),
    ("rollout.top_p", 0.0, "config.rollout.top_p=0.0: must be a number in (0, 1]"),
    ("guards.max_kl", 0.0, "config.guards.max_kl=0.0: must be a number > 0 (inf allowed; "
     "inf = off)"),
    ("algo.dual_clip", 1.0, "config.algo.dual_clip=1.0: must be a number > 1 (or None; "
     "None = off)"),
])
def test_range_errors_read_well(dotted, value, message):
  with pytest.raises(ConfigError) as error:
    config_lib.validate(debug_config(**{dotted: value}))
  assert str(error.value) == message


def test_guard_settings_use_the_same_ranges():
  from reasoning_rl.guards import GuardConfig

  with pytest.raises(ConfigError, match=r"^config\.guards\.max_verifier_error_rate=1\.5: must be "
                     r"a number in \[0, 1\] \(1 = off\)$"):
    GuardConfig(max_verifier_error_rate=1.5)


@pytest.mark.parametrize("argv, expected", [
    (["--config=c.py", "--config.total_steps=3"], ("c.py", {"total_steps": "3"})),
    (["--config", "c.py", "--config.total_steps", "3"], ("c.py", {"total_steps": "3"})),
    (["--config", "c.py", "--config.dry_run", "--config.rollout.top_p", "0.5"],
     ("c.py", {"dry_run": "true", "rollout.top_p": "0.5"})),
    (["--verbose", "--config.workdir", "/tmp/run", "--config=c.py", "--", "--config.x=1"],
     ("c.py", {"workdir": "/tmp/run"})),
    (["--checkpoint", "/ckpt"], (None, {})),
])
def test_config_args_read_both_flag_forms(argv, expected):
  assert config_lib.config_args(["launcher.py"] + argv) == expected


@pytest.mark.parametrize("launcher", ["train", "evaluate", "replay", "redteam"])
def test_space_form_overrides_are_checked_in_one_line(launcher):
  result = subprocess.run(
      [sys.executable, str(REPO / "launch" / f"{launcher}.py"), "--config", "configs/debug_cpu.py",
       "--config.rollout.bogus", "1"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "error: ConfigError: config.rollout.bogus: unknown field; config.rollout has "
      f"{sorted(config_lib.base_config().rollout.keys())}"]


@pytest.mark.parametrize("overrides, num_devices, message", [
    ({"rollout.num_prompts": 3, "rollout.num_samples": 3}, 8,
     "config.rollout.num_prompts=3: the batch of num_prompts x num_samples = 9 completions is "
     "split over the trainer mesh's data x fsdp = 1 x 8 devices, which must divide it; change "
     "the batch or config.mesh.trainer"),
    # tensor-parallel devices do not split the batch: 12 rows over data x fsdp = 2 x 2 is fine
    ({"rollout.num_prompts": 3, "mesh.trainer": (2, 2, 2)}, 8, None),
    ({"rollout.num_prompts": 3, "mesh.num_trainer_devices": 8}, 16,
     "config.rollout.num_prompts=3: the batch of num_prompts x num_samples = 12 completions is "
     "split over the trainer mesh's data x fsdp = 1 x 8 devices"),
    ({"stage": "sft", "sft.data_path": "x.jsonl", "sft.batch_size": 6}, 4,
     "config.sft.batch_size=6: the batch of 6 examples is split over the trainer mesh's "
     "data x fsdp = 1 x 4 devices"),
])
def test_the_batch_must_divide_over_the_trainer_devices(overrides, num_devices, message):
  """Checked with the config, before any model load (JAX would raise IndivisibleError when the
  first batch is placed, after the step-0 evaluation)."""
  config = debug_config(**overrides)
  if message is None:
    config_lib.validate(config, num_devices=num_devices)
    return
  with pytest.raises(ConfigError) as error:
    config_lib.validate(config, num_devices=num_devices)
  assert str(error.value).startswith(message)


def test_train_cli_refuses_an_indivisible_batch_before_touching_the_workdir(tmp_path):
  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, str(REPO / "launch" / "train.py"), "--config=configs/debug_cpu.py",
       f"--config.workdir={workdir}", "--config.rollout.num_samples=3"],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env={**os.environ, "XLA_FLAGS": xla_flags(8),
           "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines() == [
      "error: ConfigError: config.rollout.num_prompts=4: the batch of num_prompts x num_samples "
      "= 12 completions is split over the trainer mesh's data x fsdp = 1 x 8 devices, which must "
      "divide it; change the batch or config.mesh.trainer"]
  assert not workdir.exists()
