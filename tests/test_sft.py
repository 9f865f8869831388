"""The R1 recipe's SFT stages on the debug model: cold-start SFT, then rejection-sampling SFT."""

import json

import pytest

from reasoning_rl.data.tasks import build_source
from reasoning_rl.metrics import read_metrics
from reasoning_rl.verifiers.rewards import RewardFunction
from tests.support.runs import train


@pytest.fixture(scope="module")
def cot_file(tmp_path_factory):
  """200 chain-of-thought traces for the synthetic task: "<think>3+4=7</think><answer>7</answer>"."""
  source = build_source({"kind": "synthetic_arithmetic", "seed": 5, "max_operand": 9})
  path = tmp_path_factory.mktemp("cot") / "cot.jsonl"
  rows = []
  for i in range(200):
    example = source.example(i)
    rows.append({"prompt": example.prompt,
                 "completion": f"<think>{example.prompt}{example.answer}</think>"
                               f"<answer>{example.answer}</answer>"})
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


@pytest.fixture(scope="module")
def cold_start(cot_file, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("sft")
  train(workdir, "--config.stage=sft", f"--config.sft.data_path={cot_file}",
        "--config.total_steps=40", "--config.optim.learning_rate=1e-2",
        "--config.checkpoint.every_steps=20")
  return workdir


def test_cold_start_sft_lowers_loss_and_teaches_the_format(cold_start):
  rows = read_metrics(cold_start / "metrics.jsonl")
  assert len(rows) == 40
  assert sum(r["nll"] for r in rows[-5:]) / 5 < 0.5 * sum(r["nll"] for r in rows[:5]) / 5
  before = json.loads((cold_start / "eval" / "step_00000000.json").read_text())
  after = json.loads((cold_start / "eval" / "step_00000040.json").read_text())
  assert before["format_rate"] < 0.1
  assert after["format_rate"] >= before["format_rate"] + 0.5  # held-out prompts
  assert after["accuracy"] > before["accuracy"]


def test_rejection_sampling_sft_keeps_only_verified_traces(cold_start, tmp_path):
  train(tmp_path, "--config.stage=rejection_sft", f"--config.model.path={cold_start}",
        "--config.model.tokenizer=", "--config.rejection.num_prompts=16",
        "--config.rejection.num_samples=4", "--config.total_steps=3",
        "--config.optim.learning_rate=1e-4")
  summary = json.loads((tmp_path / "rejection_sampling.json").read_text())
  kept = [json.loads(line) for line in
          (tmp_path / "rejection_sampling.jsonl").read_text().splitlines()]
  assert summary["sampled"] == 64 and 0 < summary["kept"] == len(kept) <= summary["correct"]
  # every kept trace passes the run's own verifier, and at most one (the shortest) per prompt
  from configs.debug_cpu import get_config

  reward_fn = RewardFunction(get_config().rewards)
  for row in kept:
    reward = reward_fn({"response": row["completion"], "ground_truth": row["answer"],
                        "task": row["task"], "num_tokens": 5, "max_new_tokens": 12})
    assert reward.parts["correct"] == 1.0, row
  assert len({row["prompt"] for row in kept}) == len(kept)
  assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3
