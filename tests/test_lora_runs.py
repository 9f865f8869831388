"""LoRA runs end to end on the debug config, through the launchers as users run them: exact
resume after SIGKILL, the base fingerprint check, evaluation of a LoRA run checkpoint, and both
ways of giving the sampler the new policy."""

import json
import signal
import subprocess
import sys

import pytest

from reasoning_rl.metrics import read_metrics
from tests.conftest import REPO
from tests.support.runs import (assert_evaluate_cli_reproduces, signal_after_rows, stable,
                                start_train, train)


LORA = ("--config.lora.rank=4", "--config.lora.alpha=8", "--config.beta=0.04",
        "--config.total_steps=6", "--config.checkpoint.every_steps=2")


@pytest.fixture(scope="module")
def lora_baseline(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("lora_baseline")
  train(workdir, *LORA)
  return workdir


def test_lora_run_records_its_base_and_syncs_adapters_only(lora_baseline):
  record = json.loads((lora_baseline / "model" / "lora.json").read_text())
  assert record["lora"]["rank"] == 4 and record["base"]["random_seed"] == 0
  assert len(record["fingerprint"]) == 16
  rows = read_metrics(lora_baseline / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, 7))
  # adapters of 7 projections x 2 layers of the debug model (D=64, F=128, 4 heads / 2 kv of 16)
  d, f, q, kv, r = 64, 128, 4 * 16, 2 * 16, 4
  adapter_floats = 2 * r * ((d + q) * 2 + (d + kv) * 2 + (d + f) * 3)
  assert {row["sync/bytes"] for row in rows} == {4.0 * adapter_floats}
  # B = 0 at initialisation: step 1's policy is its base (KL zero up to float rounding), and
  # from step 2 on the trained adapters have moved it away
  assert rows[0]["kl"] < 1e-9 and all(r["kl"] > 1e-6 for r in rows[1:]), [r["kl"] for r in rows]


def test_lora_sigkill_then_resume_reproduces_the_uninterrupted_run(lora_baseline, tmp_path):
  process = start_train(tmp_path, *LORA)
  metrics = tmp_path / "metrics.jsonl"
  signal_after_rows(process, metrics, 3, signal.SIGKILL)
  process.wait()
  assert process.returncode == -signal.SIGKILL, "run ended before step 3"
  train(tmp_path, *LORA)
  resumed = read_metrics(metrics)
  assert [r["step"] for r in resumed] == list(range(1, 7))
  assert stable(resumed) == stable(read_metrics(lora_baseline / "metrics.jsonl"))


def test_resuming_on_another_base_is_refused(lora_baseline, tmp_path):
  """Another seed builds another random base with the same shapes: the adapters would restore,
  and only the fingerprint tells them apart."""
  import shutil

  workdir = tmp_path / "run"
  shutil.copytree(lora_baseline, workdir)
  result = train(workdir, *LORA, "--config.seed=5", "--config.total_steps=8",
                 "--config.resume.allow_changes=('seed','total_steps')", check=False)
  assert result.returncode != 0
  last_line = result.stderr.strip().splitlines()[-1]
  assert "trained on a base model with fingerprint" in last_line, result.stderr[-2000:]
  assert len(read_metrics(workdir / "metrics.jsonl")) == 6  # nothing trained, nothing lost


def test_evaluate_cli_loads_the_adapters_onto_their_base(lora_baseline, tmp_path):
  assert_evaluate_cli_reproduces(lora_baseline, tmp_path / "eval.json", step=6)


def test_merged_sampler_weights_move_the_whole_model(tmp_path):
  train(tmp_path, *LORA[:-2], "--config.total_steps=2", "--config.lora.sampler_weights=merged")
  rows = read_metrics(tmp_path / "metrics.jsonl")
  d, f, v, q, kv = 64, 128, 23, 4 * 16, 2 * 16
  layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d + (q + 2 * kv)  # + norms, qkv biases
  assert {row["sync/bytes"] for row in rows} == {4.0 * (v * d + d + 2 * layer)}


def test_the_lora_demo_config_validates_with_its_adapters():
  import importlib

  from reasoning_rl import config as config_lib
  from reasoning_rl.lora import LoraSettings

  demo = importlib.import_module("configs.smollm2_arithmetic_lora").get_config()
  demo.workdir = "/tmp/unused"
  config_lib.validate(demo)
  settings = LoraSettings.from_config(demo)
  assert (settings.rank, settings.target_modules) == (16, r"layers/\d+/(attn|mlp)")
  full = importlib.import_module("configs.smollm2_arithmetic").get_config()
  assert demo.optim.learning_rate == 10 * full.optim.learning_rate  # LoRA's usual 10x
  assert demo.rollout == full.rollout and demo.data.train == full.data.train


def test_generate_cli_reads_a_lora_run_checkpoint(lora_baseline, tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("3+4=", "9+9=")))
  output = tmp_path / "out.jsonl"
  result = subprocess.run(
      [sys.executable, str(REPO / "launch" / "generate.py"), "--checkpoint", str(lora_baseline),
       "--prompts_file", str(prompts), "--max_new_tokens", "8", "--temperature", "0",
       "--no_chat_template", "--output", str(output)],
      cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  rows = [json.loads(line) for line in output.read_text().splitlines()]
  assert len(rows) == 2 and all(1 <= len(r["completion_ids"]) <= 8 for r in rows)


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_qlora_run_trains_samples_and_resumes(quantization, tmp_path):
  """A quantized base in the trainer and in the sampler; its fingerprint is the quantized one,
  and a rerun past the end resumes from it."""
  settings = (*LORA[:-2], f"--config.lora.base_quantization={quantization}",
              "--config.lora.quantization_tile=16", "--config.total_steps=2")
  train(tmp_path, *settings)
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2]
  # step 1's policy is the quantized base itself (B = 0): KL zero up to float rounding
  assert rows[0]["kl"] < 1e-9 and rows[1]["kl"] > 1e-6, [r["kl"] for r in rows]
  record = json.loads((tmp_path / "model" / "lora.json").read_text())
  assert record["lora"]["base_quantization"] == quantization
  train(tmp_path, *settings[:-1], "--config.total_steps=3",
        "--config.resume.allow_changes=('total_steps',)")
  assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
