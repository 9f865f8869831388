"""Replay flags exactly the rollout records whose reward differs under a changed verifier config."""

import json
import pathlib
import subprocess
import sys

import pytest

from reasoning_rl.errors import ConfigError

from reasoning_rl.replay import replay
from reasoning_rl.verifiers.rewards import RewardFunction
from tests.support.loop import COMPLETIONS, ORIGINAL, write_run


# Only <answer> spans count now: boxed-only answers lose their `correct` reward.
ANSWER_ONLY = {"correct": {"weight": 1.0, "verifier": "math", "extract": "answer"},
               "format": {"weight": 0.5}}


@pytest.fixture()
def run_dir(tmp_path):
  write_run(tmp_path)
  return tmp_path


def test_same_config_changes_nothing(run_dir):
  report = replay(run_dir, ORIGINAL)
  assert report.num_records == len(COMPLETIONS) and report.changed == []
  assert report.old_verifier_versions == [report.new_verifier_version]


def test_changed_extraction_flags_exactly_the_changed_records(run_dir):
  report = replay(run_dir, ANSWER_ONLY)
  flagged = {(c.step, c.prompt_id, c.sample_index) for c in report.changed}
  expected = {(s, i // 2, i % 2) for i, (s, _, _, changes) in enumerate(COMPLETIONS) if changes}
  assert flagged == expected
  for change in report.changed:
    assert change.parts == {"correct": [1.0, 0.0]}
    assert (change.old_total, change.new_total) == (1.0, 0.0)
    assert change.old_verifier_version == RewardFunction(ORIGINAL).verifier_version
  assert report.new_verifier_version == RewardFunction(ANSWER_ONLY).verifier_version
  assert report.new_verifier_version != report.old_verifier_versions[0]
  assert report.changed_by_part == {"correct": 2, "total": 2}
  assert report.changed[0].file == "step_00000001.jsonl" and report.changed[0].line == 2


def test_changed_weight_changes_totals_only_and_removed_part_is_listed(run_dir):
  reweighted = {**ORIGINAL, "format": {"weight": 0.25}}
  report = replay(run_dir, reweighted)
  # Well-formed responses (format = 1) are records 0 and 4: their totals drop by 0.25.
  assert {(c.step, c.prompt_id, c.sample_index) for c in report.changed} == {(1, 0, 0), (2, 2, 0)}
  assert all(c.parts == {} and c.new_total == c.old_total - 0.25 for c in report.changed)
  assert report.changed_by_part == {"total": 2}
  without_format = replay(run_dir, {"correct": ORIGINAL["correct"]})
  assert len(without_format.changed) == len(COMPLETIONS)  # every record lost its format part
  assert without_format.changed[1].parts == {"format": [0.0, None]}


def test_missing_field_is_named(tmp_path):
  (tmp_path / "rollouts").mkdir()
  (tmp_path / "rollouts" / "step_00000001.jsonl").write_text(json.dumps(
      {"completion": "x", "prompt": "q", "task_prompt": "q", "reward": 0.0, "task": "math",
       "metadata": {}, "tests": [], "num_tokens": 1, "truncated": False,
       "sampling": {"max_new_tokens": 4}, "step": 1, "group_id": 0}) + "\n")
  with pytest.raises(ValueError, match="step_00000001.jsonl:1: rollout record lacks 'ground_truth'"):
    replay(tmp_path, ORIGINAL)
  with pytest.raises(ConfigError, match="nowhere/rollouts is not a directory"):
    replay(tmp_path / "nowhere", ORIGINAL)


def test_launch_replay(run_dir, tmp_path):
  config = tmp_path / "replay_config.py"
  config.write_text("import ml_collections\n\ndef get_config():\n  c = ml_collections.ConfigDict()\n"
                    f"  c.rewards = ml_collections.ConfigDict({ANSWER_ONLY!r})\n  return c\n")
  output = tmp_path / "replay.json"
  root = pathlib.Path(__file__).resolve().parents[1]
  proc = subprocess.run([sys.executable, str(root / "launch" / "replay.py"), f"--workdir={run_dir}",
                         f"--config={config}", f"--output={output}", "--fail_on_change"],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr
  assert "6 records re-scored; 2 changed." in proc.stdout
  data = json.loads(output.read_text())
  assert data["num_changed"] == 2 and data["changed_by_part"] == {"correct": 2, "total": 2}
