"""Red team: a sound reward passes, weakened rewards are caught, start-up enforcement, CLI."""

import pathlib
import subprocess
import sys
import textwrap

import pytest

from reasoning_rl.errors import VerifierError
from reasoning_rl.verifiers import math_answers as math_lib
from reasoning_rl.reward_redteam import enforce_redteam, run_redteam
from reasoning_rl.verifiers.rewards import RewardFunction

REPO = pathlib.Path(__file__).resolve().parents[1]
SOUND = {
    "correct": {"weight": 1.0, "verifier": "math"},
    "format": {"weight": 0.1},
    "language": {"weight": 0.05},
    "length": {"weight": 1.0, "method": "dapo", "cache_len": 128},
}


def _by_name(report, verifier):
  return {r.probe: r for r in report.results if r.verifier == verifier}


def test_sound_math_reward_passes_every_probe():
  report = run_redteam(SOUND)
  assert report.ok, report.table()
  results = _by_name(report, "math")
  assert len(results) >= 30
  assert results["control_honest_correct"].parts["correct"] == 1.0
  for probe in ("answer_spam_spaces", "answer_spam_commas", "several_boxed_in_answer",
                "several_boxed_no_tags", "disjunction_logic", "false_equation",
                "equation_chain_spam", "set_of_guesses", "prompt_echo", "answer_in_think_only",
                "huge_power"):
    assert results[probe].parts["correct"] == 0.0, probe
  for probe in ("empty_think", "format_only_no_answer", "text_after_answer", "nothing"):
    assert results[probe].parts["format"] == 0.0, probe
  assert results["empty_think"].parts["language"] == 0.0
  assert "OK: no exploit earns reward" in report.table()


FREE_TEXT = {"correct": {"weight": 1.0, "verifier": "math", "extract": "final_answer"}}


@pytest.mark.parametrize("reward", [FREE_TEXT, dict(FREE_TEXT, format={"weight": 0.1})],
                         ids=["correct_only", "with_format"])
def test_free_text_reward_passes_every_probe(reward):
  report = run_redteam(reward)
  assert report.ok, report.table()
  results = _by_name(report, "math")
  controls = [name for name in results if name.startswith("control_")]
  assert len(controls) == 5  # the tagged answer and four sentences
  assert all(results[name].parts["correct"] == 1.0 for name in controls)
  free = [name for name in results if name.startswith("free_")]
  assert len(free) >= 20
  assert all(results[name].parts["correct"] == 0.0 for name in free)


def test_free_text_reward_scores_honest_sentences():
  fn = RewardFunction(FREE_TEXT)
  phrasings = ["{a}", "The answer is {a}.", "17 + 25 = {a}",
               "So the total is 17 + 25 = {a} apples.", "Adding 17 and 25 gives {a}.", "Answer: {a}", "<answer>{a}</answer>",
               r"So the answer is \boxed{{{a}}}."]
  for phrasing in phrasings:
    assert fn({"response": phrasing.format(a=42), "ground_truth": "42"}).total == 1.0, phrasing
    assert fn({"response": phrasing.format(a=41), "ground_truth": "42"}).total == 0.0, phrasing


def test_last_number_is_caught_by_free_text_probes():
  report = run_redteam({"correct": {"weight": 1.0, "verifier": "math", "extract": "last_number"}})
  flagged = {r.probe for r in report.findings}
  assert {"free_or_maybe", "free_maybe", "free_negated", "free_answer_then_another",
          "free_false_equation", "false_equation", "text_after_answer"} <= flagged
  assert not any(name.startswith("control_") for name in flagged)  # its right answers still pay


def test_free_text_controls_only_where_free_text_is_read():
  results = _by_name(run_redteam({"correct": {"weight": 1.0, "verifier": "math"}}), "math")
  assert "control_free_sentence" not in results
  assert results["free_or_maybe"].parts["correct"] == 0.0  # the probes still run


def test_sound_countdown_and_reasoning_gym_rewards_pass():
  for verifier in ("countdown", "reasoning_gym"):
    report = run_redteam({"correct": {"weight": 1.0, "verifier": verifier},
                          "format": {"weight": 0.1}})
    assert report.ok, report.table()
    results = _by_name(report, verifier)
    assert results["control_honest_correct"].parts["correct"] == 1.0
  assert {"scorer_code_injection_open", "scorer_code_injection_import"} <= set(results)
  assert "post_check" not in results  # the injected code never ran


def test_weak_format_is_caught():
  report = run_redteam(dict(SOUND, format={"weight": 0.1, "require_nonempty_think": False}))
  assert not report.ok
  flagged = {r.probe for r in report.findings}
  assert flagged == {"empty_think", "whitespace_think"}
  assert all("format" in r.reason for r in report.findings)
  assert "EXPLOIT" in report.table() and "FAIL: 2 exploit(s)" in report.table()


def test_lenient_verifier_is_caught(monkeypatch):
  # A checker that accepts any response mentioning the truth: the classic spam-able verifier.
  monkeypatch.setattr(math_lib, "is_correct", lambda response, truth, **_: truth in response)
  report = run_redteam(SOUND)
  flagged = {r.probe for r in report.findings}
  assert {"answer_spam_spaces", "answer_spam_commas", "several_boxed_in_answer",
          "prompt_echo", "answer_in_think_only"} <= flagged
  assert "control_honest_correct" not in flagged


def test_verifier_that_rewards_nothing_is_caught(monkeypatch):
  monkeypatch.setattr(math_lib, "is_correct", lambda *args, **kwargs: False)
  report = run_redteam({"correct": {"weight": 1.0}})
  assert [r.probe for r in report.findings] == ["control_honest_correct"]


def test_verifier_that_raises_on_a_probe_is_a_finding_not_a_crash(monkeypatch):
  real = math_lib.is_correct

  def crashes_on_hedges(response, truth, **kwargs):
    if " or " in response:
      raise ZeroDivisionError("verifier bug")
    return real(response, truth, **kwargs)

  monkeypatch.setattr(math_lib, "is_correct", crashes_on_hedges)
  report = run_redteam(SOUND)
  crashed = {r.probe: r.reason for r in report.findings if r.reason.startswith("verifier error")}
  assert "disjunction_word" in crashed and "ZeroDivisionError" in crashed["disjunction_word"]
  assert not report.ok


def test_enforce_redteam():
  assert enforce_redteam(SOUND, allow_exploits=False).ok
  weak = dict(SOUND, format={"weight": 0.1, "require_nonempty_think": False})
  with pytest.raises(VerifierError, match="empty_think") as error:
    enforce_redteam(weak, allow_exploits=False)
  assert "whitespace_think" in str(error.value) and "override" in str(error.value)
  logged = []
  report = enforce_redteam(weak, allow_exploits=True, log=logged.append)
  assert not report.ok
  assert any("RED TEAM OVERRIDDEN" in line and "empty_think" in line for line in logged)


def _run_cli(tmp_path, rewards: dict) -> subprocess.CompletedProcess:
  config = tmp_path / "config.py"
  config.write_text(textwrap.dedent(f"""
      import ml_collections
      def get_config():
        config = ml_collections.ConfigDict()
        config.seed = 0
        config.rewards = ml_collections.ConfigDict({rewards!r})
        return config
  """))
  return subprocess.run([sys.executable, str(REPO / "launch" / "redteam.py"), f"--config={config}"],
                        capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_cli_exit_codes(tmp_path):
  ok = _run_cli(tmp_path, SOUND)
  assert ok.returncode == 0, ok.stderr
  assert "answer_spam_spaces" in ok.stdout and "OK: no exploit earns reward" in ok.stdout
  bad = _run_cli(tmp_path, dict(SOUND, format={"weight": 0.1, "require_nonempty_think": False}))
  assert bad.returncode == 1, bad.stderr
  assert "EXPLOIT" in bad.stdout and "empty_think" in bad.stdout


def test_code_exploits_earn_nothing():
  report = run_redteam({"correct": {"weight": 1.0, "verifier": "code", "timeout_s": 3.0}})
  assert report.ok, report.table()
  results = _by_name(report, "code")
  assert results["control_honest_correct"].parts["correct"] == 1.0
  assert sum(name.startswith("code_") for name in results) >= 12


@pytest.mark.parametrize("template", ["yes_no", "score"])
def test_the_judge_parser_is_probed_and_a_naive_one_is_caught(template, monkeypatch):
  from reasoning_rl.verifiers import judge as judge_lib  # pylint: disable=import-outside-toplevel

  config = {"judge": {"weight": 1.0, "model": "judge.gguf", "template": template}}
  probes = _by_name(run_redteam(config), "judge")
  assert len(probes) >= 15 and not any(r.flagged for r in probes.values())
  # judge-2's parsers: the first yes/no word, the first integer
  naive = {"yes_no": lambda text: 1.0 if text.strip().lower().startswith(("yes", "correct")) or
           "correct" in text.lower() else 0.0,
           "score": lambda text: next((int(w) / 10 for w in text.replace("/", " ").split()
                                       if w.isdigit()), None)}
  monkeypatch.setitem(judge_lib.PARSERS, template, naive[template])
  caught = {r.probe: r.reason for r in run_redteam(config).findings if r.verifier == "judge"}
  assert caught, "a parser that reads negations as a yes must be a finding"
  assert all("right verdict" in reason for reason in caught.values())
