"""Every config field the training step reads reaches the StepConfig field that uses it, and no
other: each is set, alone, to another value its declaration accepts, and the built StepConfig is
compared with the one from the unchanged config (a swap of b1 and b2, or a field read under the
wrong name, fails here). The fields come from StepConfig's own `sourced` declarations and the
values from the schema's: nothing here repeats the mapping. (That each sourced field carries its
config field's name, so that a b1 / b2 swap in the declarations fails, is
test_config_schema.test_typed_views_share_the_schema_names_and_defaults.)"""

import dataclasses

import pytest

from reasoning_rl import config_schema, registries
from reasoning_rl.build import step_config
from reasoning_rl.config import FIELD_RANGES, base_config
from reasoning_rl.config_fields import OneOf, Range
from reasoning_rl.rl.step_config import StepConfig

# What `run_settings.step_config` derives rather than reads by name: config field -> (StepConfig
# field, a value the config accepts, the value the step then holds).
DERIVED = {
    "algo.name": ("algorithm", "ppo", "ppo"),
    "rollout.max_new_tokens": ("max_completion_length", 333, 333),
    "model.dtype": ("compute_dtype", "bfloat16", "bfloat16"),
}
# Fields of the algo / optim sections that the step does not read, with the reason.
NOT_THE_STEPS = {
    "algo.estimator",  # the group advantage estimator runs before the step (rl/advantages.py)
    "algo.truncated_ratio",  # read together with the rollout's sampling: its own test below
}
SOURCED = {item.metadata["source"]: item.name for item in dataclasses.fields(StepConfig)
           if item.metadata.get("source")}


def other_value(dotted: str):
  """A value config field `dotted` accepts that is not its default (nor the step's default)."""
  item = config_schema.field(dotted)
  default = item.default
  if isinstance(default, bool) or item.kind is bool:
    return not default
  rule = item.check
  if isinstance(rule, OneOf):
    names = list(rule.values) or list(getattr(registries, rule.registry).names())
    return next(name for name in names if name != default)
  candidates = ([default + 3, default + 1, max(default - 1, 1)] if isinstance(default, int)
                else [3.7] if default is None
                else [default * 0.9 + 0.013, default * 1.1 + 0.007, default * 0.5])
  if rule is not None and isinstance(rule, Range) and rule.kind is float:
    candidates = [float(c) for c in candidates]
  return next(c for c in candidates if c != default and (rule is None or not rule.problem(c)))


def _base():
  """The defaults, with the layout the machine would choose (step_layout) set by hand."""
  config = base_config()
  config.algo.packing, config.algo.num_micro_batches = False, 1
  config.algo.shared_prompts, config.algo.packed_row_factor = False, 1
  return config


def _set(config, dotted, value):
  *parents, leaf = dotted.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = value


CASES = {**{dotted: (name, other_value(dotted), None) for dotted, name in SOURCED.items()},
         **DERIVED}


@pytest.mark.parametrize("field", sorted(CASES))
def test_each_field_reaches_its_step_field_and_no_other(field):
  target, value, expected = CASES[field]
  expected = value if expected is None else expected
  config = _base()
  baseline = dataclasses.asdict(step_config(config))
  assert baseline[target] != expected, f"{field}: the test's value is the step's default"
  _set(config, field, value)
  changed = {k: v for k, v in dataclasses.asdict(step_config(config)).items()
             if v != baseline[k]}
  assert changed == {target: expected}


def test_every_algo_and_optim_field_reaches_the_step_or_says_why_not():
  """A new field under algo / optim must be sourced by StepConfig, derived, or listed above."""
  config = _base()
  fields = {f"{section}.{key}" for section in ("algo", "optim") for key in config[section]}
  assert fields - set(CASES) - NOT_THE_STEPS == set()
  assert {f for f in FIELD_RANGES if f.split(".")[0] in ("algo", "optim")} <= set(CASES)
  assert set(SOURCED) >= {"beta", "total_steps", "optim.b1", "optim.b2", "algo.epsilon_low"}


def test_the_lora_section_reaches_the_step():
  config = _base()
  assert step_config(config).lora is None
  config.lora.rank, config.lora.alpha = 4, 12.0
  lora = step_config(config).lora
  assert (lora.rank, lora.alpha) == (4, 12.0)


@pytest.mark.parametrize("top_p, field, step", [(0.9, True, True), (0.9, False, False),
                                                (1.0, True, False), (1.0, False, False)])
def test_the_truncated_ratio_reaches_the_step_only_when_rollouts_truncate(top_p, field, step):
  # sampling the model as is, both ratios are the same: the step does not pay for the rebuild
  config = _base()
  config.rollout.top_p, config.algo.truncated_ratio = top_p, field
  assert step_config(config).truncated_ratio is step
