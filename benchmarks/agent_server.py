"""The rollout server's cost: the same requests in process, through the server concurrently,
and through it one at a time.

Usage: python -m benchmarks.agent_server [--requests 16] [--max_tokens 48] [--slots 16]
           [--repeats 3]

Compiles: the engine compiles a prefill per (bucket, row count) and a decode call per (rows
decoded, attended length) it meets; concurrent requests arrive in groupings that vary from run
to run, so it meets new ones for a while. `warmup` untimed runs come first (default 8).

Workload: a random Qwen2-shaped model (4 layers, d=256) over the debug character vocabulary with
a ChatML-like template; `requests` single-turn chat requests at temperature 1 that stop only at
their budget (the stop id is not a stop here), so every variant decodes the same number of
tokens. Variants, interleaved, medians of `repeats` timed runs shown:
- in process: `rollout.stream_groups` over the prompts (one sample each), the loop's own path;
- server, concurrent: every request sent at once through the real `openai` client, each its own
  session (what an agent step does: the requests share the decode slots);
- server, one at a time: the same requests awaited one after the other.
tokens/s = completion tokens / wall seconds (HTTP, rendering, prefills and decoding included).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import openai

from reasoning_rl.agents.driver import EngineDriver
from reasoning_rl.agents.server import RolloutServer
from reasoning_rl.data.debug_vocab import debug_arithmetic_tokenizer
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.rollout import stream_groups
from reasoning_rl.sampler.sampling import SamplingParams

TEMPLATE = ("{% for m in messages %}<bos>{{ m.content }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<answer>{% endif %}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--max_tokens", type=int, default=48)
  parser.add_argument("--slots", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=8)
  args = parser.parse_args()
  tokenizer = debug_arithmetic_tokenizer().with_chat_template(TEMPLATE)
  config = ModelConfig(model_type="qwen2", vocab_size=tokenizer.vocab_size, hidden_size=256,
                       intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=64)
  engine = Engine(create_model(config, seed=0), max_concurrent_decodes=args.slots,
                  max_prefill_length=32, max_decode_length=args.max_tokens, steps_per_call=16)
  sampling = SamplingParams(temperature=1.0)
  driver = EngineDriver(engine, tokenizer=tokenizer)
  server = RolloutServer(driver, tokenizer, sampling=sampling, max_tokens=args.max_tokens)
  contents = [f"{i % 10}+{i // 10}=" for i in range(args.requests)]
  prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}]),
                              add_special_tokens=False) for c in contents]

  def in_process(run: int) -> int:
    return sum(len(c.completion_ids) for c in stream_groups(
        engine, prompts, sampling=sampling, max_new_tokens=args.max_tokens, seed=run))

  async def through_server(run: int, concurrent: bool) -> int:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="local", max_retries=0)

    def ask(i):
      return client.chat.completions.create(
          model="policy", messages=[{"role": "user", "content": contents[i]}],
          max_tokens=args.max_tokens, extra_headers={"X-Session-Id": f"r{run}-{i}"})

    if concurrent:
      replies = await asyncio.gather(*(ask(i) for i in range(args.requests)))
    else:
      replies = [await ask(i) for i in range(args.requests)]
    await client.close()
    return sum(r.usage.completion_tokens for r in replies)

  variants = {"in process": in_process,
              "server, concurrent": lambda run: asyncio.run(through_server(run, True)),
              "server, one at a time": lambda run: asyncio.run(through_server(run, False))}
  server.tokenizer = _NoStop(tokenizer)  # budget-only stops: every variant decodes the same
  seconds = {name: [] for name in variants}
  tokens = {}
  for run in range(args.warmup + args.repeats):
    for name, variant in variants.items():
      start = time.perf_counter()
      tokens[name] = variant(run)
      if run >= args.warmup:
        seconds[name].append(time.perf_counter() - start)
  server.stop()
  driver.stop()
  print("timed runs (s):", {k: [round(x, 2) for x in v] for k, v in seconds.items()})
  print(f"| variant | requests | tokens | seconds (median of {args.repeats}) | tokens/s |")
  print("|---|---|---|---|---|")
  for name in variants:
    median = statistics.median(seconds[name])
    print(f"| {name} | {args.requests} | {tokens[name]} | {median:.2f} | "
          f"{tokens[name] / median:.0f} |")


class _NoStop:
  """A tokenizer whose eos_ids are empty (the server's stop ids), all else the wrapped one's."""

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer
    self.eos_ids = ()

  def __getattr__(self, name):
    return getattr(self._tokenizer, name)


if __name__ == "__main__":
  main()
