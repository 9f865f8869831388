"""Sample completions for a file of prompts with the reasoning_rl sampler engine.

Usage:
  python launch/generate.py --checkpoint PATH --prompts_file FILE.jsonl --max_new_tokens N
      [--temperature T] [--top_p P] [--top_k K] [--min_p M] [--num_samples G] [--seed S]
      [--stop TEXT ...]
      [--no_chat_template] [--ignore_eos] [--truncate_prompts] [--batch_prompts B]
      --output OUT.jsonl

PATH is a Hugging Face directory, a .gguf file or a run workdir, local or gs:// (see
`reasoning_rl.models.load`); FILE and OUT may be gs:// too. Each input row holds
"prompt" (text; wrapped in the model's chat template as a user turn unless --no_chat_template) or
"prompt_ids" (token ids, used as they are). Each output row is one completion: prompt, completion,
completion_ids, logprobs (log-softmax of the model's unscaled logits at each generated token), and
prompt_id (input row index), sample_index, finish_reason, truncated, prompt_truncated;
sampling_logprobs is added when temperature / top-p / top-k make the sampling distribution differ
from the model's. Temperature 0 is greedy; --ignore_eos decodes exactly max_new_tokens tokens (stop
strings still apply). A NaN or infinite number is written as JSON null.

Bounds: a prompt plus its completion must fit the model's context (`max_position_embeddings`), so a
prompt longer than context - max_new_tokens is refused, or left-truncated (its first tokens dropped)
with --truncate_prompts. Prompts run in batches of --batch_prompts; each batch's completions are
appended to OUT.jsonl.partial before the next batch starts, and the file is renamed to OUT.jsonl at
the end (after a failure, the .partial file holds the batches that finished). Device memory is then
at most the weights, plus the KV cache of min(max_concurrent_decodes, batch_prompts * G) slots of at
most `max_position_embeddings` tokens each, plus one prefill of up to 8 prompts of the longest
prompt's length; host memory holds one batch's completions. --output's directory is checked before
the model is loaded. Exit codes: 0 done, 2 bad input (one line naming it), 4 the output could not be
written.

Several processes (hosts) split each batch's prompts: run the same command on each, with
--coordinator_address=HOST:PORT --num_processes=N --process_id=I where JAX does not detect the
cluster itself. Each generates for every N-th prompt on its own devices; process 0 writes the rows,
identical to a single process's (a sample's randomness depends on (seed, prompt, sample) only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
from collections.abc import Iterator

from reasoning_rl.errors import ExitCode, ReasoningRLError, SamplingError, StorageTimeout

DEFAULT_BATCH_PROMPTS = 64
MAX_TOKEN_ID = 2**31  # token ids are int32 on the device


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
  parser.add_argument("--min_p", type=float, default=0.0,
                      help="keep tokens with p >= min_p * p_max after temperature; 0 = off")
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
  parser.add_argument("--max_concurrent_decodes", type=int, default=DEFAULT_BATCH_PROMPTS,
                      help="decode slots (continuous batching refills them); the default decodes "
                      "a whole default batch at once (fewer slots: less KV-cache memory, and "
                      "on a 2-core CPU 16 slots decode SmolLM2 at half the speed of 64)")
  parser.add_argument("--steps_per_call", type=int, default=16,
                      help="decode steps per device round trip")
  parser.add_argument("--truncate_prompts", action="store_true",
                      help="left-truncate prompts that do not fit the model's context with "
                      "max_new_tokens, instead of refusing them")
  parser.add_argument("--batch_prompts", type=int, default=DEFAULT_BATCH_PROMPTS,
                      help="prompts per batch; each batch is written before the next starts")
  from reasoning_rl.multihost.runtime import add_argparse_flags

  add_argparse_flags(parser)  # several processes split each batch (docs/multihost.md)
  return parser.parse_args(argv)


def read_prompt_rows(path: str | pathlib.Path) -> list[dict]:
  """The rows of a JSONL prompts file; each must hold 'prompt' (str) or 'prompt_ids' (ints)."""
  from reasoning_rl import storage

  path = storage.path(path)
  if not path.is_file():
    raise SamplingError(f"--prompts_file {path}: no such file")
  try:
    text = path.read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError) as error:
    raise SamplingError(f"--prompts_file {path}: cannot be read as UTF-8 text ({error})") from None
  rows = []
  for number, line in enumerate(text.splitlines(), start=1):
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
      if any(not 0 <= i < MAX_TOKEN_ID for i in ids):
        bad = next(i for i in ids if not 0 <= i < MAX_TOKEN_ID)
        raise SamplingError(f"{path}:{number}: 'prompt_ids' holds {bad}; token ids are integers "
                            f"from 0 to {MAX_TOKEN_ID - 1} (and below the model's vocabulary size)")
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


def fit_to_context(prompts: list[list[int]], context: int, max_new_tokens: int, *,
                   truncate: bool) -> tuple[list[list[int]], list[bool]]:
  """Prompts that leave room for `max_new_tokens` in a `context`-token window, and which of them
  were left-truncated. Without `truncate` an over-long prompt is a SamplingError."""
  if max_new_tokens >= context:
    raise SamplingError(f"--max_new_tokens={max_new_tokens}: must be below the model's context of "
                        f"{context} tokens (max_position_embeddings)")
  limit = context - max_new_tokens
  too_long = [index for index, prompt in enumerate(prompts) if len(prompt) > limit]
  if too_long and not truncate:
    first = too_long[0]
    raise SamplingError(
        f"prompt_id {first}: {len(prompts[first])} tokens, more than the {limit} that the model's "
        f"context of {context} leaves with --max_new_tokens={max_new_tokens} ({len(too_long)} "
        "prompts in all); shorten them or pass --truncate_prompts")
  return [prompt[-limit:] for prompt in prompts], [len(prompt) > limit for prompt in prompts]


def generate_batches(model, tokenizer, rows: list[dict], *, max_new_tokens: int,
                     temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                     min_p: float = 0.0, num_samples: int = 1, seed: int = 0,
                     stop: tuple[str, ...] = (),
                     chat_template: bool = True, ignore_eos: bool = False,
                     max_concurrent_decodes: int = DEFAULT_BATCH_PROMPTS,
                     steps_per_call: int = 16,
                     truncate_prompts: bool = False,
                     batch_prompts: int = DEFAULT_BATCH_PROMPTS, mesh=None,
                     share=None) -> Iterator[list[dict]]:
  """Samples `num_samples` completions per row, yielding the output rows batch by batch.

  `mesh` places the engine (default: the default device). With `share` (a
  `multihost.data_parallel.Share`), this process generates for its share of each batch's prompts
  and every process yields the whole batch's rows, merged through the run's exchange.

  Every prompt is encoded and checked before the first batch decodes, so bad input fails before
  any output. Sample g of prompt p is keyed by (seed, p, g) whatever the batch size.
  """
  from reasoning_rl.build import build_sized_engine
  from reasoning_rl.sampler import SamplingParams, generate_groups

  if max_new_tokens < 1:
    raise SamplingError(f"--max_new_tokens={max_new_tokens}: must be >= 1")
  if batch_prompts < 1:
    raise SamplingError(f"--batch_prompts={batch_prompts}: must be >= 1")
  if not -2**63 <= seed < 2**63:  # jax.random.key takes a C long
    raise SamplingError(f"--seed={seed}: must be a signed 64-bit integer (|seed| < 2^63)")
  sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
  encoded = [encode_prompt(row, tokenizer, chat_template=chat_template) for row in rows]
  prompts, truncated = fit_to_context(encoded, model.config.max_position_embeddings,
                                      max_new_tokens, truncate=truncate_prompts)
  engine = build_sized_engine(
      model, longest_prompt=max(len(p) for p in prompts), max_new_tokens=max_new_tokens,
      num_sequences=min(batch_prompts, len(prompts)) * num_samples,
      max_concurrent_decodes=max_concurrent_decodes, steps_per_call=steps_per_call, mesh=mesh)
  for index, prompt in enumerate(prompts):
    try:
      engine.prepare_prompt(prompt)  # empty prompts, ids outside the vocabulary
    except SamplingError as error:
      raise SamplingError(f"prompt_id {index}: {error}") from None
  for start in range(0, len(prompts), batch_prompts):
    prompt_ids = list(range(start, min(start + batch_prompts, len(prompts))))
    if share is not None:
      prompt_ids = share.mine(prompt_ids)
    completions = generate_groups(
        engine, [prompts[i] for i in prompt_ids], prompt_ids=prompt_ids, num_samples=num_samples,
        sampling=sampling, max_new_tokens=max_new_tokens,
        stop_ids=() if ignore_eos else tokenizer.eos_ids, stop_strings=stop, tokenizer=tokenizer,
        seed=seed)
    batch = [_output_row(rows, truncated, completion, tokenizer) for completion in completions]
    if share is not None and share.count > 1:
      by_prompt: dict[int, list[dict]] = {}
      for row in batch:
        by_prompt.setdefault(row["prompt_id"], []).append(_finite_or_null(row))
      batch = [row for part in share.merge(f"generate/{start}", by_prompt).values() for row in part]
    yield batch


def _output_row(rows: list[dict], truncated: list[bool], completion, tokenizer) -> dict:
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
      "prompt_truncated": truncated[completion.prompt_id],
  }
  if completion.sampling_logprobs is not None:
    record["sampling_logprobs"] = completion.sampling_logprobs
  return record


def generate_rows(model, tokenizer, rows: list[dict], **kwargs) -> list[dict]:
  """All output rows of `generate_batches` (prompt-major order)."""
  return [record for batch in generate_batches(model, tokenizer, rows, **kwargs)
          for record in batch]


def _finite_or_null(value):
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, list):
    return [_finite_or_null(v) for v in value]
  if isinstance(value, dict):
    return {k: _finite_or_null(v) for k, v in value.items()}
  return value


def json_line(record: dict) -> str:
  """One strict-JSON line; NaN and infinities become null."""
  return json.dumps(_finite_or_null(record), allow_nan=False) + "\n"


def _remove_quietly(path: pathlib.Path) -> None:
  """Removes a partial output nothing was written to; a file system that refuses (read-only) has
  none to remove."""
  try:
    path.unlink(missing_ok=True)
  except OSError:
    pass


def main(argv=None) -> int:
  args = parse_args(argv)
  from reasoning_rl import storage
  from reasoning_rl.multihost import data_parallel, runtime

  remote = storage.is_remote(args.output)
  # a gs:// output is written locally first and uploaded in one piece at the end
  partial = (pathlib.Path(tempfile.mkdtemp(prefix="generate-")) / "out.jsonl.partial" if remote
             else pathlib.Path(args.output + ".partial"))
  written = 0
  try:
    from reasoning_rl.workdir import check_output_file_writable

    from reasoning_rl import compile_cache

    compile_cache.enable()  # the next run reuses compiled programs (REASONING_RL_COMPILATION_CACHE)
    runtime.initialize(runtime.process_flags(args))
    share = data_parallel.current_share()
    output = args.output if remote else check_output_file_writable(args.output)
    if args.batch_prompts < 1:
      raise SamplingError(f"--batch_prompts={args.batch_prompts}: must be >= 1")
    rows = read_prompt_rows(args.prompts_file)
    from reasoning_rl.build import load_checkpoint

    mesh = data_parallel.local_mesh()
    model, tokenizer = load_checkpoint(args.checkpoint, dtype=args.dtype, mesh=mesh)
    batches = generate_batches(
        model, tokenizer, rows, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        num_samples=args.num_samples, seed=args.seed, stop=tuple(args.stop),
        chat_template=not args.no_chat_template, ignore_eos=args.ignore_eos,
        max_concurrent_decodes=args.max_concurrent_decodes, steps_per_call=args.steps_per_call,
        truncate_prompts=args.truncate_prompts, batch_prompts=args.batch_prompts, mesh=mesh,
        share=share)
    if not share.is_primary:  # process 0 writes what every process generated
      for batch in batches:
        written += len(batch)
      runtime.finish()
      return 0
    handle = None
    try:
      for batch in batches:  # the first batch checks every prompt: no file before it is out
        if handle is None:
          handle = open(partial, "w", encoding="utf-8")
        handle.writelines(json_line(record) for record in batch)
        handle.flush()
        written += len(batch)
    finally:
      if handle is not None:
        handle.close()
    if remote:  # read_prompt_rows refuses a file without prompts: there was a batch
      storage.atomic_write(output, partial.read_bytes())
    else:
      os.replace(partial, output)
    runtime.finish()
  except ReasoningRLError as error:
    if not written:
      _remove_quietly(partial)
    print(f"generate.py: error: {error}", file=sys.stderr)
    # a store that stopped answering is an I/O failure (4), not bad input (2)
    return ExitCode.STORAGE if isinstance(error, StorageTimeout) else ExitCode.BAD_INPUT
  except OSError as error:
    kept = f"{written} completions are in {partial}" if written else "nothing was written"
    if not written:
      _remove_quietly(partial)
    print(f"generate.py: error: {error.filename or args.output}: {error.strerror or error}; "
          f"{kept}", file=sys.stderr)
    return ExitCode.STORAGE
  print(f"wrote {written} completions to {output}")
  return 0


if __name__ == "__main__":
  from reasoning_rl.process_gc import configure_launcher_gc

  configure_launcher_gc()  # before main imports JAX: see reasoning_rl/process_gc.py
  sys.exit(main())
