"""The RL loop end to end on the debug config, through launch/train.py as users run it."""

import json
import math
import random
import signal
import subprocess
import sys

import pytest

from reasoning_rl.data.debug_vocab import debug_arithmetic_tokenizer
from reasoning_rl.metrics import read_metrics
from tests.conftest import REPO
from tests.support.runs import (  # noqa: F401 (own_signal_handlers: a fixture)
    LOSS_ABS, assert_evaluate_cli_reproduces, own_signal_handlers, rollouts,
    sigterm_in_first_decode_call, signal_after_rows, stable, start_train, train)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("baseline")
  train(workdir)
  return workdir


def test_debug_run_writes_the_workdir_contract(baseline):
  rows = read_metrics(baseline / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, 11))
  required = ("loss", "reward/mean", "reward/correct", "reward/length", "kl", "entropy",
              "clip_frac", "response_length/mean", "groups/all_pass_frac",
              "groups/all_fail_frac", "time/step_s")
  # mean token entropy lies between 0 and that of the uniform distribution over the vocabulary
  # (the random model's is the tokenizer's); completions are 1..max_new_tokens (12) tokens long
  max_entropy = math.log(debug_arithmetic_tokenizer().vocab_size)
  for row in rows:
    assert all(key in row for key in required), set(required) - set(row)
    assert 0 < row["entropy"] <= max_entropy + 1e-6, row["entropy"]
    assert 1 <= row["response_length/mean"] <= 12
    assert 0 <= row["time/compile_s"] <= row["time/step_s"]
  assert rows[0]["time/compile_s"] > 0  # the step and the sampler's programs compile in step 1
  assert [r["time/compile_s"] for r in rows[1:]] == [0.0] * 9  # and never again
  records = rollouts(baseline)
  assert len(records) == 10 * 4 * 4
  for key in ("step", "prompt_id", "group_id", "sample_index", "prompt", "completion", "reward",
              "reward/correct", "advantage", "num_tokens", "truncated", "policy_version",
              "verifier_version", "sampling"):
    assert key in records[0], key
  # GRPO advantages are zero-mean within each group
  by_group = {}
  for r in records:
    by_group.setdefault((r["step"], r["group_id"]), []).append(r["advantage"])
  assert all(abs(sum(a)) < 1e-4 for a in by_group.values())
  assert sorted(p.name for p in (baseline / "eval").iterdir()) == [
      "step_00000000.json", "step_00000010.json"]
  assert list((baseline / "tensorboard").iterdir())
  assert (baseline / "model" / "config.json").exists()
  steps = sorted(int(p.name) for p in (baseline / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [5, 10]


def test_same_config_gives_identical_metrics_and_pool_equals_inline(baseline, tmp_path):
  train(tmp_path, "--config.verifier.num_workers=2")
  assert stable(read_metrics(tmp_path / "metrics.jsonl")) == stable(
      read_metrics(baseline / "metrics.jsonl"))


def test_sigterm_then_sigkill_then_resume_reproduce_the_uninterrupted_run(baseline, tmp_path):
  """A run stopped by SIGTERM (a preemption) once it wrote 3 rows saves its step and exits 143;
  its rerun, SIGKILLed (nothing saved) at a seeded later row, loses the steps after the newest
  checkpoint; the last rerun redoes them and ends with the baseline's metrics. (One chain of
  three processes, each interruption ending a different process.)"""
  metrics = tmp_path / "metrics.jsonl"
  every = "--config.checkpoint.every_steps=3"
  process = start_train(tmp_path, every)
  signal_after_rows(process, metrics, 3, signal.SIGTERM)
  assert process.wait(timeout=120) == 143
  stopped_at = read_metrics(metrics)[-1]["step"]
  assert stopped_at < 10 and (tmp_path / "checkpoints" / str(stopped_at)).exists()

  kill_after = random.Random(20261123).randint(stopped_at + 1, 9)  # seeded: a failure reproduces
  print(f"SIGTERM after step {stopped_at}, SIGKILL after {kill_after} rows")  # -s or on failure
  process = start_train(tmp_path, every)
  signal_after_rows(process, metrics, kill_after, signal.SIGKILL, after_step=stopped_at)
  process.wait()
  assert process.returncode == -signal.SIGKILL, f"run ended before step {kill_after}"
  train(tmp_path, every)
  resumed = read_metrics(metrics)
  assert [r["step"] for r in resumed] == list(range(1, 11)), (stopped_at, kill_after)
  assert stable(resumed) == stable(read_metrics(baseline / "metrics.jsonl")), kill_after


def test_async_with_zero_staleness_equals_sync(baseline, tmp_path):
  train(tmp_path, "--config.async_rollouts.enabled=True",
        "--config.async_rollouts.max_staleness=0")
  assert stable(read_metrics(tmp_path / "metrics.jsonl")) == stable(
      read_metrics(baseline / "metrics.jsonl"))


def test_packed_training_matches_the_padded_run(baseline, tmp_path):
  """algo.packing through the real loop: the first step trains the same batch (sampled by the
  same initial weights) to the same loss, entropy and gradient norm as the padded baseline."""
  train(tmp_path, "--config.algo.packing=True", "--config.total_steps=2")
  packed, padded = read_metrics(tmp_path / "metrics.jsonl"), read_metrics(
      baseline / "metrics.jsonl")
  assert packed[0]["reward/mean"] == padded[0]["reward/mean"]
  assert packed[0]["response_length/mean"] == padded[0]["response_length/mean"]
  for key in ("entropy", "train/grad_norm"):
    assert packed[0][key] == pytest.approx(padded[0][key], rel=1e-4), key
  assert packed[0]["loss"] == pytest.approx(padded[0]["loss"], abs=LOSS_ABS)


def test_exact_logprobs_run_samples_what_the_baseline_samples(baseline, tmp_path):
  """rollout.exact_logprobs through the real loop: float32 drafts need no repair, so the run
  samples and trains what the baseline does, and logs what verification found."""
  train(tmp_path, "--config.rollout.exact_logprobs=True", "--config.total_steps=2")
  exact, plain = read_metrics(tmp_path / "metrics.jsonl"), read_metrics(
      baseline / "metrics.jsonl")
  for row, reference in zip(exact, plain[:2]):
    assert row["sampler/exact_sequences"] == 16 and row["sampler/exact_rounds"] == 1
    assert row["sampler/exact_repairs"] == 0
    assert 0 < row["sampler/exact_draft_mismatch_max"] < 1e-4  # what the mode removed
    assert row["reward/mean"] == reference["reward/mean"]
    assert row["response_length/mean"] == reference["response_length/mean"]
    assert row["loss"] == pytest.approx(reference["loss"], abs=LOSS_ABS)  # π_old: the sampler's
  assert "sampler/exact_repairs" not in plain[0]


def test_a_paged_cache_run_samples_and_trains_what_the_baseline_does(baseline, tmp_path):
  """rollout.kv_page_size through the real loop, with a pool of 16 pages of 4 (the 16 slots'
  whole lengths take 112): samples are preempted and continued, and the run samples and trains
  what the contiguous baseline does."""
  train(tmp_path, "--config.rollout.kv_page_size=4", "--config.rollout.kv_pages=16",
        "--config.total_steps=2")
  paged, plain = read_metrics(tmp_path / "metrics.jsonl"), read_metrics(
      baseline / "metrics.jsonl")
  assert sum(row["throughput/decode_preempted_samples"] for row in paged) > 0
  assert plain[0]["throughput/decode_preempted_samples"] == 0
  for row, reference in zip(paged, plain[:2], strict=False):
    assert row["reward/mean"] == reference["reward/mean"]
    assert row["response_length/mean"] == reference["response_length/mean"]
    # the paged sampler's π_old rounds unlike the contiguous one's, and step 2 follows an AdamW
    # update: LOSS_ABS says why the bound is absolute and this wide
    assert row["loss"] == pytest.approx(reference["loss"], abs=LOSS_ABS)


def test_async_with_staleness_applies_importance_correction(tmp_path):
  train(tmp_path, "--config.async_rollouts.enabled=True",
        "--config.async_rollouts.max_staleness=1", "--config.total_steps=6",
        "--config.checkpoint.every_steps=2")
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert [r["policy_lag"] for r in rows] == [0, 1, 1, 1, 1, 1]
  assert all("train/tis/weight" in r for r in rows)
  # the sampler's policy differs from π_old after the first step: weights move off 1
  assert any(abs(r["train/tis/weight"] - 1.0) > 1e-4 for r in rows[1:])
  records = rollouts(tmp_path)
  assert {r["step"] - r["policy_version"] for r in records if r["step"] > 1} == {2}


def test_dynamic_sampling_trains_only_groups_with_signal(tmp_path):
  train(tmp_path, "--config.dynamic_sampling.enabled=True",
        "--config.dynamic_sampling.max_rounds=8", "--config.rollout.num_samples=2",
        "--config.total_steps=5")
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert sum(r["dynamic_sampling/groups_sampled"] for r in rows) > sum(
      r["dynamic_sampling/groups_kept"] for r in rows)  # some groups were dropped
  groups = {}
  for r in rollouts(tmp_path):
    groups.setdefault((r["step"], r["group_id"]), []).append(r["reward"])
  assert len(groups) == 5 * 4
  assert all(len(set(rewards)) > 1 for rewards in groups.values())


def test_kl_guard_stops_with_exit_code_3(tmp_path):
  result = train(tmp_path, "--config.beta=0.1", "--config.guards.max_kl=1e-12", check=False)
  assert result.returncode == 3, result.stderr[-2000:]
  stopped = (tmp_path / "STOPPED.md").read_text()
  assert "max_kl" in stopped
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert rows[-1]["kl"] > 1e-12 and len(rows) < 10
  assert (tmp_path / "checkpoints" / str(rows[-1]["step"])).exists()


def test_evaluate_cli_reproduces_the_final_in_training_evaluation(baseline, tmp_path):
  assert_evaluate_cli_reproduces(baseline, tmp_path / "eval.json", step=10)


def test_report_has_the_six_plots(baseline):
  from reasoning_rl.report import write_report

  report = write_report(baseline)
  text = report.read_text()
  plots = sorted(p.name for p in (baseline / "report").glob("*.png"))
  assert len(plots) >= 6, plots
  for plot in plots:
    assert plot in text


def test_generate_cli_reads_a_run_checkpoint(baseline, tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("3+4=", "9+9=")))
  outputs = []
  for name in ("a", "b"):
    output = tmp_path / f"{name}.jsonl"
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "generate.py"), "--checkpoint", str(baseline),
         "--prompts_file", str(prompts), "--max_new_tokens", "8", "--temperature", "0",
         "--no_chat_template", "--output", str(output)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    outputs.append([json.loads(line) for line in output.read_text().splitlines()])
  assert outputs[0] == outputs[1] and len(outputs[0]) == 2  # greedy: deterministic
  for row in outputs[0]:
    assert 1 <= len(row["completion_ids"]) <= 8
    assert all(0 <= i < 23 for i in row["completion_ids"])  # the debug vocabulary
    assert all(lp <= 0 for lp in row["logprobs"])


def test_two_iterations_clip_and_sampler_correction_is_logged(tmp_path, own_signal_handlers,
                                                              monkeypatch):
  """μ = 2 epochs × M = 2 mini-batches in the real loop (in process, so the test can keep step 1's
  batch and initial parameters): step 1's logged clip and ratio statistics are those of its four
  AdamW updates rolled here from public pieces (`tests.support.steps.rolled_epochs`)."""
  import jax
  import jax.numpy as jnp
  import optax

  sys.path.insert(0, str(REPO))
  from configs import debug_cpu

  from reasoning_rl.build import build
  from reasoning_rl.rl import batching
  from reasoning_rl.rl.optimizer import learning_rate_schedule
  from reasoning_rl.trainer import Trainer
  from tests.support.steps import rolled_epochs

  config = debug_cpu.get_config()
  config.workdir = str(tmp_path)
  config.logging.progress_bar = False
  config.algo.num_iterations = 2
  config.algo.num_mini_batches = 2
  config.algo.is_correction = "token-truncate"
  config.total_steps = 3
  config.eval.num_examples = 2
  run = build(config)
  initial = jax.tree.map(jnp.array, run.state.params)  # a copy: the step donates the state
  batches, build_batch = [], batching.build_batch
  monkeypatch.setattr(batching, "build_batch",
                      lambda *a, **k: batches.append(build_batch(*a, **k)) or batches[-1])
  assert Trainer(run).run() == 0
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2, 3] and len(batches) == 3
  for row in rows:
    # the sampler's and the trainer's log-probs of the same tokens differ by float32 rounding
    # only (a token off by one position would differ by O(1)); ratios near 1 cap nothing
    assert 0 <= row["train/tis/abs_log_diff"] <= row["train/tis/abs_log_diff/max"] < 1e-5, row
    # each weight is e^{d_t} with |d_t| <= that max, so their mean is 1 within it (+ the mean's
    # float32 rounding); exactly 1.0 only where the two forwards agree bitwise, as on some CPUs
    assert row["train/tis/capped_token_frac"] == 0, row
    assert abs(row["train/tis/weight"] - 1) <= 1.01 * row["train/tis/abs_log_diff/max"] + 1e-6, row
  # Step 1 from the run's initial parameters on the batch it trained: updates on rows 0, 2, …
  # then 1, 3, …, twice, all against π_old of the first forward; optax's AdamW (after global-norm
  # clipping, on the step's schedule) is the reference optimizer.
  c = run.step_fn.config
  adamw = optax.chain(optax.clip_by_global_norm(c.max_grad_norm),
                      optax.adamw(learning_rate_schedule(c), b1=c.b1, b2=c.b2, eps=c.eps,
                                  weight_decay=c.weight_decay))
  expected = rolled_epochs(c, batches[0], adamw, run.step_fn.graphdef, initial)
  assert expected["clip_frac"] > 0.02, expected  # the ratio moves after the first update
  assert rows[0]["clip_frac"] == expected["clip_frac"]
  for key in ("clip_frac/low", "clip_frac/high"):
    assert rows[0][f"train/{key}"] == expected[key], key
  for key in ("ratio/min", "ratio/mean", "ratio/max", "approx_kl"):
    assert rows[0][f"train/{key}"] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
  # the loss: an absolute bound on its terms' scale (LOSS_ABS says why; rel=1e-4 alone failed on
  # an AVX2 EPYC)
  assert rows[0]["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=LOSS_ABS)


def test_sigterm_while_sampling_stops_at_the_next_decode_call_and_resumes_exactly(
    baseline, tmp_path, own_signal_handlers):
  """SIGTERM during step 3's first decode call (of 6: steps_per_call=2 for 12 tokens): the run
  abandons step 3 before its second decode call, saves step 2 and exits 143; the rerun redoes
  step 3 and the metrics equal the uninterrupted run's (decode chunking does not change
  completions)."""
  sys.path.insert(0, str(REPO))
  from configs import debug_cpu

  from reasoning_rl.build import build
  from reasoning_rl.trainer import Trainer

  chunking = "--config.rollout.steps_per_call=2"
  config = debug_cpu.get_config()
  config.workdir = str(tmp_path)
  config.logging.progress_bar = False
  config.rollout.steps_per_call = 2
  run = build(config)
  calls = sigterm_in_first_decode_call(run, version=2)  # sampling step 3
  assert Trainer(run).run() == 143
  assert len(calls) == 1  # the second decode call of step 3 never ran
  assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                if p.name.isdigit()) == [2]
  train(tmp_path, chunking)
  assert stable(read_metrics(tmp_path / "metrics.jsonl")) == stable(
      read_metrics(baseline / "metrics.jsonl"))
