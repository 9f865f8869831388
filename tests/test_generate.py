"""launch/generate.py end to end on tiny random Qwen2 / Llama checkpoints written by transformers.

Reference: transformers' greedy `generate` on each prompt alone, and torch's log_softmax of its raw
logits.
"""

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import tokenizers
import torch
from tokenizers import models, pre_tokenizers

from tests.hf_reference import write_tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], list(range(20, 40))]
NEW_TOKENS = 32


def load_generate_module():
  spec = importlib.util.spec_from_file_location("generate", ROOT / "launch" / "generate.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


generate = load_generate_module()


def write_word_tokenizer(directory: pathlib.Path, vocab_size: int = 97):
  """A tokenizer.json whose token i is the word "t{i}" (no special tokens, so no EOS)."""
  tok = tokenizers.Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)},
                                              unk_token="t0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def checkpoint(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  torch_model = write_tiny_model(request.param, directory, seed=3)
  write_word_tokenizer(directory)
  return directory, torch_model


def write_rows(path, rows):
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return str(path)


def run(tmp_path, checkpoint, rows, *flags):
  output = tmp_path / "out.jsonl"
  code = generate.main(["--checkpoint", str(checkpoint), "--prompts_file",
                        write_rows(tmp_path / "prompts.jsonl", rows), "--output", str(output),
                        *flags])
  if code:
    return code, None
  return code, [json.loads(line) for line in output.read_text().splitlines()]


def test_greedy_matches_transformers_generate(tmp_path, checkpoint):
  assert_greedy_matches_transformers(tmp_path, *checkpoint)


def assert_greedy_matches_transformers(tmp_path, directory, torch_model):
  """launch/generate.py's greedy completions of PROMPTS (in 2 slots) are transformers' greedy
  `generate` of each prompt alone, token for token, with its log-probs to 1e-3."""
  code, out = run(tmp_path, directory, [{"prompt_ids": p} for p in PROMPTS],
                  "--temperature", "0", "--max_new_tokens", str(NEW_TOKENS), "--ignore_eos",
                  "--max_concurrent_decodes", "2")
  assert code == 0 and len(out) == len(PROMPTS)
  torch_model.generation_config.eos_token_id = None
  for row, prompt in zip(out, PROMPTS):
    with torch.no_grad():
      ref = torch_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
    ref_ids = ref.sequences[0, len(prompt):].tolist()
    assert row["completion_ids"] == ref_ids
    ref_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(ref.logits, ref_ids)]
    np.testing.assert_allclose(row["logprobs"], ref_logprobs, atol=1e-3)
    assert row["completion"] == " ".join(f"t{i}" for i in ref_ids)
    assert (row["finish_reason"], row["truncated"]) == ("length", True)
    assert "sampling_logprobs" not in row or row["sampling_logprobs"] == [0.0] * NEW_TOKENS


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
