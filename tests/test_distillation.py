"""On-policy distillation (`teacher.*`, rl/distillation.py, rl/teacher.py): the per-token
advantage against hand computations, the teacher's log-probs against an independent forward, the
vocabulary refusal, the settings' checks, and short debug runs with a teacher (full, LoRA,
partial rollouts)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.build import build, build_teacher
from reasoning_rl.config import validate
from reasoning_rl.errors import ConfigError
from reasoning_rl.metrics import read_metrics
from reasoning_rl.models.checkpoints import save_hf
from reasoning_rl.models.tokenizers import load_tokenizer
from reasoning_rl.models.transformer import create_model
from reasoning_rl.rl import batching
from reasoning_rl.rl.distillation import (DistillationSettings, discounted_sums,
                                          distillation_metrics, token_advantages)
from reasoning_rl.rl.rollout_columns import Ragged, RolloutColumns
from reasoning_rl.rl.teacher import Teacher, check_same_vocabulary
from reasoning_rl.run_settings import random_model_config
from tests.support.configs import debug_config, demo_config
from tests.support.generation import write_word_tokenizer
from tests.support.rollouts import group, record
from tests.support.runs import rollouts as read_rollouts
from tests.support.runs import train


def _with_teacher(rollouts: RolloutColumns, rows) -> RolloutColumns:
  return rollouts.with_teacher_logprobs(Ragged.from_rows(rows, np.float32))


# ------------------------------------------------------------------------ the advantage, by hand


def _two_samples():
  # student log μ per token, teacher log π_T per token (values exact in float32)
  student = [[-0.5, -1.0, -2.0], [-0.25, -0.75]]
  teacher = [[-1.5, -0.5, -2.0], [-0.25, -2.75]]
  rollouts = group([1.0, 0.0], [3, 2], logprobs=student)
  return _with_teacher(rollouts, teacher)


def test_alone_each_token_gets_minus_coef_times_its_reverse_kl():
  rollouts = _two_samples().with_advantages([0.75, -0.75])  # ignored at reward_weight 0
  got = token_advantages(rollouts, kl_coef=0.5, reward_weight=0.0, discount=0.0)
  # k = μ − teacher: [1.0, -0.5, 0.0] and [0.0, 2.0]; A = −0.5 · k
  np.testing.assert_array_equal(got.rows()[0], np.array([-0.5, 0.25, 0.0], np.float32))
  np.testing.assert_array_equal(got.rows()[1], np.array([0.0, -1.0], np.float32))
  assert got.values.dtype == np.float32


def test_added_to_the_sequence_advantage_with_its_weight():
  rollouts = _two_samples().with_advantages([0.75, -0.75])
  got = token_advantages(rollouts, kl_coef=2.0, reward_weight=0.5, discount=0.0)
  # 0.5 · A_seq − 2 · k
  np.testing.assert_allclose(got.rows()[0], [0.375 - 2.0, 0.375 + 1.0, 0.375], rtol=0, atol=0)
  np.testing.assert_allclose(got.rows()[1], [-0.375, -0.375 - 4.0], rtol=0, atol=0)


def test_a_discount_sums_the_later_tokens():
  np.testing.assert_allclose(discounted_sums([1.0, 2.0, 3.0], 0.5), [2.75, 3.5, 3.0])
  np.testing.assert_allclose(discounted_sums([1.0, 2.0, 3.0], 0.0), [1.0, 2.0, 3.0])
  np.testing.assert_allclose(discounted_sums([1.0, 2.0, 3.0], 1.0), [6.0, 5.0, 3.0])
  got = token_advantages(_two_samples(), kl_coef=1.0, reward_weight=0.0, discount=0.5)
  np.testing.assert_allclose(got.rows()[0], [-(1.0 - 0.25 + 0.0), -(-0.5 + 0.0), 0.0])
  np.testing.assert_allclose(got.rows()[1], [-(0.0 + 1.0), -2.0])


def test_a_teacher_equal_to_the_student_gives_zero_advantage():
  student = [[-0.3, -1.7, -0.01], [-2.2]]
  rollouts = _with_teacher(group([1.0, 0.0], [3, 1], logprobs=student), student)
  got = token_advantages(rollouts, kl_coef=3.0, reward_weight=0.0, discount=0.9)
  assert np.all(got.values == 0.0)
  assert distillation_metrics(rollouts)["teacher/reverse_kl"] == 0.0


def test_observation_tokens_carry_no_reverse_kl():
  rollouts = group([1.0, 0.0], [3, 2], logprobs=[[-0.5, -1.0, -2.0], [-0.25, -0.75]],
                   loss_masks=[[1, 0, 1], [1, 1]])
  rollouts = _with_teacher(rollouts, [[-1.5, -4.0, -1.0], [-0.25, -2.75]])
  got = token_advantages(rollouts, kl_coef=1.0, reward_weight=0.0, discount=0.0)
  np.testing.assert_allclose(got.rows()[0], [-1.0, 0.0, 1.0])
  metrics = distillation_metrics(rollouts)
  # model tokens only: k = 1.0, -1.0, 0.0, 2.0
  assert metrics["teacher/tokens"] == 4
  assert metrics["teacher/reverse_kl"] == pytest.approx(0.5)
  assert metrics["teacher/logprob"] == pytest.approx((-1.5 - 1.0 - 0.25 - 2.75) / 4)
  assert metrics["teacher/student_logprob"] == pytest.approx((-0.5 - 2.0 - 0.25 - 0.75) / 4)


def test_the_batch_carries_the_token_advantages_row_by_row():
  rollouts = _two_samples()
  rollouts = rollouts.with_token_advantages(
      token_advantages(rollouts, kl_coef=1.0, reward_weight=0.0, discount=0.0))
  batch = batching.build_batch(record(rollouts), num_groups=2, group_size=2, prompt_length=4,
                               completion_length=4, pad_id=0)
  assert batch["advantages"].shape == (4, 4)
  np.testing.assert_array_equal(batch["advantages"][0], [-1.0, 0.5, 0.0, 0.0])
  np.testing.assert_array_equal(batch["advantages"][1], [0.0, -2.0, 0.0, 0.0])
  assert not batch["advantages"][2:].any()  # rows without a group


def test_the_teacher_column_survives_json_take_and_concat():
  rollouts = _two_samples()
  again = RolloutColumns.from_json(json.loads(json.dumps(rollouts.to_json())))
  assert again == rollouts and again.teacher_logprobs == rollouts.teacher_logprobs
  both = record(rollouts, _with_teacher(group([0.0, 1.0], [1, 1], position=3),
                                        [[-9.0], [-8.0]]))
  assert both.take_groups([1]).teacher_logprobs.values.tolist() == [-9.0, -8.0]


# ------------------------------------------------------------------------ the teacher's forward


def _debug_model(seed: int):
  model_config, tokenizer = random_model_config(debug_config())
  return create_model(model_config, seed=seed, dtype="float32", param_dtype="float32"), tokenizer


def _independent_logprobs(model, prompt, completion):
  """log π(completion token t | prompt, completion[:t]) from one unpadded forward and a numpy
  log-softmax of its logits."""
  tokens = jnp.asarray([list(prompt) + list(completion)], jnp.int32)
  logits = np.asarray(model.logits_from_hidden(model.hidden_states(tokens)), np.float64)[0]
  logits = logits - logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return np.array([logp[len(prompt) - 1 + t, token] for t, token in enumerate(completion)])


@pytest.mark.parametrize("max_batch", [1, 16])
def test_teacher_logprobs_equal_an_independent_forward(max_batch):
  model, _ = _debug_model(seed=1)
  prompts = [(5, 6, 7, 8), (9, 10)]
  completions = [[11, 12, 13], [14], [4, 5, 6, 7, 8], [2, 3]]
  rollouts = record(group([1.0, 0.0], completions[:2], prompt=prompts[0]),
                    group([0.0, 1.0], completions[2:], prompt=prompts[1], position=1))
  teacher = Teacher(model, prompt_length=6, completion_length=5, pad_id=0, max_batch=max_batch,
                    chunk_size=2)
  scored = teacher.score(rollouts).teacher_logprobs
  assert scored.lengths.tolist() == [3, 1, 5, 2]
  for s, completion in enumerate(completions):
    reference = _independent_logprobs(model, prompts[s // 2], completion)
    np.testing.assert_allclose(scored[s], reference, rtol=0, atol=2e-5)
  # not the student's numbers: another model's forward differs
  other, _ = _debug_model(seed=2)
  assert np.abs(_independent_logprobs(other, prompts[0], completions[0]) - scored[0]).max() > 1e-3


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(tmp_path):
  _, student = _debug_model(seed=0)
  write_word_tokenizer(tmp_path, vocab_size=student.vocab_size)
  same_size = load_tokenizer(tmp_path)
  with pytest.raises(ConfigError) as error:
    check_same_vocabulary(student, same_size)
  message = str(error.value)
  assert "\n" not in message and "config.teacher.path" in message
  assert f"{student.vocab_size} tokens" in message
  assert "first difference at id 0: student '<pad>', teacher 't0'" in message
  write_word_tokenizer(tmp_path, vocab_size=40)
  with pytest.raises(ConfigError, match=r"40 tokens.*differs from the student's .*23 tokens"):
    check_same_vocabulary(student, load_tokenizer(tmp_path))
  check_same_vocabulary(student, _debug_model(seed=3)[1])  # the same vocabulary passes


def test_build_teacher_loads_a_checkpoint_and_refuses_another_vocabulary(tmp_path):
  model, student = _debug_model(seed=1)
  save_hf(model, student, tmp_path / "teacher")
  config = debug_config(**{"teacher.path": str(tmp_path / "teacher")})
  teacher = build_teacher(config, student)
  assert teacher.completion_length == config.rollout.max_new_tokens
  rollouts = group([1.0, 0.0], [[11, 12], [13]])
  np.testing.assert_allclose(teacher.score(rollouts).teacher_logprobs[0],
                             _independent_logprobs(model, (5, 6, 7), [11, 12]), atol=2e-5)
  (tmp_path / "other").mkdir()
  write_word_tokenizer(tmp_path / "other", vocab_size=student.vocab_size)
  save_hf(model, load_tokenizer(tmp_path / "other"), tmp_path / "other_vocab")
  with pytest.raises(ConfigError, match="vocabulary"):
    build_teacher(debug_config(**{"teacher.path": str(tmp_path / "other_vocab")}), student)
  with pytest.raises(ConfigError, match=r"config.teacher.path=.*no such file"):
    build_teacher(debug_config(**{"teacher.path": str(tmp_path / "missing")}), student)
  assert build_teacher(debug_config(), student) is None


def test_the_teacher_sits_on_the_sampler_devices_and_scores_there(tmp_path):
  model, student = _debug_model(seed=1)
  save_hf(model, student, tmp_path / "teacher")
  config = debug_config(**{"teacher.path": str(tmp_path / "teacher"), "workdir": str(tmp_path),
                           "mesh.num_trainer_devices": 4})
  run = build(config)
  try:
    sampler_devices = set(run.sampler_mesh.devices.flat)
    assert sampler_devices.isdisjoint(run.trainer_mesh.devices.flat)
    for leaf in jax.tree.leaves(run.teacher.state):
      assert set(leaf.sharding.device_set) <= sampler_devices
    rollouts = group([1.0, 0.0], [[11, 12], [13]])
    np.testing.assert_allclose(run.teacher.score(rollouts).teacher_logprobs[0],
                               _independent_logprobs(model, (5, 6, 7), [11, 12]), atol=2e-5)
  finally:
    run.scorer.close()
    run.backend.stop()


# ------------------------------------------------------------------------ settings


def test_settings_read_the_teacher_section():
  settings = DistillationSettings.from_config(debug_config(**{
      "teacher.path": "/t", "teacher.kl_coef": 0.25, "teacher.reward_weight": 1.5,
      "teacher.discount": 0.5, "teacher.max_batch": 3}))
  assert settings == DistillationSettings(path="/t", kl_coef=0.25, reward_weight=1.5,
                                          discount=0.5, max_batch=3)
  assert settings.enabled and not DistillationSettings.from_config(debug_config()).enabled


@pytest.mark.parametrize(("overrides", "field"), [
    ({"algo.name": "ppo"}, "config.algo.name"),
    ({"algo.loss_type": "gspo"}, "config.algo.loss_type"),
    ({"stage": "sft", "sft.data_path": "x.jsonl"}, "config.teacher.path"),
    ({"teacher.kl_coef": 0.0}, "config.teacher.kl_coef"),
    ({"teacher.discount": 1.5}, "config.teacher.discount"),
])
def test_what_distillation_cannot_be_combined_with_is_refused(overrides, field):
  config = debug_config(**{"teacher.path": "/teacher", **overrides})
  with pytest.raises(ConfigError) as error:
    validate(config)
  assert str(error.value).startswith(field), str(error.value)


def test_distillation_alone_needs_no_group():
  validate(debug_config(**{"teacher.path": "/teacher", "rollout.num_samples": 1}))
  with pytest.raises(ConfigError, match="rollout.num_samples"):
    validate(debug_config(**{"teacher.path": "/teacher", "rollout.num_samples": 1,
                             "teacher.reward_weight": 1.0}))


# ------------------------------------------------------------------------ runs with a teacher


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
  """The debug student's own initial weights (seed 0) and another random model (seed 1), each
  saved as a Hugging Face directory with the student's tokenizer."""
  root = tmp_path_factory.mktemp("teachers")
  out = {}
  for name, seed in (("same", 0), ("other", 1)):
    model, tokenizer = _debug_model(seed)
    save_hf(model, tokenizer, root / name)
    out[name] = str(root / name)
  return out


def _run(workdir, teacher, *overrides):
  train(workdir, "--config.total_steps=2", "--config.eval.num_examples=2",
        "--config.checkpoint.every_steps=2", f"--config.teacher.path={teacher}", *overrides)
  return read_metrics(workdir / "metrics.jsonl")


def _train_rows(rows):
  return [row for row in rows if "teacher/reverse_kl" in row]


def test_a_run_distills_from_its_teacher(tmp_path, teachers):
  rows = _train_rows(_run(tmp_path / "run", teachers["other"], "--config.teacher.kl_coef=0.5",
                          "--config.teacher.reward_weight=1.0"))
  assert len(rows) == 2
  for row in rows:
    assert math.isfinite(row["loss"]) and row["loss"] != 0.0
    assert row["teacher/reverse_kl"] > 0.01  # another random model disagrees
    assert row["teacher/tokens"] > 0 and row["time/teacher_s"] > 0
    assert math.isfinite(row["teacher/logprob"]) and math.isfinite(row["teacher/student_logprob"])
  records = read_rollouts(tmp_path / "run")
  assert records and all(len(r["token_advantages"]) == r["num_tokens"] for r in records
                         if r["num_tokens"])


def test_a_teacher_equal_to_the_student_starts_at_zero_reverse_kl(tmp_path, teachers):
  rows = _train_rows(_run(tmp_path / "run", teachers["same"], "--config.algo.packing=False"))
  # step 1 samples with the initial weights, which the teacher holds: only the sampler's and the
  # trainer's rounding tell them apart
  assert abs(rows[0]["teacher/reverse_kl"]) < 1e-4
  first = [r for r in read_rollouts(tmp_path / "run") if r["step"] == 1]
  assert max(abs(a) for r in first for a in r["token_advantages"]) < 1e-3
  assert abs(rows[0]["loss"]) < 1e-3


def test_a_lora_student_distills(tmp_path, teachers):
  rows = _train_rows(_run(tmp_path / "run", teachers["other"], "--config.lora.rank=4"))
  assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
  assert rows[0]["teacher/reverse_kl"] > 0.01


def test_partial_rollouts_distill(tmp_path, teachers):
  rows = _train_rows(_run(tmp_path / "run", teachers["other"],
                          "--config.partial_rollouts.enabled=True"))
  assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
  assert all(r["teacher/tokens"] > 0 for r in rows)



def test_the_demo_distills_the_rl_demo_into_its_base_and_changes_nothing_else():
  opd, demo = demo_config("smollm2_opd_arithmetic"), demo_config("smollm2_arithmetic")
  assert opd.teacher.path == "runs/demo" and opd.teacher.reward_weight == 0.0
  assert opd.model.path == demo.model.path  # the base SmolLM2 as student
  different = {section for section in opd.keys() if opd[section] != demo[section]}
  assert different == {"teacher"}
  validate(opd)
