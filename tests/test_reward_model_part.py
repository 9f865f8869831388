"""The `reward_model` reward part: a Hugging Face *ForSequenceClassification checkpoint scores
(prompt, completion) on the main process through workers.model_parts, its values equal to
transformers' scores of the same text, weighted into the total beside the rule-based parts."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from reasoning_rl.data.debug_vocab import debug_arithmetic_tokenizer
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.reward_model import RewardModel
from reasoning_rl.models.tokenizers import Tokenizer
from reasoning_rl.verifiers.rewards import CompletionRecord, RewardFunction
from reasoning_rl.workers.model_parts import with_model_parts
from reasoning_rl.workers.scorer import InlineScorer
from tests.conftest import REPO
from tests.support.generation import reference_scores, write_reward_model
from tests.support.runs import rollouts


RECORDS = [("t5 t6 t7", " t8 t9", "8"), ("t11 t12", " t13", "8"), ("t20", " t21 t22 t23 t24", "3")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("rm_llama")
  return directory, write_reward_model("llama", directory, seed=3)


def rewards_config(directory, **settings):
  return {"correct": {"weight": 1.0, "verifier": "math", "extract": "final_answer"},
          "preference": {"kind": "reward_model", "weight": 0.5, "model": str(directory),
                         **settings}}


def score(reward_fn, group):
  """The ScoredItem of one group."""
  scorer = with_model_parts(InlineScorer(reward_fn))
  try:
    return scorer.score([("group", group)])["group"]
  finally:
    scorer.close()


def records():
  return [CompletionRecord(response=response, ground_truth=truth, prompt=prompt, task="math")
          for prompt, response, truth in RECORDS]


def transformers_scores(torch_model, directory):
  tokenizer = Tokenizer.from_hf_dir(directory)
  rows = [tokenizer.encode(prompt + response) for prompt, response, _ in RECORDS]
  return reference_scores(torch_model, rows, pad=0)[:, 0]


def test_values_are_transformers_scores_weighted_into_the_total(checkpoint):
  directory, torch_model = checkpoint
  reward_fn = RewardFunction(rewards_config(directory))
  assert [p.name for p in reward_fn.model_parts] == ["preference"]
  assert "preference=reward_model-1:" in reward_fn.verifier_version
  item = score(reward_fn, records())
  assert item.status == "ok", item.error
  rewards = item.rewards
  want = transformers_scores(torch_model, directory)
  got = np.array([r.parts["preference"] for r in rewards])
  np.testing.assert_allclose(got, want, atol=1e-4)
  assert len(set(np.round(got, 4))) == 3  # three different texts, three different scores
  for reward in rewards:
    assert reward.parts["correct"] == 0.0  # no stated answer in "t8 t9"
    assert reward.total == pytest.approx(reward.parts["correct"] + 0.5 * reward.parts["preference"])


def test_sigmoid_transform_and_truncation_to_the_last_tokens(checkpoint):
  directory, torch_model = checkpoint
  raw = transformers_scores(torch_model, directory)
  reward_fn = RewardFunction(rewards_config(directory, transform="sigmoid"))
  got = [r.parts["preference"] for r in score(reward_fn, records()).rewards]
  np.testing.assert_allclose(got, [1 / (1 + math.exp(-x)) for x in raw], atol=1e-5)
  # max_tokens=2 scores each text's last two tokens only: "t8 t9", "t12 t13", "t23 t24"
  short = RewardFunction(rewards_config(directory, max_tokens=2))
  got = [r.parts["preference"] for r in score(short, records()).rewards]
  rows = [[8, 9], [12, 13], [23, 24]]
  np.testing.assert_allclose(got, reference_scores(torch_model, rows, pad=0)[:, 0], atol=1e-4)


@pytest.mark.parametrize("settings, message", [
    ({"model": ""}, r"config\.rewards\.preference\.model='': must be the directory of a "
                   r"Hugging Face .* checkpoint \(required\)"),
    ({"transform": "tanh"}, r"config\.rewards\.preference\.transform='tanh'"),
    ({"label": -1}, r"config\.rewards\.preference\.label=-1"),
    ({"dtype": "float16"}, r"config\.rewards\.preference\.dtype='float16'"),
])
def test_bad_settings_are_one_config_error(checkpoint, settings, message):
  directory, _ = checkpoint
  with pytest.raises(ConfigError, match=message):
    RewardFunction(rewards_config(directory, **{"model": str(directory), **settings}))


def test_a_label_the_head_lacks_is_refused_at_load(checkpoint):
  directory, _ = checkpoint
  reward_fn = RewardFunction(rewards_config(directory, label=1))
  with pytest.raises(ConfigError, match=r"label=1: the checkpoint .* has 1 label"):
    with_model_parts(InlineScorer(reward_fn))


def test_a_training_run_logs_the_reward_models_part(tmp_path):
  """configs/debug_cpu.py plus a reward_model part, 2 steps through launch/train.py: the part's
  values reach the records and the step's metrics, scored on the main process."""
  # a reward model that reads the debug task's characters (23 ids < its 97, pad id 0 = <pad>)
  directory = tmp_path / "rm"
  write_reward_model("llama", directory, seed=4)
  (directory / "tokenizer.json").unlink()
  debug_arithmetic_tokenizer().save(directory)
  config_file = tmp_path / "with_reward_model.py"
  config_file.write_text(
      "import sys\n"
      f"sys.path.insert(0, {str(REPO)!r})\n"
      "from configs import debug_cpu\n\n"
      "def get_config():\n"
      "  c = debug_cpu.get_config()\n"
      f"  c.rewards.preference = dict(kind='reward_model', weight=0.5, model={str(directory)!r})\n"
      "  return c\n")
  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, str(REPO / "launch" / "train.py"), f"--config={config_file}",
       f"--config.workdir={workdir}", "--config.total_steps=2", "--config.eval.num_examples=4",
       "--config.logging.progress_bar=False"],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  records = rollouts(workdir)
  assert len(records) == 2 * 4 * 4
  values = [r["reward/preference"] for r in records]
  assert len(set(values)) > 4  # different completions, different scores
  want = RewardModel.load(directory).score_texts([r["task_prompt"] for r in records],
                                                 [r["completion"] for r in records])
  np.testing.assert_allclose(values, want, atol=1e-4)
  for r in records:
    parts = r["reward/correct"] + r["reward/length"] + 0.5 * r["reward/preference"]
    assert r["reward"] == pytest.approx(parts, abs=1e-5)
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  # cumulative: the 4 held-out completions scored before step 1, then 16 per step
  assert [row["verifier/pool/preference/records"] for row in rows] == [20.0, 36.0]
