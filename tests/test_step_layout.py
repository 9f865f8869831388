"""The step layout chosen for the machine (reasoning_rl/step_layout.py): packing and micro-batches
left open by the config, against the planner's own verdicts and hand-computed cases."""

import pytest

from reasoning_rl import memory_plan, planning, step_layout
from reasoning_rl.build import step_config
from reasoning_rl.config import base_config
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.config import ModelConfig

GIB = 2**30
TINY = ModelConfig(model_type="qwen2", vocab_size=96, hidden_size=16, intermediate_size=21,
                   num_layers=2, num_heads=3, num_kv_heads=1, head_dim=4, attention_bias=True,
                   tie_word_embeddings=False)
ONE_CPU = step_layout.Machine("cpu", 24 * GIB, num_devices=1, devices_per_host=1)


def _open_config(prompts=4, samples=8, prompt=64, completion=64):
  c = base_config()
  c.rollout.num_prompts, c.rollout.num_samples = prompts, samples
  c.rollout.max_prefill_length, c.rollout.max_new_tokens = prompt, completion
  c.rollout.max_concurrent_decodes = prompts * samples
  c.mesh.trainer = c.mesh.sampler = (1, 1, 1)
  assert c.algo.packing is None and c.algo.num_micro_batches == 0  # the defaults are open
  return c


def test_packing_is_chosen_where_it_serves():
  c = _open_config()
  assert step_layout.choose_packing(c)[0] is True
  c.rollout.top_p = 0.9  # packed rows carry each head position's sampling settings
  assert step_layout.choose_packing(c)[0] is True
  c.stage = "sft"
  assert step_layout.choose_packing(c)[0] is False


def test_shared_prompts_are_chosen_only_on_the_reference_attention():
  c = _open_config()
  c.algo.packing = True
  assert step_layout.choose_shared_prompts(c, "cpu")[0] is True
  assert step_layout.choose_shared_prompts(c, "tpu")[0] is False  # splash: segment equality
  c.model.attention_kernel = "reference"
  assert step_layout.choose_shared_prompts(c, "gpu")[0] is True
  c.algo.moe_load_balance_coef = 0.01  # averaged over positions: sharing would reweigh it
  assert step_layout.choose_shared_prompts(c, "cpu")[0] is False
  c.algo.moe_load_balance_coef = 0.0
  c.algo.packing = False
  assert step_layout.choose_shared_prompts(c, "cpu")[0] is False
  c = _open_config()
  c.algo.packing, c.algo.num_micro_batches = True, 8
  memory_plan.resolve_layout(c, machine=ONE_CPU, model_config=TINY)
  assert (c.algo.shared_prompts, c.algo.packed_row_factor) == (True, 2)
  c = _open_config()
  c.algo.packing, c.algo.num_micro_batches = True, 32  # one row per micro-batch: no room for 2
  memory_plan.resolve_layout(c, machine=ONE_CPU, model_config=TINY)
  assert (c.algo.shared_prompts, c.algo.packed_row_factor) == (True, 1)
  c = _open_config()
  c.algo.shared_prompts = False
  memory_plan.resolve_layout(c, machine=ONE_CPU, model_config=TINY)
  assert c.algo.packed_row_factor == 1
  c = _open_config()
  c.algo.packing, c.algo.shared_prompts, c.algo.num_micro_batches = True, True, 8  # 4 rows each
  assert step_layout.choose_row_factor(c, "cpu", batch_split=lambda rows: 2)[0] == 2
  assert step_layout.choose_row_factor(c, "cpu", batch_split=lambda rows: 4)[0] == 1  # 1 a device
  assert step_layout.choose_row_factor(c, "gpu", batch_split=lambda rows: 1)[0] == 1
  c = _open_config(prompt=256, completion=512 - 256 + 1)  # two rows > 1,024 positions
  memory_plan.resolve_layout(c, machine=ONE_CPU, model_config=TINY)
  assert (c.algo.shared_prompts, c.algo.packed_row_factor) == (True, 1)


def test_shared_prompts_asked_for_on_a_flash_kernel_are_refused():
  c = _open_config()
  c.algo.shared_prompts = True
  c.algo.packing, c.algo.num_micro_batches, c.algo.packed_row_factor = True, 4, 2
  tpu = step_layout.Machine("tpu", 16 * GIB, num_devices=1, devices_per_host=1)
  with pytest.raises(ConfigError, match="algo.shared_prompts=True needs the reference"):
    memory_plan.resolve_layout(c, machine=tpu, model_config=TINY)
  c.model.attention_kernel = "reference"
  assert memory_plan.resolve_layout(c, machine=tpu, model_config=TINY) == []
  c.model.attention_kernel = "splash"
  with pytest.raises(ConfigError, match="attention_kernel='splash'"):
    memory_plan.resolve_layout(c, machine=ONE_CPU, model_config=TINY)


def test_a_cpu_splits_the_demo_batch_into_micro_batches_of_about_1k_positions():
  c = _open_config()  # 32 rows of 64 + 64 positions, the CPU demo's shape
  lines = memory_plan.resolve_layout(c, machine=ONE_CPU, model_config=TINY)
  # 8 rows x 128 = 1,024 positions: the cap; 16 rows would be 2,048
  assert c.algo.num_micro_batches == 4 and c.algo.packing is True
  assert lines[0].startswith("algo.packing = True")
  assert lines[1].startswith("algo.shared_prompts = True")  # a CPU runs the reference attention
  assert lines[2].startswith("algo.num_micro_batches = 4: 8 rows of 128 positions")
  assert lines[3].startswith("algo.packed_row_factor = 2")
  c = _open_config(prompt=32, completion=32)  # 32 rows of 64: 16 rows per micro-batch
  memory_plan.resolve_layout(c, machine=ONE_CPU, model_config=TINY)
  assert c.algo.num_micro_batches == 2
  c = _open_config(prompt=1024, completion=1024)  # a row alone is over the cap: one per step
  memory_plan.resolve_layout(c, machine=ONE_CPU, model_config=TINY)
  assert c.algo.num_micro_batches == 32


def _long_rows():
  """16 rows of 8,192 positions on the reference attention: 6.01 GiB of activations per row
  (tests/test_planning.py works the figure out by hand)."""
  c = _open_config(prompts=4, samples=4, prompt=32, completion=8192 - 32)
  c.model.attention_kernel = "reference"
  c.rollout.max_concurrent_decodes = 8
  c.algo.logprob_chunk = 8
  return c


def test_an_accelerator_takes_the_fewest_micro_batches_that_fit():
  c = _long_rows()
  gpu = step_layout.Machine("gpu", 24 * GIB, num_devices=1, devices_per_host=1)
  memory_plan.resolve_layout(c, machine=gpu, model_config=TINY)
  # 4 rows (4 micro-batches) hold 24.0 GiB, over 21.6 usable; 2 rows (8) fit
  assert c.algo.num_micro_batches == 8
  target = {"chip": planning.ChipSpec("gpu", 24 * GIB, 1.0, 1.0, backend="gpu"),
            "num_devices": 1}
  for k, fits in ((4, False), (8, True)):
    c.algo.num_micro_batches = k
    assert planning.plan(c, TINY, target=target).fits is fits
  # a device with room for the whole batch takes it in one micro-batch
  c = _long_rows()
  memory_plan.resolve_layout(c, machine=step_layout.Machine("gpu", 200 * GIB, 1, 1),
                          model_config=TINY)
  assert c.algo.num_micro_batches == 1


def test_nothing_fits_takes_the_most_micro_batches_and_says_so():
  c = _long_rows()
  lines = memory_plan.resolve_layout(c, machine=step_layout.Machine("tpu", 4 * GIB, 1, 1),
                                  model_config=TINY)
  assert c.algo.num_micro_batches == 16
  micro = next(line for line in lines if line.startswith("algo.num_micro_batches"))
  assert "does not fit" in micro and "dry_run" in micro


def test_set_fields_are_kept_and_an_open_config_has_no_step_config():
  c = _open_config()
  with pytest.raises(ConfigError, match="resolve_layout"):
    step_config(c)
  c.algo.packing, c.algo.num_micro_batches = False, 2
  c.algo.shared_prompts, c.algo.packed_row_factor = False, 1
  assert memory_plan.resolve_layout(c, machine=ONE_CPU, model_config=TINY) == []
  assert (c.algo.packing, c.algo.num_micro_batches) == (False, 2)
  assert step_config(c).num_micro_batches == 2
  c = _open_config()
  c.algo.num_micro_batches = 8  # packing, shared prompts and the row factor are open
  assert len(memory_plan.resolve_layout(c, machine=ONE_CPU, model_config=TINY)) == 3
  assert (c.algo.packing, c.algo.num_micro_batches) == (True, 8)


def test_the_dry_run_plans_with_what_the_target_would_choose():
  c = _long_rows()
  c.mesh.trainer = c.mesh.sampler = (4, 1, 1)  # one v5p host, 4 rows per device
  p = planning.plan(c, TINY, target={"tpu": "v5p", "num_devices": 4})
  assert c.algo.num_micro_batches == 0  # the caller's config is left open
  assert any(line.startswith("algo.num_micro_batches = ") for line in p.step_layout)
  assert "Chosen for this target: algo.num_micro_batches" in p.table()
  chosen = dict(line.split(": ")[0].split(" = ") for line in p.step_layout)
  assert chosen["algo.packed_row_factor"] == "1"  # twice as long only on a CPU
  fixed = _long_rows()
  fixed.mesh.trainer = fixed.mesh.sampler = (4, 1, 1)
  fixed.algo.num_micro_batches = int(chosen["algo.num_micro_batches"])
  fixed.algo.packing, fixed.algo.packed_row_factor = True, 1
  fixed.algo.shared_prompts = chosen["algo.shared_prompts"] == "True"
  same = planning.plan(fixed, TINY, target={"tpu": "v5p", "num_devices": 4})
  assert same.slices == p.slices and p.fits


def test_a_resume_may_change_the_layout_and_nothing_else(tmp_path):
  from reasoning_rl import workdir

  first = base_config()
  first.algo.packing, first.algo.num_micro_batches = False, 2  # an older run's concrete layout
  assert workdir.check_or_write_fingerprint(tmp_path, first.to_dict()) == []
  again = base_config()  # open layout, as today's defaults
  changed = workdir.check_or_write_fingerprint(tmp_path, again.to_dict())
  assert sorted(line.split(":")[0] for line in changed) == ["algo.num_micro_batches",
                                                             "algo.packing"]
  again.algo.num_iterations = 2  # what a step computes: refused
  with pytest.raises(ConfigError, match="algo.num_iterations"):
    workdir.check_or_write_fingerprint(tmp_path, again.to_dict())
