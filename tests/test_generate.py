"""launch/generate.py end to end on tiny random Qwen2 / Llama checkpoints written by transformers.

Reference: transformers' greedy `generate` on each prompt alone, and torch's log_softmax of its raw
logits.
"""

import pytest

from tests.hf_reference import write_tiny_model
from tests.support.generation import assert_greedy_matches_transformers, run, write_word_tokenizer


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def checkpoint(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  torch_model = write_tiny_model(request.param, directory, seed=3)
  write_word_tokenizer(directory)
  return directory, torch_model


def test_greedy_matches_transformers_generate(tmp_path, checkpoint):
  assert_greedy_matches_transformers(tmp_path, *checkpoint)


def test_text_prompts_groups_and_stop_strings(tmp_path, checkpoint):
  directory, _ = checkpoint
  code, out = run(tmp_path, directory, [{"prompt": "t1 t2 t3"}, {"prompt": "t9"}],
                  "--no_chat_template", "--num_samples", "3", "--max_new_tokens", "6",
                  "--seed", "5")
  assert code == 0
  assert [(r["prompt_id"], r["sample_index"]) for r in out] == [(p, g) for p in (0, 1)
                                                                   for g in range(3)]
  assert out[0]["prompt"] == "t1 t2 t3"
  for row in out:
    assert len(row["completion_ids"]) == len(row["logprobs"]) == 6
    assert "sampling_logprobs" not in row  # temperature 1: the model's own distribution
    assert all(lp <= 0 for lp in row["logprobs"])
  # A stop string taken from a completion cuts that completion right after it.
  first = out[0]["completion_ids"]
  stop = f"t{first[1]} t{first[2]}"
  code, cut = run(tmp_path, directory, [{"prompt": "t1 t2 t3"}], "--no_chat_template",
                  "--num_samples", "3", "--max_new_tokens", "6", "--seed", "5", "--stop", stop)
  assert code == 0
  assert cut[0]["completion_ids"] == first[:3]
  assert cut[0]["finish_reason"] == "stop_string"


@pytest.mark.parametrize("rows, flags, message", [
    ([{"prompt_ids": []}], [], "empty"),
    ([{"prompt_ids": [1, 2]}], ["--temperature", "-1"], "temperature"),
    ([{"prompt_ids": [1, 2]}], ["--top_p", "0"], "top_p"),
    ([{"text": "no prompt field"}], [], "'prompt'"),
    ([{"prompt": "t1"}], [], "chat template"),  # the tiny tokenizer has none
])
def test_bad_input_is_one_clear_error(tmp_path, checkpoint, capsys, rows, flags, message):
  directory, _ = checkpoint
  code, _ = run(tmp_path, directory, rows, "--max_new_tokens", "4", *flags)
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_unknown_checkpoint_is_one_clear_error(tmp_path, capsys):
  not_a_model = tmp_path / "weights.bin"
  not_a_model.write_bytes(b"\0")
  code, _ = run(tmp_path, not_a_model, [{"prompt_ids": [1]}], "--max_new_tokens", "4")
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1 and "weights.bin" in err, err
