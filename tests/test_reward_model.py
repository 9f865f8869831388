"""Reward models: transformers' *ForSequenceClassification checkpoints loaded and scored by
reasoning_rl.models.reward_model, checked against transformers on the same right-padded batches."""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from flax import nnx

from reasoning_rl import sharding
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.reward_model import RewardModel
from tests.hf_reference import write_tiny_model
from tests.support.generation import HEADS, reference_scores, write_reward_model


TOLERANCE = 1e-4  # as the policy models' parity (tests/test_checkpoints.py)


@pytest.fixture(scope="module", params=sorted(HEADS))
def checkpoint(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(f"rm_{request.param}")
  torch_model = write_reward_model(request.param, directory)
  return request.param, directory, torch_model


def test_scores_match_transformers_on_right_padded_batch(checkpoint):
  family, directory, torch_model = checkpoint
  num_labels, pad = HEADS[family]
  rng = np.random.default_rng(1)
  rows = [rng.integers(6, 97, size=n).tolist() for n in (5, 11, 3, 17, 8)]
  rows[1][4] = pad  # a pad id inside a row is attended and not pooled by
  rows[2] = rows[2] + [pad, pad]  # a row ending in pad ids is pooled before them (transformers)
  reward_model = RewardModel.load(directory)
  assert reward_model.num_labels == num_labels and reward_model.pad_token_id == pad
  ours = reward_model.score_tokens(rows)
  ref = reference_scores(torch_model, rows, pad)
  assert ours.shape == ref.shape == (len(rows), num_labels)
  diff = float(np.max(np.abs(ours - ref)))
  print(f"{family}: max |ours - transformers| = {diff:.2e}")
  assert diff <= TOLERANCE
  assert np.std(ref[:, 0]) > 1e-2  # the rows score differently: the check can fail
  # Causal attention: the trailing pad ids change nothing, the pooled token is the same.
  np.testing.assert_allclose(ours[2], reward_model.score_tokens([rows[2][:3]])[0], atol=1e-5)
  # Chunked into batches of 2 rows: the same scores.
  reward_model.max_batch = 2
  np.testing.assert_allclose(reward_model.score_tokens(rows), ours, atol=1e-5)


def test_score_texts_plain_and_chat_template(checkpoint, tmp_path):
  family, directory, torch_model = checkpoint
  if family != "llama":
    pytest.skip("the template rule is family-independent; checked once")
  _, pad = HEADS[family]
  reward_model = RewardModel.load(directory)
  # No chat template: the concatenation prompt + response, tokenized as one text.
  assert reward_model.encode_pair("t7 t8 ", "t9 t10") == [7, 8, 9, 10]
  texts = reward_model.score_texts(["t7 t8 ", "t20 "], ["t9 t10", "t21 t22 t23"])
  ref = reference_scores(torch_model, [[7, 8, 9, 10], [20, 21, 22, 23]], pad)[:, 0]
  assert max(abs(a - b) for a, b in zip(texts, ref)) <= TOLERANCE
  # With a chat template: user / assistant messages rendered, no generation prompt.
  templated = tmp_path / "templated"
  shutil.copytree(directory, templated)
  (templated / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
      "{% for m in messages %}{{ 't90 ' if m['role'] == 'user' else 't91 ' }}{{ m['content'] }} "
      "{% endfor %}{% if add_generation_prompt %}t92{% endif %}")}))
  chat_model = RewardModel.load(templated)
  assert chat_model.encode_pair("t7 t8", "t9") == [90, 7, 8, 91, 9]
  (score,) = chat_model.score_texts(["t7 t8"], ["t9"])
  assert abs(score - reference_scores(torch_model, [[90, 7, 8, 91, 9]], pad)[0, 0]) <= TOLERANCE


def _edit_config(directory: pathlib.Path, **fields):
  path = directory / "config.json"
  config = json.loads(path.read_text())
  config.update(fields)
  path.write_text(json.dumps(config))


def test_wrong_architecture_is_refused(tmp_path):
  write_tiny_model("llama", tmp_path)  # a LlamaForCausalLM: no score head
  with pytest.raises(ConfigError, match=r"architectures \['LlamaForCausalLM'\].*"
                                        "LlamaForSequenceClassification"):
    RewardModel.load(tmp_path)


def test_missing_score_head_and_num_labels_mismatch(checkpoint, tmp_path):
  family, directory, _ = checkpoint
  if family != "qwen2":
    pytest.skip("checked on one family")
  headless = tmp_path / "headless"
  shutil.copytree(directory, headless)
  tensors = load_file(str(headless / "model.safetensors"))
  del tensors["score.weight"]
  save_file(tensors, str(headless / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ConfigError, match="'score.weight'.*missing"):
    RewardModel.load(headless)

  mislabelled = tmp_path / "mislabelled"
  shutil.copytree(directory, mislabelled)
  _edit_config(mislabelled, id2label={"0": "a", "1": "b", "2": "c"},
               label2id={"a": 0, "b": 1, "c": 2})
  with pytest.raises(ConfigError, match="num_labels is 3 .* 2 rows; set num_labels"):
    RewardModel.load(mislabelled)

  renamed = tmp_path / "renamed"
  shutil.copytree(directory, renamed)
  _edit_config(renamed, architectures=["LlamaForSequenceClassification"])
  with pytest.raises(ConfigError, match="model_type is 'qwen2'"):
    RewardModel.load(renamed)


def test_no_pad_token_scores_one_row_and_refuses_a_batch(checkpoint, tmp_path):
  family, directory, torch_model = checkpoint
  if family != "llama":
    pytest.skip("checked on one family")
  unpadded = tmp_path / "unpadded"
  shutil.copytree(directory, unpadded)
  _edit_config(unpadded, pad_token_id=None)
  reward_model = RewardModel.load(unpadded)
  row = [11, 0, 12, 0]  # without a pad id the last token is pooled, whatever it is
  torch_model.config.pad_token_id = None
  try:
    with torch.no_grad():
      ref = torch_model(input_ids=torch.tensor([row])).logits.float().numpy()
  finally:
    torch_model.config.pad_token_id = HEADS[family][1]
  assert np.max(np.abs(reward_model.score_tokens([row]) - ref)) <= TOLERANCE
  with pytest.raises(ConfigError, match="pad_token_id is not set.*set pad_token_id in config.json"):
    reward_model.score_tokens([row, row])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    reward_model.score_tokens([[97]])
  with pytest.raises(ValueError, match="row 0 is empty"):
    reward_model.score_tokens([[]])


def test_sharded_on_a_device_slice(checkpoint):
  # Loaded onto a mesh over the last 4 of the 8 test devices (a sampler's slice of the chips):
  # the parameters live there only, and the scores are those of the unsharded model.
  family, directory, torch_model = checkpoint
  if family != "qwen2":
    pytest.skip("checked on one family")
  devices = jax.devices()[4:8]
  mesh = sharding.make_mesh((1, 2, 2), devices)
  reward_model = RewardModel.load(directory, mesh=mesh)
  placed = {d for leaf in jax.tree.leaves(nnx.state(reward_model.model)) for d in leaf.devices()}
  assert placed == set(devices)
  rows = [[7, 8, 9], [10, 11, 12, 13, 14, 15]]
  ref = reference_scores(torch_model, rows, HEADS[family][1])
  assert np.max(np.abs(reward_model.score_tokens(rows) - ref)) <= TOLERANCE
