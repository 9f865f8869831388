"""Second demo tasks (configs/smollm2_decimal_chain_sum.py, smollm2_lcm.py, smollm2_aiw.py,
smollm2_number_format.py: reasoning-gym tasks on SmolLM2-135M) and decimal_chain_sum's debug
variant (configs/debug_decimal_chain_sum.py: the same data, template, temperature and verifier on
a tiny random model with SmolLM2's tokenizer), run through launch/train.py."""

import functools
import json
import math
import subprocess
import sys

import pytest

from reasoning_rl import config as config_lib
from reasoning_rl.data import tasks
from reasoning_rl.verifiers.rewards import CompletionRecord, RewardFunction
from tests.conftest import REPO
from tests.support.configs import demo_config
from tests.support.runs import rollouts


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("decimal") / "run"
  command = [sys.executable, str(REPO / "launch" / "train.py"),
             "--config=configs/debug_decimal_chain_sum.py", f"--config.workdir={workdir}",
             "--config.total_steps=2", "--config.logging.progress_bar=False"]
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, f"train.py exited {result.returncode}:\n{result.stderr[-3000:]}"
  return workdir


def correct(reward_fn, example, text: str) -> float:
  """The demo reward's `correct` part for `text` as the answer to the task example `example`."""
  return reward_fn(CompletionRecord(response=text, ground_truth=example.answer,
                                    task=example.task, prompt=example.prompt)).parts["correct"]


def decimal_sum(expression: str) -> float:
  """The value of a decimal_chain_sum expression of two terms ("4.9 - 7.3")."""
  left, op, right = expression.split()
  return float(left) + float(right) if op == "+" else float(left) - float(right)


def arithmetic_demo_on(task: str):
  """configs/smollm2_TASK.py, checked to be the arithmetic demo on reasoning-gym TASK (its own
  training and held-out seeds, the same rewards, algorithm, optimiser, length and model) and
  valid; returned with the demo's config."""
  config, demo = demo_config(f"smollm2_{task}"), demo_config("smollm2_arithmetic")
  assert (config.data.train.name, config.data.eval.name) == (task, task)
  assert config.data.train.seed != config.data.eval.seed
  for field in ("rewards", "algo", "optim", "model"):
    assert config[field] == demo[field], field
  assert config.total_steps == 40  # as measured (RESULTS.md); the arithmetic demo runs 30
  config_lib.validate(config, num_devices=1)
  return config, demo


def test_the_lcm_demo_is_the_arithmetic_demo_on_another_task():
  lcm, demo = arithmetic_demo_on("lcm")
  assert (lcm.rollout.num_prompts, lcm.rollout.num_samples) == (
      demo.rollout.num_prompts, demo.rollout.num_samples)
  assert lcm.rollout.max_new_tokens == 2 * demo.rollout.max_new_tokens  # room to work it out


def test_the_aiw_config_is_the_arithmetic_demo_on_aiw():
  """configs/smollm2_aiw.py (a candidate that did not learn yet, RESULTS.md) stays valid."""
  aiw, _ = arithmetic_demo_on("aiw")
  example = tasks.build_source(aiw.data.eval, field="data.eval").example(0)
  assert example.prompt.startswith("Susan has 5 sisters") and example.answer == "6"


def test_the_number_format_config_and_its_answers():
  """configs/smollm2_number_format.py: the demo on number_format; an answer counts in any notation
  of the right candidate's value, and naming several candidates earns nothing."""
  nf, demo = arithmetic_demo_on("number_format")
  assert nf.rollout.max_new_tokens == demo.rollout.max_new_tokens
  reward_fn = RewardFunction(nf.rewards)
  source = tasks.build_source(nf.data.eval, field="data.eval")
  for example in (source.example(i) for i in range(8)):
    candidates = example.metadata["candidates"]
    right = example.metadata["solution"]
    wrong = next(c for c in candidates if c != right)
    assert float(example.answer) == right and right in candidates
    score = functools.partial(correct, reward_fn, example)
    assert score(f"The {example.metadata['size']} number is {right}.") == 1.0
    assert score(f"The answer is {right:e}") == 1.0  # scientific notation, same value
    assert score(f"The answer is {wrong}.") == 0.0
    assert score(f"The answer is {right} or {wrong}.") == 0.0  # a hedge earns nothing


def test_the_demo_verifier_grades_lcm_answers_in_free_text():
  config = demo_config("smollm2_lcm")
  reward_fn = RewardFunction(config.rewards)
  source = tasks.build_source(config.data.eval, field="data.eval")
  examples = [source.example(i) for i in range(12)]
  for example in examples:
    a, b = example.metadata["numbers"]
    truth = math.lcm(a, b)
    assert example.answer == str(truth)
    score = functools.partial(correct, reward_fn, example)
    assert score(f"The LCM of {a} and {b} is {truth}.") == 1.0
    assert score(f"The least common multiple is $\\boxed{{{truth}}}$") == 1.0
    assert score(f"{a} × {b // math.gcd(a, b)} = {truth}") == 1.0  # a chain that holds
    assert score(f"The LCM is {truth + 1}.") == 0.0
    assert score(f"The LCM is {truth} or {truth + 1}.") == 0.0  # a hedge earns nothing
    assert score(f"{a} and {b}") == 0.0  # echoing the numbers is no answer


def test_the_debug_variant_runs_the_task_through_training_and_evaluation(debug_run):
  records = rollouts(debug_run)
  assert {r["step"] for r in records} == {1, 2} and len(records) == 2 * 4 * 4
  for record in records:
    assert record["task"] == "decimal_chain_sum" and record["sampling"]["temperature"] == 0.7
    assert record["task_prompt"].startswith("State the final answer to the following arithmetic")
    assert record["prompt"].startswith("<|im_start|>system")  # SmolLM2's chat template
    truth = decimal_sum(record["metadata"]["expression"])
    assert float(record["ground_truth"]) == pytest.approx(truth)
    assert record["verifier_version"].startswith("correct=math-5")
  evals = sorted((debug_run / "eval").glob("step_*.json"))
  assert [p.name for p in evals] == ["step_00000000.json", "step_00000002.json"]
  result = json.loads(evals[-1].read_text())
  assert result["num_examples"] == 4
  assert all(e["uid"].startswith("decimal_chain_sum/987654/") for e in result["examples"])


def test_the_decimal_chain_sum_config_and_its_answers():
  """configs/smollm2_decimal_chain_sum.py: the demo on decimal_chain_sum, sampled at temperature
  0.7; an answer counts in any form of the exact value, and the whole number next to it (what the
  untrained model tends to write) earns nothing."""
  config, demo = arithmetic_demo_on("decimal_chain_sum")
  assert config.rollout.temperature == 0.7 and demo.rollout.temperature == 1.0
  assert config.rollout.max_new_tokens == demo.rollout.max_new_tokens
  debug = demo_config("debug_decimal_chain_sum")
  assert debug.model.path == "" and debug.model.tokenizer == config.model.path
  assert (debug.data.train, debug.data.eval, debug.rewards, debug.rollout.temperature) == (
      config.data.train, config.data.eval, config.rewards, config.rollout.temperature)
  reward_fn = RewardFunction(config.rewards)
  source = tasks.build_source(config.data.eval, field="data.eval")
  examples = [source.example(i) for i in range(12)]
  answers = set()
  for example in examples:
    truth = round(decimal_sum(example.metadata["expression"]), 1)
    assert float(example.answer) == truth
    answers.add(example.answer)
    score = functools.partial(correct, reward_fn, example)
    assert score(f"{example.metadata['expression']} = {example.answer}") == 1.0
    assert score(f"The answer is {truth:.2f}.") == 1.0  # 9.20 is 9.2
    if truth != int(truth):
      assert score(f"The answer is {int(truth)}.") == 0.0  # the whole part alone
    assert score(f"The answer is {round(truth + 0.1, 1)}.") == 0.0
  assert len(answers) >= 10  # spread out: no constant answer pays
