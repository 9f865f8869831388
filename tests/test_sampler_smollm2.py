"""The sampler on the real SmolLM2-135M GGUF: greedy parity with transformers' `generate`, and
sampler/trainer log-prob parity with `completion_logprobs`.

Completions come from `launch/generate.py`'s `generate_rows` (the CLI's code path minus loading, so
the session's model fixture is reused instead of dequantising the GGUF again).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from reasoning_rl.rl.logprobs import completion_logprobs
from tests.support.generation import generate


QUESTIONS = ["What is 17 + 25?", "Name a colour.",
             "Write one sentence about the sea, and explain why it is blue in a few words."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def greedy_rows(smollm2):
  model, tokenizer = smollm2
  rows = [{"prompt": q} for q in QUESTIONS]
  return generate.generate_rows(
      model, tokenizer, rows, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
      max_concurrent_decodes=3)


def prompt_ids(tokenizer, question):
  text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
  return tokenizer.encode(text, add_special_tokens=False)


def test_greedy_matches_transformers(smollm2, smollm2_torch, greedy_rows):
  _, tokenizer = smollm2
  lengths = {len(prompt_ids(tokenizer, q)) for q in QUESTIONS}
  assert len(lengths) == len(QUESTIONS)  # prompts of different lengths share the batch
  smollm2_torch.generation_config.eos_token_id = None
  for row, question in zip(greedy_rows, QUESTIONS):
    ids = prompt_ids(tokenizer, question)
    with torch.no_grad():
      ref = smollm2_torch.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                   do_sample=False, output_logits=True,
                                   return_dict_in_generate=True, pad_token_id=0)
    ref_ids = ref.sequences[0, len(ids):].tolist()
    assert row["completion_ids"] == ref_ids, (tokenizer.decode(row["completion_ids"]),
                                              tokenizer.decode(ref_ids))
    ref_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(ref.logits, ref_ids)]
    np.testing.assert_allclose(row["logprobs"], ref_logprobs, atol=1e-3)


def test_logprobs_equal_the_training_forward(smollm2, greedy_rows):
  model, tokenizer = smollm2
  prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS]
  width = max(len(p) for p in prompts)
  tokens = np.zeros((len(prompts), width + NEW_TOKENS), np.int32)
  mask = np.zeros_like(tokens)
  for i, (prompt, row) in enumerate(zip(prompts, greedy_rows)):
    tokens[i, width - len(prompt):] = prompt + row["completion_ids"]
    mask[i, width - len(prompt):] = 1
  trainer, _ = completion_logprobs(model, jnp.asarray(tokens), jnp.asarray(mask), NEW_TOKENS)
  np.testing.assert_allclose(np.array([r["logprobs"] for r in greedy_rows]), trainer, atol=1e-4)
