"""The typed config: one declaration per field, and everything derived from it stays in step."""

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from reasoning_rl import config_fields, config_groups, config_help, config_schema
from reasoning_rl.config import FIELD_CHOICES, base_config, validate
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
    ("reasoning_rl.lora:LoraSettings", "lora"),
    ("reasoning_rl.rl.distillation:DistillationSettings", "teacher")])
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
  assert written == config_help.markdown_table(), (
      "docs/config.md is stale: python -m reasoning_rl.config_help > docs/config.md")


def test_launcher_help_lists_every_field_with_default_and_range():
  out = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--help"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
  for dotted, item in config_schema.FIELDS.items():
    assert f"--config.{dotted}={item.default!r}" in out, dotted
  # every reward-part kind's and environment's settings, under a heading naming the choice
  for group in config_groups.GROUPS:
    heading = out.index(f"[{group.title}]")
    following = out[heading:]
    for item in group.fields:
      assert f"--config.{group.path}.{item.name}={item.default!r}  (" in following, (
          group.title, item.name)
  assert ("--config.rewards.<name>.weight=(required)  (float; a number)" in out)
  assert ("--config.environment.settings.timeout_s=5.0  (float; a number in (0, 60])" in out)
  assert ("--config.rewards.<name>.fallback_statuses=('no_answer', 'unparseable', "
          "'unevaluated', 'timeout')  (tuple; a non-empty list of wrong | no_answer" in out)
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


# ------------------------------------------------------ reward parts, task sources and environments

# The defaults the reward parts and environments had before the schema held them, written out here
# (not read back from the schema): a changed default fails.
DOCUMENTED_GROUP_DEFAULTS = {
    "correct": {"verifier": "math", "extract": "answer_or_boxed", "timeout_s": 5.0,
                "answer_tag": "answer", "think_tag": "think", "use_each": "exactly_once",
                "allow_unary_minus": False, "success_threshold": 1.0, "partial_credit": False,
                "code_isolation": "namespaces"},
    "format": {"think_tag": "think", "answer_tag": "answer", "require_nonempty_think": True,
               "require_nonempty_answer": True, "think_open_in_prompt": False, "pattern": None},
    "language": {"script": "latin", "think_tag": "think", "think_open_in_prompt": False},
    "length": {"method": "dapo", "cache_len": None, "max_len": None, "alpha": 3e-4, "delta": 0.5,
               "target_tokens": None},
    "environment": {"part": "correct"},
    "judge": {"model": "", "dtype": "float32", "mode": "fallback",
              "fallback_statuses": ("no_answer", "unparseable", "unevaluated", "timeout"),
              "template": "yes_no", "max_new_tokens": 8, "max_prompt_tokens": 512,
              "batch_size": 16, "cache_size": 4096, "extract": "answer_or_boxed",
              "answer_tag": "answer", "think_tag": "think", "timeout_s": 5.0},
    "reward_model": {"model": "", "dtype": "float32", "label": 0, "transform": "none",
                     "max_tokens": 2048, "batch_size": 16},
}
DOCUMENTED_ENVIRONMENT_DEFAULTS = {
    "calculator": {"max_calls": 8},
    "guess_number": {"max_guesses": 10},
    "python_tool": {"max_calls": 4, "timeout_s": 5.0, "observation_max_chars": 1024,
                    "memory_mb": 1024, "keep_state": False, "isolation": "namespaces",
                    "verifier": "math", "extract": "final_answer", "answer_tag": "answer",
                    "verify_timeout_s": 5.0},
}
DOCUMENTED_SOURCE_DEFAULTS = {
    "synthetic_arithmetic": {"seed": 0, "max_operand": 9, "ops": "+"},
    "reasoning_gym": {"name": config_fields.REQUIRED, "seed": 0, "size": 1000, "params": {}},
    "jsonl": {"path": config_fields.REQUIRED, "shuffle": False, "seed": 0},
    "mixture": {"sources": config_fields.REQUIRED, "weights": None},
    "guess_number": {"seed": 0, "low": 1, "high": 100},
    "agent": {"shuffle": False, "seed": 0},
}
# The settings a part of each kind needs besides its weight to be built at all.
NEEDED = {"judge": {"model": "/judge"}, "reward_model": {"model": "/rm"},
          "length": {"cache_len": 16}}


def test_each_reward_part_and_environment_takes_its_settings_from_the_schema():
  from reasoning_rl import registry

  assert {k: g.defaults() for k, g in config_groups.REWARD_PARTS.items()} == (
      DOCUMENTED_GROUP_DEFAULTS)
  assert {k: g.defaults() for k, g in config_groups.ENVIRONMENTS.items()} == (
      DOCUMENTED_ENVIRONMENT_DEFAULTS)
  assert {k: g.defaults() for k, g in config_groups.TASK_SOURCES.items()} == (
      DOCUMENTED_SOURCE_DEFAULTS)
  # every registered kind / environment reads exactly its declared group: none keeps a
  # settings table of its own
  assert set(registry.REWARD_PARTS.names()) == set(config_groups.REWARD_PARTS)
  for name in registry.REWARD_PARTS.names():
    choice = registry.REWARD_PARTS.get(name)
    assert choice.impl.settings is config_groups.REWARD_PARTS[name], name
    assert choice.options == config_groups.REWARD_PARTS[name].names(), name
  assert set(registry.TASK_SOURCES.names()) == set(config_groups.TASK_SOURCES)
  for name in registry.TASK_SOURCES.names():
    choice = registry.TASK_SOURCES.get(name)
    assert choice.impl.settings is config_groups.TASK_SOURCES[name], name
    assert choice.options == config_groups.TASK_SOURCES[name].names(), name
  assert set(registry.ENVIRONMENTS.names()) == set(config_groups.ENVIRONMENTS)
  for name in registry.ENVIRONMENTS.names():
    assert registry.ENVIRONMENTS.get(name).options == config_groups.ENVIRONMENTS[name].names()


def test_the_schema_names_match_the_tables_that_implement_them():
  """Copies only of the names of a table that lives with its implementation (the plain lists
  the verifiers read from config_groups itself)."""
  from reasoning_rl.verifiers import format as format_lib
  from reasoning_rl.verifiers import judge
  from reasoning_rl.verifiers import sandbox

  assert config_groups.SCRIPTS == tuple(format_lib.SCRIPT_NAME_PREFIXES)
  assert config_groups.JUDGEABLE_STATUSES == judge.JUDGEABLE_STATUSES
  assert config_groups.JUDGE_TEMPLATES == tuple(judge.TEMPLATES)
  assert config_groups.CODE_ISOLATIONS == sandbox.ISOLATION_MODES
  assert config_groups.TAG_NAME.problem("think") is None
  for bad in ("", "1st", "a b", "<think>"):  # what format.check_tag refuses
    assert config_groups.TAG_NAME.problem(bad), bad
    with pytest.raises(ConfigError):
      format_lib.check_tag("tag", bad)


class _Unusable:
  """A value no declared setting accepts (not a bool, number, string, list or None)."""

  def __repr__(self):
    return "<unusable>"


def _group_cases():
  for kind, group in config_groups.REWARD_PARTS.items():
    for item in (config_groups.PART_WEIGHT,) + group.fields:
      yield "rewards", kind, item.name
  for kind, group in config_groups.TASK_SOURCES.items():
    for item in group.fields:
      yield "data", kind, item.name
  for name, group in config_groups.ENVIRONMENTS.items():
    for item in group.fields:
      yield "environment", name, item.name


# What a task source needs besides the setting under test.
NEEDED_BY_SOURCES = {"reasoning_gym": {"name": "basic_arithmetic"},
                     "jsonl": {"path": "/nonexistent.jsonl"},
                     "mixture": {"sources": [{"kind": "synthetic_arithmetic"}]}}


@pytest.mark.parametrize(("where", "choice", "setting"), list(_group_cases()))
def test_a_bad_value_of_every_group_setting_is_one_error_naming_the_dotted_field(
    where, choice, setting):
  if where == "rewards":
    from reasoning_rl.verifiers.rewards import RewardFunction

    part = {"kind": choice, "weight": 1.0, **NEEDED.get(choice, {}), setting: _Unusable()}
    with pytest.raises(ConfigError) as error:
      RewardFunction({"probe": part})
    expected = f"config.rewards.probe.{setting}=<unusable>: "
  elif where == "data":
    from reasoning_rl import registry  # noqa: F401  (guess_number's source registers there)
    from reasoning_rl.data.tasks import build_source

    with pytest.raises(ConfigError) as error:
      build_source({"kind": choice, **NEEDED_BY_SOURCES.get(choice, {}), setting: _Unusable()},
                   field="data.train")
    expected = f"config.data.train.{setting}=<unusable>: "
  else:
    from reasoning_rl.environments import build_environment

    with pytest.raises(ConfigError) as error:
      build_environment(choice, {setting: _Unusable()})
    expected = f"config.environment.settings.{setting}=<unusable>: "
  message = str(error.value)
  assert message.startswith(expected + "must be ") or message.startswith(
      expected + "unknown "), message
  assert "\n" not in message


def test_group_errors_say_what_is_accepted_and_the_default():
  from reasoning_rl.environments import build_environment
  from reasoning_rl.verifiers.rewards import RewardFunction

  with pytest.raises(ConfigError) as error:
    RewardFunction({"format": {"weight": 0.1, "require_nonempty_think": "yes"}})
  assert str(error.value) == ("config.rewards.format.require_nonempty_think='yes': must be True "
                              "or False (default True)")
  with pytest.raises(ConfigError) as error:
    RewardFunction({"correct": {"weight": 1.0, "verifier": "maths"}})
  assert str(error.value).startswith("config.rewards.correct.verifier='maths': unknown verifier; "
                                     "use one of ['math', ")
  with pytest.raises(ConfigError) as error:
    RewardFunction({"format": {}})
  assert str(error.value).startswith("config.rewards.format.weight is missing; set it to a number")
  with pytest.raises(ConfigError) as error:
    build_environment("calculator", {"max_calls": 0})
  assert str(error.value) == ("config.environment.settings.max_calls=0: must be an integer in "
                              "[1, 256] (default 8)")
  with pytest.raises(ConfigError) as error:
    build_environment("calculator", {"max_call": 3})
  assert str(error.value) == ("config.environment.settings.max_call: not a setting of "
                              "environment 'calculator'; its settings are ['max_calls']")


def test_docs_config_md_lists_every_group_setting():
  written = (ROOT / "docs" / "config.md").read_text()
  for group in config_groups.GROUPS:
    section = written[written.index(f"## `{group.path}` {group.qualifier}"):]
    for item in group.fields:
      assert f"| `{item.name}` | `{item.default!r}` |" in section, (group.title, item.name)


def test_the_schema_and_its_help_stay_free_of_jax_and_the_verifiers():
  """--help and docs/config.md list the reward parts and environments from the declarations alone:
  nothing that implements them (JAX, math-verify) is imported."""
  code = ("import sys\nfrom reasoning_rl import config_help\nconfig_help.help_text()\n"
          "config_help.markdown_table()\n"
          "print(sorted(m for m in ('jax', 'numpy', 'sympy', 'math_verify', "
          "'reasoning_rl.verifiers.rewards', 'reasoning_rl.environments') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, check=True).stdout
  assert out.strip() == "[]"
