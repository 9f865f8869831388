"""report.md: six plots, "not logged" for missing metrics, the right sample completions."""

import pathlib
import subprocess
import sys

from reasoning_rl import evaluation
from reasoning_rl import report
from reasoning_rl.guards import Trip, write_stopped_md
from reasoning_rl.metrics import MetricsWriter

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("reward_parts.png", "heldout_accuracy.png", "response_length.png", "kl.png",
         "entropy.png", "groups.png")
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16, "seed": 0}


def rollout(step, index, reward, completion):
  return {"step": step, "prompt_id": index, "group_id": index, "sample_index": 0,
          "prompt": f"prompt {index}", "completion": completion, "reward": reward,
          "reward/correct": reward, "advantage": 0.0, "num_tokens": 5, "truncated": False,
          "policy_version": step, "verifier_version": "v", "sampling": SAMPLING,
          "ground_truth": "4"}


def make_run(workdir: pathlib.Path, *, with_kl: bool):
  with MetricsWriter(workdir, tensorboard=False) as writer:
    for step in range(1, 6):
      metrics = {"loss": 0.1, "reward/mean": 0.1 * step, "reward/correct": 0.1 * step,
                 "entropy": 2.0 - 0.1 * step, "response_length/mean": 10 + step,
                 "groups/all_pass_frac": 0.0, "groups/all_fail_frac": 0.5}
      if with_kl:
        metrics["kl"] = 0.01 * step
      writer.write(step, metrics)
    writer.write_rollouts(5, [rollout(5, 0, 0.5, "middle"), rollout(5, 1, 1.0, "BEST ```x```"),
                              rollout(5, 2, 0.0, "WORST"), rollout(5, 3, 0.75, "second")])
  for step, accuracy in ((0, 0.3), (5, 0.45)):
    evaluation.write_eval_result(workdir, step, {
        "accuracy": accuracy, "pass@1": accuracy, "format_rate": 0.5,
        "response_length/mean": 12.0,
        "canaries": [{"uid": "canary-0", "prompt": "say hi",
                      "completions": [{"text": f"hi from step {step}", "num_tokens": 3,
                                       "truncated": False}]}]})


def test_report_with_six_plots_samples_and_not_logged_kl(tmp_path):
  make_run(tmp_path, with_kl=False)
  path = report.write_report(tmp_path, num_samples=1)
  text = path.read_text()
  for name in PLOTS:
    assert (tmp_path / "report" / name).read_bytes()[:8] == PNG_MAGIC
    assert f"(report/{name})" in text
  assert "### KL to the reference — not logged" in text
  assert "### Mean token entropy\n" in text  # logged: no notice
  assert text.count("not logged") == 1
  assert "5 steps logged (1 … 5); 2 held-out evaluations." in text
  assert "| reward/mean | 0.1 | 0.5 |" in text
  assert "| 5 | 0.45 | 0.45 | 0.5 | 12 |" in text
  assert "hi from step 5" in text and "hi from step 0" not in text  # canaries of the last eval
  best = text.index("**Highest #1**: reward 1")
  worst = text.index("**Lowest #1**: reward 0")
  assert best < text.index("BEST") < worst < text.index("WORST")
  assert "````\nBEST ```x```\n````" in text  # fence longer than the backticks inside
  assert "middle" not in text and "second" not in text


def test_report_of_an_empty_workdir_says_not_logged(tmp_path):
  text = report.write_report(tmp_path).read_text()
  assert text.count("— not logged") == 6
  assert "metrics.jsonl: not logged." in text and "Rollout records: not logged." in text
  assert all((tmp_path / "report" / name).exists() for name in PLOTS)


def test_report_mentions_a_guard_stop(tmp_path):
  make_run(tmp_path, with_kl=True)
  write_stopped_md(tmp_path, Trip("max_kl", "KL 0.05 exceeds 1e-12", 5, {"kl": 0.05}))
  text = report.write_report(tmp_path).read_text()
  assert "**Run stopped by guard `max_kl` at step 5** (see STOPPED.md)." in text
  assert "not logged" not in text


def test_launch_report(tmp_path):
  make_run(tmp_path, with_kl=True)
  root = pathlib.Path(__file__).resolve().parents[1]
  proc = subprocess.run([sys.executable, str(root / "launch" / "report.py"),
                         f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == str(tmp_path / "report.md")
  assert (tmp_path / "report" / "kl.png").read_bytes()[:8] == PNG_MAGIC


def test_an_episode_shows_every_turn_and_what_answered_it(tmp_path):
  episode = dict(rollout(1, 0, 1.0, "17 + 25 =42 so the answer is 42."), turns=[
      {"model_text": "17 + 25 =", "num_tokens": 6, "finish_reason": "stop_string",
       "observation": "42", "info": {"calls": 1}},
      {"model_text": " so the answer is 42.", "num_tokens": 7, "finish_reason": "stop_id",
       "observation": None, "unsent_observation": "Correct.", "info": {"calls": 1}}],
      episode_end="done")
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(1, {"reward/mean": 1.0})
    writer.write_rollouts(1, [episode])
  text = report.write_report(tmp_path, num_samples=1).read_text()
  expected = ["Episode (2 turns, ended: done):", "Turn 1 (model):", "```\n17 + 25 =\n```",
              "Turn 1 (environment):", "```\n42\n```", "Turn 2 (model):",
              "```\n so the answer is 42.\n```",
              "Turn 2 (environment, after the episode ended; not shown to the model):",
              "```\nCorrect.\n```", "Scored text:",
              "```\n17 + 25 =42 so the answer is 42.\n```"]
  at = [text.index(piece) for piece in expected]
  assert at == sorted(at)
  assert "Turn 2 (environment):" not in text
