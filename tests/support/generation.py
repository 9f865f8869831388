"""launch/generate.py driven as users run it, a word tokenizer for tiny checkpoints, and a tiny HF
reward model with its reference scores. (From test_generate.py, test_reward_model.py.)"""

import importlib.util
import json
import pathlib

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import models, pre_tokenizers

from tests.hf_reference import FAMILIES


ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository


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


# family -> (num_labels, pad_token_id)
HEADS = {"llama": (1, 0), "qwen2": (2, 5)}


def write_reward_model(family: str, directory: pathlib.Path, seed: int = 0):
  """A perturbed random `<Family>ForSequenceClassification` saved with save_pretrained."""
  num_labels, pad = HEADS[family]
  config = FAMILIES[family]()
  config.num_labels = num_labels
  config.pad_token_id = pad
  torch.manual_seed(seed)
  model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
  model.save_pretrained(directory)
  write_word_tokenizer(directory)
  return model


def reference_scores(torch_model, rows, pad):
  """transformers' scores of `rows` as one right-padded batch (pad id `pad`, mask by length)."""
  length = max(map(len, rows))
  ids = torch.full((len(rows), length), pad, dtype=torch.long)
  mask = torch.zeros((len(rows), length), dtype=torch.long)
  for b, row in enumerate(rows):
    ids[b, :len(row)] = torch.tensor(row)
    mask[b, :len(row)] = 1
  with torch.no_grad():
    return torch_model(input_ids=ids, attention_mask=mask).logits.float().numpy()
