"""Sample completions for a file of prompts with the reasoning_rl sampler engine.

Usage:
  python launch/generate.py --checkpoint PATH --prompts_file FILE.jsonl --max_new_tokens N
      [--temperature T] [--top_p P] [--top_k K] [--num_samples G] [--seed S] [--stop TEXT ...]
      [--no_chat_template] [--ignore_eos] --output OUT.jsonl

PATH is a Hugging Face directory or a .gguf file (see `reasoning_rl.models.load`). Each input row holds
"prompt" (text; wrapped in the model's chat template as a user turn unless --no_chat_template) or
"prompt_ids" (token ids, used as they are). Each output row is one completion: prompt, completion,
completion_ids, logprobs (log-softmax of the model's unscaled logits at each generated token), and
prompt_id (input row index), sample_index, finish_reason, truncated; sampling_logprobs is added when
temperature / top-p / top-k make the sampling distribution differ from the model's. Temperature 0 is
greedy; --ignore_eos decodes exactly max_new_tokens tokens (stop strings still apply).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from reasoning_rl.errors import ReasoningRLError, SamplingError


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True,
                      help="Hugging Face directory or .gguf file of the policy")
  parser.add_argument("--prompts_file", required=True,
                      help="JSONL rows with 'prompt' (text) or 'prompt_ids' (token ids)")
  parser.add_argument("--output", required=True, help="JSONL file written, one row per completion")
  parser.add_argument("--max_new_tokens", type=int, required=True,
                      help="most tokens generated per completion")
  parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1)")
  parser.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1]")
  parser.add_argument("--top_k", type=int, default=0, help="keep the k likeliest tokens; 0 = off")
  parser.add_argument("--num_samples", type=int, default=1, help="completions per prompt (G)")
  parser.add_argument("--seed", type=int, default=0,
                      help="root PRNG seed; sample g of prompt p is keyed by (seed, p, g)")
  parser.add_argument("--stop", action="append", default=[],
                      help="stop string (repeatable), e.g. --stop '</answer>'")
  parser.add_argument("--no_chat_template", action="store_true",
                      help="encode 'prompt' text as is instead of as a chat user turn")
  parser.add_argument("--ignore_eos", action="store_true",
                      help="do not stop at EOS / end-of-turn ids (benchmarks)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="parameter and compute dtype")
  parser.add_argument("--max_concurrent_decodes", type=int, default=16,
                      help="decode slots (continuous batching refills them)")
  parser.add_argument("--steps_per_call", type=int, default=16,
                      help="decode steps per device round trip")
  return parser.parse_args(argv)


def read_prompt_rows(path: str | pathlib.Path) -> list[dict]:
  """The rows of a JSONL prompts file; each must hold 'prompt' (str) or 'prompt_ids' (ints)."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise SamplingError(f"--prompts_file {path}: no such file")
  rows = []
  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as error:
      raise SamplingError(f"{path}:{number}: not valid JSON ({error.msg})") from None
    ids = row.get("prompt_ids") if isinstance(row, dict) else None
    text = row.get("prompt") if isinstance(row, dict) else None
    if ids is not None:
      if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                              for i in ids):
        raise SamplingError(f"{path}:{number}: 'prompt_ids' must be a list of integers")
    elif not isinstance(text, str):
      raise SamplingError(f"{path}:{number}: needs 'prompt' (text) or 'prompt_ids' (token ids)")
    rows.append(row)
  if not rows:
    raise SamplingError(f"{path}: holds no prompts")
  return rows


def encode_prompt(row: dict, tokenizer, *, chat_template: bool) -> list[int]:
  """Token ids of one input row ('prompt_ids' as is; 'prompt' via the chat template or plain)."""
  if row.get("prompt_ids") is not None:
    return list(row["prompt_ids"])
  if chat_template:
    text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}])
    return tokenizer.encode(text, add_special_tokens=False)
  return tokenizer.encode(row["prompt"])


def generate_rows(model, tokenizer, rows: list[dict], *, max_new_tokens: int,
                  temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                  num_samples: int = 1, seed: int = 0, stop: tuple[str, ...] = (),
                  chat_template: bool = True, ignore_eos: bool = False,
                  max_concurrent_decodes: int = 16, steps_per_call: int = 16) -> list[dict]:
  """Samples `num_samples` completions per row; returns the output rows (prompt-major order)."""
  from reasoning_rl.sampler import Engine, SamplingParams, generate_groups
  from reasoning_rl.sampler.engine import prefill_bucket

  sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
  prompts = [encode_prompt(row, tokenizer, chat_template=chat_template) for row in rows]
  longest = max(len(p) for p in prompts)
  if max_new_tokens < 1:
    raise SamplingError(f"--max_new_tokens={max_new_tokens}: must be >= 1")
  engine = Engine(
      model, max_concurrent_decodes=max(1, min(max_concurrent_decodes,
                                               len(prompts) * max(num_samples, 1))),
      max_prefill_length=prefill_bucket(longest, max_prefill_length=1 << 30),
      max_decode_length=max_new_tokens, steps_per_call=min(steps_per_call, max_new_tokens))
  completions = generate_groups(
      engine, prompts, num_samples=num_samples, sampling=sampling, max_new_tokens=max_new_tokens,
      stop_ids=() if ignore_eos else tokenizer.eos_ids, stop_strings=stop, tokenizer=tokenizer,
      seed=seed)
  out = []
  for completion in completions:
    row = rows[completion.prompt_id]
    prompt_text = row.get("prompt")
    if prompt_text is None:
      prompt_text = tokenizer.decode(completion.prompt_tokens)
    record = {
        "prompt_id": completion.prompt_id,
        "sample_index": completion.sample_index,
        "prompt": prompt_text,
        "completion": tokenizer.decode(completion.completion_ids, skip_special_tokens=True),
        "completion_ids": completion.completion_ids,
        "logprobs": completion.logprobs,
        "finish_reason": completion.finish_reason,
        "truncated": completion.truncated,
    }
    if completion.sampling_logprobs is not None:
      record["sampling_logprobs"] = completion.sampling_logprobs
    out.append(record)
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    from reasoning_rl.models import load

    rows = read_prompt_rows(args.prompts_file)
    model, tokenizer = load(args.checkpoint, dtype=args.dtype)
    if tokenizer is None:
      raise SamplingError(f"--checkpoint {args.checkpoint}: has no tokenizer files")
    out = generate_rows(
        model, tokenizer, rows, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        num_samples=args.num_samples, seed=args.seed, stop=tuple(args.stop),
        chat_template=not args.no_chat_template, ignore_eos=args.ignore_eos,
        max_concurrent_decodes=args.max_concurrent_decodes, steps_per_call=args.steps_per_call)
  except ReasoningRLError as error:
    print(f"generate.py: error: {error}", file=sys.stderr)
    return 2
  with open(args.output, "w", encoding="utf-8") as f:
    for record in out:
      f.write(json.dumps(record) + "\n")
  print(f"wrote {len(out)} completions to {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
