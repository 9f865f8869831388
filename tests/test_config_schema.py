"""The typed config: one declaration per field, and everything derived from it stays in step."""

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from reasoning_rl import config_schema
from reasoning_rl.config import FIELD_CHOICES, FIELD_RANGES, base_config, validate
from reasoning_rl.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _leaves(node, prefix=""):
  out = {}
  for key, value in node.items():
    dotted = f"{prefix}{key}"
    if dotted in config_schema.FIELDS or not hasattr(value, "items") or dotted == "rewards":
      out[dotted] = value
    else:
      out.update(_leaves(value, dotted + "."))
  return out


def valid_base_config(tmp_path):
  """base_config() with the two fields a run must set itself: validates as it is."""
  config = base_config()
  config.workdir = str(tmp_path)
  config.model.tokenizer = "debug_arithmetic"
  return config


def test_base_config_holds_exactly_the_declared_fields_with_their_defaults():
  leaves = _leaves(base_config())
  assert set(leaves) - {"rewards"} == set(config_schema.FIELDS)
  # defaults the docs promise, written out here rather than read back from the schema
  documented = {"seed": 0, "total_steps": 10, "stage": "rl", "algo.loss_type": "ppo",
                "rollout.top_p": 1.0, "algo.remat": "none", "algo.packing": None,
                "async_rollouts.enabled": None, "partial_rollouts.enabled": False}
  assert {dotted: leaves[dotted] for dotted in documented} == documented
  assert base_config().rewards.to_dict() == {
      "correct": {"weight": 1.0, "verifier": "math", "extract": "answer"}}
  # every field is typed, its None defaults included: a value of another type is refused where
  # it is set (a plain None would take anything and fail later, far from the override)
  for dotted, item in config_schema.FIELDS.items():
    *parents, last = dotted.split(".")
    node = base_config()
    for part in parents:
      node = node[part]
    wrong = object() if isinstance(item.default, str) else "not-a-" + last
    if item.default is None and not item.typed_none:
      continue  # free-form: anything or None (e.g. model.path)
    with pytest.raises(TypeError):
      node[last] = wrong
  packing = base_config()
  packing.algo.packing = True  # the placeholder takes its own type
  assert packing.algo.packing is True


def test_every_numeric_field_is_range_checked_by_validate(tmp_path):
  """NaN is outside every Range: validate must refuse it naming the field, for each numeric
  field of the schema (a field validate forgot would accept it)."""
  for dotted, item in config_schema.FIELDS.items():
    assert len(item.doc) >= 10, f"config.{dotted}: say what it means"
  numeric = [d for d, f in config_schema.FIELDS.items()
             if isinstance(f.default, (int, float)) and not isinstance(f.default, bool)]
  assert len(numeric) > 50
  for dotted in numeric:
    config = valid_base_config(tmp_path)
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
      node = node[part]
    with node.ignore_type():
      node[last] = float("nan")
    with pytest.raises(ConfigError, match=f"^config\\.{dotted.replace('.', r'[.]')}=nan: "):
      validate(config)
  assert set(FIELD_CHOICES) >= {"stage", "model.dtype", "algo.loss_type", "lora.sampler_weights"}


@pytest.mark.parametrize("dotted", sorted(FIELD_CHOICES))
def test_each_choice_field_refuses_an_unknown_name_in_one_line(dotted, tmp_path):
  config = valid_base_config(tmp_path)
  node = config
  *parents, last = dotted.split(".")
  for part in parents:
    node = node[part]
  node[last] = "no-such-choice"
  with pytest.raises(ConfigError, match=f"^config\\.{dotted.replace('.', r'[.]')}="
                                        "'no-such-choice': ") as error:
    validate(config)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize(("view", "section"), [
    ("reasoning_rl.rl.step_config:StepConfig", None),
    ("reasoning_rl.sampler.sampling:SamplingParams", "rollout"),
    ("reasoning_rl.lora:LoraSettings", "lora")])
def test_typed_views_share_the_schema_names_and_defaults(view, section):
  module, name = view.split(":")
  cls = getattr(__import__(module, fromlist=[name]), name)
  instance = cls()
  sourced = [f for f in dataclasses.fields(cls) if "source" in f.metadata]
  assert sourced
  for item in sourced:
    source = item.metadata["source"]
    assert source.rsplit(".", 1)[-1] == item.name, f"{cls.__name__}.{item.name} <- {source}"
    if "open_default" in item.metadata:  # the config leaves it to the machine (step_layout)
      assert config_schema.default(source) == item.metadata["open_default"]
      # the view's own default is concrete: padded rows, one micro-batch
      assert (getattr(instance, item.name), item.metadata["open_default"]) in ((False, None),
                                                                               (1, 0))
    else:
      assert getattr(instance, item.name) == config_schema.default(source)
    if section:
      assert source.startswith(section + ".")
  if section:  # the view covers its section's fields that the view's object uses
    names = {f.name for f in sourced}
    assert names == {f.name for f in dataclasses.fields(cls)}


def test_values_of_reads_each_sourced_field_from_the_config():
  from reasoning_rl.sampler.sampling import SamplingParams

  config = base_config()
  config.rollout.temperature, config.rollout.top_p = 0.7, 0.9
  config.rollout.top_k, config.rollout.min_p = 20, 0.05
  assert SamplingParams(**config_schema.values_of(SamplingParams, config)) == SamplingParams(
      temperature=0.7, top_p=0.9, top_k=20, min_p=0.05)
  with pytest.raises(TypeError, match="no fields"):
    config_schema.values_of(SamplingParams, config, not_a_field=1)


def test_docs_config_md_is_generated_from_the_schema():
  written = (ROOT / "docs" / "config.md").read_text()
  assert written == config_schema.markdown_table(), (
      "docs/config.md is stale: python -m reasoning_rl.config_schema > docs/config.md")


def test_launcher_help_lists_every_field_with_default_and_range():
  out = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--help"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
  for dotted, item in config_schema.FIELDS.items():
    assert f"--config.{dotted}={item.default!r}" in out, dotted
  assert "--config.rollout.top_p=1.0  (float; a number in (0, 1])" in out
  assert "--config.algo.loss_type='ppo'  (str; a name of registry.LOSS_TYPES)" in out
  assert "--config: Path to a config file." in out  # absl's own flags follow


def test_an_older_config_file_setting_a_retyped_field_fails_in_one_line(tmp_path):
  from reasoning_rl.config import precheck_command_line

  old = tmp_path / "old.py"
  old.write_text("from reasoning_rl.config import base_config\n\n\ndef get_config():\n"
                 "  c = base_config()\n  c.algo.remat = True\n  return c\n")
  with pytest.raises(ConfigError, match=r"config\.algo\.remat takes a name now: 'full' \(was "
                                        r"True\)") as error:
    precheck_command_line(["train.py", f"--config={old}"])
  assert "\n" not in str(error.value)
