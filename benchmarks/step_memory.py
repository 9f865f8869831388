"""Per-device memory of the compiled training step: XLA's own analysis against the dry-run planner.

Usage: python -m benchmarks.step_memory [--cases base,fsdp4,...]

Each case is a random Qwen2-shaped model (hidden 256, MLP 1024, 8 heads / 4 KV heads, 2 layers,
vocabulary 4096 unless the case changes it), 16 rows of 64 prompt + 64 completion tokens,
2 micro-batches, on a (data, fsdp, tensor) mesh of simulated CPU devices. For each, the table shows
XLA's `compiled.memory_analysis()` of the step — arguments (the train state and the batch),
temporaries, outputs not aliased to the donated state — and the planner's per-device total
(`reasoning_rl.planning.plan`, target "cpu"), with their ratio. Nothing is run, only compiled.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from reasoning_rl import planning, sharding  # noqa: E402
from reasoning_rl.build import step_config  # noqa: E402
from reasoning_rl.config import base_config  # noqa: E402
from reasoning_rl.models.config import ModelConfig  # noqa: E402
from reasoning_rl.models.transformer import create_model  # noqa: E402
from reasoning_rl.rl.step import TrainStep  # noqa: E402

MIB = 2**20
CASES = {
    "base": {}, "4 rows": dict(micro=4), "16 rows": dict(micro=1), "S 256": dict(prompt=192),
    "MLP 512": dict(inter=512), "vocab 16k": dict(vocab=16384), "4 layers": dict(layers=4),
    "hidden 512": dict(hidden=512), "beta": dict(beta=0.04), "remat": dict(remat=True),
    "fsdp 4": dict(mesh=(1, 4, 1)), "fsdp 2 x tensor 2": dict(mesh=(1, 2, 2)),
    "data 2 x fsdp 2": dict(mesh=(2, 2, 1)), "fsdp 4 / 32 rows": dict(mesh=(1, 4, 1), micro=1, P=4),
}


def case_config(hidden=256, layers=2, vocab=4096, P=2, G=8, prompt=64, new=64, micro=2, beta=0.0,
                mesh=(1, 1, 1), remat=False, inter=1024):
  c = base_config()
  c.rollout.num_prompts, c.rollout.num_samples = P, G
  c.rollout.max_prefill_length, c.rollout.max_new_tokens = prompt, new
  c.algo.num_micro_batches, c.beta, c.algo.remat, c.algo.logprob_chunk = micro, beta, ("full" if remat else "none"), 64
  c.mesh.num_trainer_devices = mesh[0] * mesh[1] * mesh[2]
  c.mesh.trainer, c.mesh.sampler = mesh, (1, 1, -1)
  m = ModelConfig(model_type="qwen2", vocab_size=vocab, hidden_size=hidden,
                  intermediate_size=inter, num_layers=layers, num_heads=8, num_kv_heads=4,
                  head_dim=hidden // 8, attention_bias=True, tie_word_embeddings=True)
  return c, m


def xla_memory(c, m) -> dict[str, int]:
  n = c.mesh.num_trainer_devices
  mesh = sharding.make_mesh(tuple(c.mesh.trainer), jax.devices()[:n], field="mesh.trainer")
  graphdef, params = nnx.split(create_model(m, seed=0))
  reference = jax.tree.map(jnp.copy, params) if c.beta > 0 else None
  step = TrainStep(graphdef, step_config(c), mesh)
  state = step.init_state(params, ref_params=reference)
  r = c.rollout
  rows, length = r.num_prompts * r.num_samples, r.max_prefill_length + r.max_new_tokens
  batch = dict(tokens=jnp.zeros((rows, length), jnp.int32),
               attention_mask=jnp.ones((rows, length), jnp.int32),
               completion_mask=jnp.ones((rows, r.max_new_tokens), jnp.int32),
               advantages=jnp.ones((rows,), jnp.float32))
  a = step.compile(state, batch).lower(state, batch).compile().memory_analysis()
  return dict(arguments=a.argument_size_in_bytes, temporaries=a.temp_size_in_bytes,
              outputs=a.output_size_in_bytes - a.alias_size_in_bytes)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", default=",".join(CASES))
  args = parser.parse_args()
  print(f"{'case':22s} {'args MiB':>9s} {'temp MiB':>9s} {'XLA MiB':>9s} {'plan MiB':>9s} "
        f"{'plan/XLA':>8s}")
  for name in args.cases.split(","):
    c, m = case_config(**CASES[name])
    x = xla_memory(c, m)
    total = sum(x.values())
    planned = planning.plan(c, m, target={"tpu": "cpu", "num_devices": 8}).slice("trainer").total
    print(f"{name:22s} {x['arguments'] / MIB:9.1f} {x['temporaries'] / MIB:9.1f} "
          f"{total / MIB:9.1f} {planned / MIB:9.1f} {planned / total:8.2f}", flush=True)


if __name__ == "__main__":
  main()
