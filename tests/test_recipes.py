"""The algorithm recipes in configs/ (DAPO, GSPO, Dr. GRPO): each sets what its paper changes,
validates at demo size, and trains a few steps at debug size with the behaviour it promises."""

import importlib.util
import json
import subprocess
import sys

import pytest

from reasoning_rl import config as config_lib
from reasoning_rl.errors import ConfigError
from tests.conftest import REPO

RECIPES = ("dapo_smollm2", "gspo_smollm2", "drgrpo_smollm2")


def recipe(name: str, variant: str = ""):
  sys.path.insert(0, str(REPO))
  spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(variant)
  config.workdir = "/tmp/unused"
  return config


@pytest.mark.parametrize("name, expected", [
    ("dapo_smollm2", {"algo.epsilon_low": 0.2, "algo.epsilon_high": 0.28,
                      "algo.loss_agg": "token-mean", "dynamic_sampling.enabled": True,
                      "rewards.length.method": "dapo", "rewards.length.cache_len": 12,
                      "algo.num_mini_batches": 2, "beta": 0.0}),
    ("gspo_smollm2", {"algo.loss_type": "gspo", "algo.epsilon_low": 3e-4,
                      "algo.epsilon_high": 4e-4, "algo.loss_agg": "seq-mean-token-mean",
                      "algo.num_mini_batches": 2, "beta": 0.0}),
    ("drgrpo_smollm2", {"algo.estimator": "dr_grpo", "algo.loss_agg": "seq-mean-token-sum-norm",
                        "algo.num_mini_batches": 1, "beta": 0.0}),
])
def test_recipes_set_their_papers_choices_on_the_demo_and_validate(name, expected):
  config = recipe(name)
  assert config.model.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")  # the demo's model
  for dotted, value in expected.items():
    assert config_lib._field(config, dotted) == value, dotted
  config_lib.validate(config, num_devices=8)


def test_an_unknown_variant_is_one_config_error():
  with pytest.raises(ConfigError, match=r"^--config=configs/gspo_smollm2\.py:tiny: unknown "
                     r"variant; use configs/gspo_smollm2\.py \(the CPU demo\) or "
                     r"configs/gspo_smollm2\.py:debug"):
    config_lib.precheck_command_line(["train.py", "--config=configs/gspo_smollm2.py:tiny"])
  config_lib.precheck_command_line(["train.py", "--config=configs/gspo_smollm2.py:debug",
                                    "--config.algo.epsilon_high=0.001"])


@pytest.fixture(scope="module")
def debug_runs(tmp_path_factory):
  """Each recipe's debug variant for 3 steps through launch/train.py (FILE:debug)."""
  runs = {}
  for name in RECIPES:
    workdir = tmp_path_factory.mktemp(name)
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "train.py"), f"--config=configs/{name}.py:debug",
         f"--config.workdir={workdir}", "--config.total_steps=3",
         "--config.logging.progress_bar=False"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs[name] = workdir
  return runs


def _rows(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_dapo_debug_clips_and_resamples_groups_without_signal(debug_runs):
  rows = _rows(debug_runs["dapo_smollm2"])
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert any(r["clip_frac"] > 0 for r in rows)  # 2 mini-batches: the 2nd update's ratio moved
  assert any(r["dynamic_sampling/groups_sampled"] > r["dynamic_sampling/groups_kept"]
             for r in rows)  # a group with equal rewards was dropped and replaced
  assert all(r["dynamic_sampling/groups_kept"] == 4 for r in rows)
  assert all("reward/length" in r for r in rows)


def test_gspo_debug_clips_whole_sequences(debug_runs):
  rows = _rows(debug_runs["gspo_smollm2"])
  assert all("train/seq_ratio/mean" in r for r in rows)
  # with GSPO's ε of 3e-4 / 4e-4 the 2nd mini-batch's sequence ratios leave the band; the
  # fraction counts sequences (of 16), so it moves in steps of 1/16
  clipped = [r["clip_frac"] for r in rows]
  assert any(c > 0 for c in clipped) and all((c * 16) % 1 == 0 for c in clipped), clipped


def test_drgrpo_debug_advantages_are_not_divided_by_the_group_std(debug_runs):
  records = []
  for path in sorted((debug_runs["drgrpo_smollm2"] / "rollouts").glob("*.jsonl")):
    records += [json.loads(line) for line in path.read_text().splitlines()]
  groups = {}
  for r in records:
    groups.setdefault((r["step"], r["group_id"]), []).append(r)
  assert len(groups) == 3 * 4
  spread = 0.0
  for group in groups.values():
    mean = sum(r["reward"] for r in group) / len(group)
    for r in group:
      assert r["advantage"] == pytest.approx(r["reward"] - mean, abs=1e-5)
    spread = max(spread, max(r["reward"] for r in group) - min(r["reward"] for r in group))
  assert spread > 0  # some group had different rewards, so std division would have shown
  rows = _rows(debug_runs["drgrpo_smollm2"])
  assert all(r["clip_frac"] == 0 for r in rows)  # one update per batch: the ratio stays 1
