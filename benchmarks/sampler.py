"""Decode throughput of the sampler engine beside transformers' `generate`, in the same run.

Usage: python -m benchmarks.sampler [--models tiny_qwen2,smollm2] [--batches 1,16,64]
           [--prompt_length 64] [--new_tokens 128] [--steps_per_call 32] [--no_transformers]
           [--before_rev REV]

For each model and batch size B: B prompts of `prompt_length` random tokens, greedy, exactly
`new_tokens` new tokens each (no EOS stop), float32.
- reasoning_rl: B decode slots. "decode tok/s" times only `generate` calls (prefill and insert
  excluded); "end-to-end tok/s" includes the B prefills and inserts. Compiled before timing.
- transformers: `model.generate(B × prompt_length, max_new_tokens=min_new_tokens=new_tokens)`,
  end to end (its prefill is one batched forward, a small share of the time).
- with --before_rev: the engine as of that git revision (`benchmarks.rollouts.load_before`) on the
  same prompts, in the same run, for a before / after table.
Achieved rates use the FLOPs per decoded token of `reasoning_rl.flops` (matmul weights, output
projection, attention over the average context) and bytes per decode step (all weights once,
plus the KV cache the step reads), against this machine's ~400 GFLOP/s f32 matmul peak and ~60 GB/s
memory bandwidth (measured on the development machine, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from benchmarks.installed import smollm2_gguf
from reasoning_rl.flops import forward_flops

PEAK_FLOPS = 400e9
PEAK_BYTES = 60e9


def load_models(name: str):
  """(our model, transformers model) holding the same weights."""
  import torch
  import transformers

  if name == "smollm2":
    from reasoning_rl.models import load

    path = smollm2_gguf()
    ours, _ = load(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return ours, theirs.eval()
  if name == "tiny_qwen2":
    from reasoning_rl.models.checkpoints import load_hf_weights

    config = transformers.Qwen2Config(
        vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    with tempfile.TemporaryDirectory() as directory:
      theirs.save_pretrained(directory)
      ours, _ = load_hf_weights(directory)
    return ours, theirs
  raise SystemExit(f"--models: unknown model {name!r}; use tiny_qwen2 or smollm2")


def bytes_per_step(config, batch: int, cache_length: int) -> float:
  weights = 4 * config.num_params()
  kv_cache = 4 * 2 * batch * cache_length * config.num_kv_heads * config.head_dim * \
      config.num_layers
  return weights + kv_cache


def run_ours(model, prompts: np.ndarray, new_tokens: int, steps_per_call: int, engine_class=None,
             prefill_batch: int | None = None):
  """(decode seconds, end-to-end seconds) of one greedy run; tokens checked for count.
  `engine_class`: another revision's Engine (default: this tree's). `prefill_batch`: None
  prefills prompt by prompt (`Engine.prefill`, the JetStream call); k prefills them k at a time
  in one call each (`Engine.prefill_many` with `max_prefill_batch=k`, as rollouts do with 8)."""
  from reasoning_rl.sampler import Engine, SamplingParams, sample_key

  Engine = engine_class or Engine
  batch, prompt_length = prompts.shape
  batched = {} if prefill_batch is None else {"max_prefill_batch": prefill_batch}
  engine = Engine(model, max_concurrent_decodes=batch, max_prefill_length=prompt_length,
                  max_decode_length=new_tokens, steps_per_call=steps_per_call, **batched)

  def once():
    start = time.perf_counter()
    state = engine.init_decode_state()
    requests = [engine.make_request(key=sample_key(0, slot, 0),
                                    sampling=SamplingParams(temperature=0.0),
                                    max_new_tokens=new_tokens) for slot in range(batch)]
    prepared = [engine.prepare_prompt(prompt) for prompt in prompts]
    if prefill_batch is None:
      prefixes = [engine.prefill(params=engine.params, padded_tokens=padded, true_length=length,
                                 request=request)[0]
                  for (padded, length), request in zip(prepared, requests)]
    else:
      prefixes = engine.prefill_many(params=engine.params,
                                     padded_tokens=[padded for padded, _ in prepared],
                                     true_lengths=[length for _, length in prepared],
                                     requests=requests)
    if prefill_batch is None:  # the JetStream calls: one insert per prompt
      for slot, prefix in enumerate(prefixes):
        state = engine.insert(prefix, state, slot)
    else:  # as rollouts place slots: one call per bucket
      state = engine.insert_many(prefixes, state, range(batch))
    state.done.block_until_ready()
    decode_start = time.perf_counter()
    produced = 0
    while True:
      state, result = engine.generate(engine.params, state)
      result = result.to_host()
      produced += int(result.valid.sum())
      if result.done.all():
        break
    end = time.perf_counter()
    assert produced == batch * new_tokens, produced
    return end - decode_start, end - start

  once()  # compile
  return once()


def run_transformers(model, prompts: np.ndarray, new_tokens: int) -> float:
  import torch

  ids = torch.tensor(prompts)
  with torch.inference_mode():
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
  assert out.shape == (len(prompts), prompts.shape[1] + new_tokens)
  return seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="tiny_qwen2,smollm2")
  parser.add_argument("--batches", default="1,16,64")
  parser.add_argument("--prompt_length", type=int, default=64)
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--steps_per_call", type=int, default=32)
  parser.add_argument("--no_transformers", action="store_true")
  parser.add_argument("--before_rev", default=None,
                      help="also time the engine of this git revision (before / after)")
  args = parser.parse_args()
  before_engine = None
  if args.before_rev:
    from benchmarks.rollouts import load_before

    before_engine, _ = load_before(args.before_rev)

  import torch
  import transformers

  print(f"torch {torch.__version__} threads={torch.get_num_threads()}, "
        f"transformers {transformers.__version__}; prompts {args.prompt_length} tokens, "
        f"{args.new_tokens} new tokens, greedy, float32")
  before = f"decode tok/s at {args.before_rev[:7]} | " if before_engine else ""
  print(f"| model | batch | {before}ours decode tok/s | ours end-to-end tok/s | "
        "transformers tok/s | speed-up (e2e) | ours GFLOP/s (% peak) | ours GB/s (% bw) |")
  print("|---|---|---|---|---|---|---|---|" + ("---|" if before_engine else ""))
  for name in args.models.split(","):
    ours, theirs = load_models(name)
    config = ours.config
    for batch in (int(b) for b in args.batches.split(",")):
      prompts = np.random.RandomState(batch).randint(
          0, config.vocab_size, (batch, args.prompt_length)).astype(np.int32)
      tokens = batch * args.new_tokens
      before = ""
      if before_engine:
        before_s, _ = run_ours(ours, prompts, args.new_tokens, args.steps_per_call,
                               before_engine)
        before = f"{tokens / before_s:,.0f} | "
      decode_s, total_s = run_ours(ours, prompts, args.new_tokens, args.steps_per_call)
      decode_rate = tokens / decode_s
      context = args.prompt_length + args.new_tokens / 2
      flops = forward_flops(config, 1, context) * decode_rate
      step_bytes = bytes_per_step(config, batch, args.prompt_length + args.new_tokens)
      bandwidth = step_bytes * args.new_tokens / decode_s
      if args.no_transformers:
        theirs_rate, speedup = float("nan"), float("nan")
      else:
        theirs_rate = tokens / run_transformers(theirs, prompts, args.new_tokens)
        speedup = (tokens / total_s) / theirs_rate
      print(f"| {name} | {batch} | {before}{decode_rate:,.0f} | {tokens / total_s:,.0f} | "
            f"{theirs_rate:,.0f} | {speedup:.1f}x | {flops / 1e9:.0f} "
            f"({100 * flops / PEAK_FLOPS:.0f} %) | {bandwidth / 1e9:.1f} "
            f"({100 * bandwidth / PEAK_BYTES:.0f} %) |", flush=True)


if __name__ == "__main__":
  main()
