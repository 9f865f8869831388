"""Every config field the training step reads reaches the StepConfig field that uses it, and no
other: each is set to a value no other field holds, alone, and the built StepConfig is compared
with the one from the unchanged config (a swap of b1 and b2, or a field mapped to the wrong
name, fails here)."""

import dataclasses

import pytest

from reasoning_rl.build import step_config
from reasoning_rl.config import FIELD_RANGES, base_config

# config field -> (StepConfig field, a value distinct from every default and every other row)
MAPPING = {
    "beta": ("beta", 0.0371),
    "total_steps": ("total_steps", 417),
    "rollout.max_new_tokens": ("max_completion_length", 333),
    "model.dtype": ("compute_dtype", "bfloat16"),
    "algo.kl_estimator": ("kl_estimator", "k2"),
    "algo.epsilon_low": ("epsilon_low", 0.113),
    "algo.epsilon_high": ("epsilon_high", 0.287),
    "algo.dual_clip": ("dual_clip", 3.7),
    "algo.loss_agg": ("loss_agg", "token-mean"),
    "algo.entropy_coef": ("entropy_coef", 0.0043),
    "algo.num_iterations": ("num_iterations", 3),
    "algo.num_mini_batches": ("num_mini_batches", 5),
    "algo.num_micro_batches": ("num_micro_batches", 7),
    "algo.logprob_chunk": ("logprob_chunk", 96),
    "algo.remat": ("remat", "save_matmuls"),
    "algo.packing": ("packing", True),
    "algo.packed_row_factor": ("packed_row_factor", 6),
    "algo.loss_type": ("loss_type", "cispo"),
    "algo.name": ("algorithm", "ppo"),
    "algo.is_correction": ("is_correction", "sequence-mask"),
    "algo.is_threshold": ("is_threshold", 4.25),
    "algo.vf_coef": ("vf_coef", 0.61),
    "algo.value_clip": ("value_clip", 0.33),
    "algo.gamma": ("gamma", 0.97),
    "algo.gae_lambda": ("gae_lambda", 0.91),
    "optim.learning_rate": ("learning_rate", 2.3e-5),
    "optim.warmup_steps": ("warmup_steps", 11),
    "optim.final_lr_fraction": ("final_lr_fraction", 0.27),
    "optim.weight_decay": ("weight_decay", 0.019),
    "optim.max_grad_norm": ("max_grad_norm", 0.77),
    "optim.b1": ("b1", 0.81),
    "optim.b2": ("b2", 0.987),
    "optim.eps": ("eps", 3e-7),
    "algo.routing_replay": ("routing_replay", True),
    "algo.moe_load_balance_coef": ("moe_load_balance_coef", 0.0123),
    "algo.moe_router_z_coef": ("moe_router_z_coef", 0.00071),
}
# Fields of the algo / optim sections that the step does not read, with the reason.
NOT_THE_STEPS = {
    "algo.estimator",  # the group advantage estimator runs before the step (rl/advantages.py)
    "algo.truncated_ratio",  # read together with the rollout's sampling: its own test below
}


def _base():
  """The defaults, with the layout the machine would choose (step_layout) set by hand."""
  config = base_config()
  config.algo.packing, config.algo.num_micro_batches = False, 1
  return config


def _set(config, dotted, value):
  *parents, leaf = dotted.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = value


@pytest.mark.parametrize("field", sorted(MAPPING))
def test_each_field_reaches_its_step_field_and_no_other(field):
  baseline = dataclasses.asdict(step_config(_base()))
  target, value = MAPPING[field]
  assert baseline[target] != value, f"{field}: pick a value that differs from the default"
  config = _base()
  _set(config, field, value)
  changed = {k: v for k, v in dataclasses.asdict(step_config(config)).items()
             if v != baseline[k]}
  assert changed == {target: value}


def test_the_mapping_covers_every_algo_and_optim_field():
  """A new field under algo / optim must be mapped above (or listed as not the step's)."""
  config = _base()
  fields = {f"{section}.{key}" for section in ("algo", "optim") for key in config[section]}
  assert fields - set(MAPPING) - NOT_THE_STEPS == set()
  assert {f for f in FIELD_RANGES if f.split(".")[0] in ("algo", "optim")} <= set(MAPPING)
  values = [repr(v) for _, v in MAPPING.values() if not isinstance(v, bool)]
  assert len(set(values)) == len(values)  # no two rows share a value


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
