"""Training attention kernels on the machine it runs on: the XLA reference vs the backend's flash
kernel (`reasoning_rl.kernels`), beside cuDNN through `jax.nn.dot_product_attention` and torch's
`scaled_dot_product_attention` where they run, then whole forward + backward passes of a model.

Usage: PYTHONPATH=. python -m benchmarks.attention_kernels [--lengths 1024,4096,16384]
           [--model_lengths 2048,8192] [--repeats 5] [--small] [--out FILE.json]
           [--skip check,layer,model] [--gpu_blocks 128/64,128/32]

1. Check: on this backend, each kernel's output and q/k/v gradients against the reference computed
   in float32 (‖got − want‖ / ‖want‖), on packed rows, in float32 and bfloat16.
2. One attention layer, forward + backward (the gradient of Σ out · cotangent), bfloat16, causal,
   one row of T tokens with Qwen2.5-7B's heads (28 query heads, 4 KV heads, head_dim 128): median
   ms of `repeats` timed runs after a warm-up, and XLA's temporary bytes for the compiled program
   (the [T, T] scores show there), or torch's peak allocation.
3. A SmolLM2-135M-shaped model (random weights, bfloat16 compute, float32 parameters): forward +
   backward of the next-token loss over B × T tokens (B·T = 16384), ms per pass, per kernel;
   torch: transformers' Llama of the same shape in bfloat16 with SDPA attention.
`--small` shrinks every size so the script runs on a CPU (interpret-mode kernels) as a check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from reasoning_rl import kernels


def _median_ms(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # warm-up: compilation and first-call allocations
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def _attention_grad_fn(kernel, positions, segment_ids, scale):
  def loss(q, k, v, cotangent):
    out = kernels.training_attention(q, k, v, positions, jnp.where(segment_ids > 0, positions, -1),
                                     segment_ids, scale=scale, softcap=None, window=None,
                                     kernel=kernel)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _relative(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check(flash: str, small: bool) -> list[dict]:
  """Each kernel against the float32 reference on two packed rows (docstring, 1)."""
  rng = np.random.default_rng(0)
  batch, length, heads, kv_heads, dim = (2, 128, 4, 2, 32) if small else (2, 1024, 8, 2, 64)
  segment_ids = np.zeros((batch, length), np.int32)
  positions = np.zeros((batch, length), np.int32)
  cuts = [0, length // 3, length // 3 + length // 2, length - 7]
  for segment, (start, end) in enumerate(zip(cuts[:-1], cuts[1:]), start=1):
    segment_ids[0, start:end], positions[0, start:end] = segment, np.arange(end - start)
  segment_ids[1], positions[1] = 1, np.arange(length)
  segment_ids, positions = jnp.asarray(segment_ids), jnp.asarray(positions)
  q = rng.normal(size=(batch, length, heads, dim))
  k, v = (rng.normal(size=(batch, length, kv_heads, dim)) for _ in "kv")
  real = (np.asarray(segment_ids) > 0)[:, :, None, None]
  # padding outputs differ between kernels by design (never read): no gradient flows from them
  cotangent = jnp.asarray(rng.normal(size=q.shape) * real, jnp.float32)
  rows = []
  want_fn = _attention_grad_fn("reference", positions, segment_ids, dim ** -0.5)
  (_, want), want_grads = want_fn(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), cotangent)
  for dtype in (jnp.float32, jnp.bfloat16):
    got_fn = _attention_grad_fn(flash, positions, segment_ids, dim ** -0.5)
    (_, got), got_grads = got_fn(*(jnp.asarray(x, dtype) for x in (q, k, v)), cotangent)
    row = {"kernel": flash, "dtype": jnp.dtype(dtype).name,
           "out": _relative(np.where(real, got.astype(jnp.float32), 0), np.where(real, want, 0))}
    row.update({f"d{n}": _relative(g.astype(jnp.float32), w)
                for n, g, w in zip("qkv", got_grads, want_grads)})
    rows.append(row)
  return rows


def _torch():
  try:
    import torch
  except ImportError:
    return None
  return torch if torch.cuda.is_available() else None


def _pallas_gpu_blocks_fn(forward: int, backward: int, scale: float):
  """The GPU kernel with other block sizes (forward / backward), called directly."""
  from reasoning_rl.kernels import pallas_gpu

  def loss(q, k, v, cotangent):
    ids = jnp.ones(q.shape[:2], jnp.int32)
    out = pallas_gpu.attention(q, k, v, ids, scale=scale, forward_block=forward,
                               backward_block=backward)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def attention_layer(flash: str, lengths, repeats: int, small: bool,
                    block_variants=()) -> list[dict]:
  """One layer's forward + backward per kernel and length (docstring, 2)."""
  heads, kv_heads, dim = (4, 2, 32) if small else (28, 4, 128)
  rows = []
  torch = _torch()
  for length in lengths:
    rng = np.random.default_rng(length)
    q = jnp.asarray(rng.normal(size=(1, length, heads, dim)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(1, length, kv_heads, dim)), jnp.bfloat16) for _ in "kv")
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    ones = jnp.ones((1, length), jnp.int32)
    variants = {name: _attention_grad_fn(name, positions, ones, dim ** -0.5)
                for name in ("reference", flash)}
    if jax.default_backend() == "gpu":
      for forward, backward in block_variants:
        variants[f"pallas_gpu blocks {forward}/{backward}"] = _pallas_gpu_blocks_fn(
            forward, backward, dim ** -0.5)

      def cudnn_loss(q, k, v, cotangent):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=dim ** -0.5,
                                           implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32) * cotangent), out
      variants["cudnn (jax.nn)"] = jax.jit(jax.value_and_grad(cudnn_loss, argnums=(0, 1, 2),
                                                              has_aux=True))
    for name, fn in variants.items():
      row = {"length": length, "kernel": name}
      try:
        compiled = fn.lower(q, k, v, cotangent).compile()
        memory = compiled.memory_analysis()
        row["temp_mib"] = (memory.temp_size_in_bytes / 2 ** 20) if memory else None
        row["ms"] = _median_ms(lambda: compiled(q, k, v, cotangent), repeats)
      except Exception as error:  # a kernel that does not fit or compile is a row, not a crash
        row["error"] = f"{type(error).__name__}: {str(error)[:160]}"
      rows.append(row)
      print(row, flush=True)
    if torch is not None:
      rows.append(_torch_attention(torch, length, heads, kv_heads, dim, repeats))
      print(rows[-1], flush=True)
  return rows


def _torch_attention(torch, length, heads, kv_heads, dim, repeats):
  import torch.nn.functional as F

  device = "cuda"
  q = torch.randn(1, heads, length, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
  k, v = (torch.randn(1, kv_heads, length, dim, device=device, dtype=torch.bfloat16,
                      requires_grad=True) for _ in "kv")
  cotangent = torch.randn(1, heads, length, dim, device=device, dtype=torch.bfloat16)

  def run():
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(cotangent)
    torch.cuda.synchronize()

  run()
  torch.cuda.reset_peak_memory_stats()
  before = torch.cuda.memory_allocated()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append((time.perf_counter() - start) * 1e3)
  peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
  return {"length": length, "kernel": f"torch sdpa {torch.__version__}",
          "ms": statistics.median(times), "temp_mib": peak}


def model_passes(flash: str, lengths, repeats: int, small: bool) -> list[dict]:
  """Forward + backward of a SmolLM2-135M-shaped model per kernel (docstring, 3)."""
  from flax import nnx

  from reasoning_rl.models.config import ModelConfig
  from reasoning_rl.models.transformer import create_model

  shape = (dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, vocab_size=256) if small else
           dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                num_kv_heads=3, head_dim=64, vocab_size=49152))
  config = ModelConfig(model_type="llama", tie_word_embeddings=True, **shape)
  tokens_per_pass = 512 if small else 16384
  rows = []
  torch = _torch()
  for length in lengths:
    batch = max(1, tokens_per_pass // length)
    tokens = jnp.asarray(np.random.default_rng(length).integers(0, config.vocab_size,
                                                                (batch, length)), jnp.int32)
    for name in ("reference", flash):
      model = create_model(config, dtype=jnp.bfloat16).use_attention_kernel(name)
      graphdef, params = nnx.split(model)

      def loss(params):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

      step = jax.jit(jax.value_and_grad(loss))
      row = {"length": length, "batch": batch, "kernel": name}
      try:
        compiled = step.lower(params).compile()
        memory = compiled.memory_analysis()
        row["temp_mib"] = (memory.temp_size_in_bytes / 2 ** 20) if memory else None
        row["ms"] = _median_ms(lambda: compiled(params), repeats)
      except Exception as error:
        row["error"] = f"{type(error).__name__}: {str(error)[:160]}"
      rows.append(row)
      print(row, flush=True)
    if torch is not None and not small:
      rows.append(_torch_model(torch, shape, batch, length, repeats))
      print(rows[-1], flush=True)
  return rows


def _torch_model(torch, shape, batch, length, repeats):
  import transformers

  config = transformers.LlamaConfig(
      vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
      intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
      num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
      head_dim=shape["head_dim"], tie_word_embeddings=True, attn_implementation="sdpa")
  model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
  tokens = torch.randint(0, shape["vocab_size"], (batch, length), device="cuda")

  def run():
    model.zero_grad(set_to_none=True)
    out = model(tokens, labels=tokens)
    out.loss.backward()
    torch.cuda.synchronize()

  run()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append((time.perf_counter() - start) * 1e3)
  return {"length": length, "batch": batch, "ms": statistics.median(times),
          "kernel": f"torch {torch.__version__} transformers {transformers.__version__} sdpa, "
                    "bf16 weights"}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--lengths", default="1024,4096,16384")
  parser.add_argument("--model_lengths", default="2048,8192")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--out", default="")
  parser.add_argument("--skip", default="", help="comma list of check,layer,model")
  parser.add_argument("--gpu_blocks", default="",
                      help="extra GPU kernel block sizes to time, e.g. 128/64,128/32")
  args = parser.parse_args()
  backend = jax.default_backend()
  flash = kernels.choose_training_kernel("auto", backend=backend)
  if flash == "reference":
    flash = "splash"  # on a CPU: the TPU kernel in interpret mode, as a check of the script
  info = {"backend": backend, "device": str(jax.devices()[0].device_kind),
          "jax": jax.__version__, "flash": flash}
  print(info, flush=True)
  skip = set(filter(None, args.skip.split(",")))
  result = {"info": info}
  if "check" not in skip:
    result["check"] = check(flash, args.small)
    for row in result["check"]:
      print(row, flush=True)
  lengths = [int(x) for x in args.lengths.split(",")]
  if "layer" not in skip:
    blocks = [tuple(int(x) for x in pair.split("/")) for pair in args.gpu_blocks.split(",")
              if pair]
    result["layer"] = attention_layer(flash, lengths, args.repeats, args.small, blocks)
  if "model" not in skip:
    model_lengths = [int(x) for x in args.model_lengths.split(",")]
    result["model"] = model_passes(flash, model_lengths, args.repeats, args.small)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
