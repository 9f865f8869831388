"""The CPU demo (configs/smollm2_arithmetic.py) with LoRA (Hu et al. 2021, arXiv:2106.09685):
rank-16 adapters on the attention projections (q, k, v, o) of every layer of SmolLM2-135M-Instruct,
the base frozen.

Why attention only: on a CPU the rank-16 products are memory-bound, and adapters on every
projection made the training step slower than full fine-tuning (16.1 s against 12.5 s for the
demo's 32 rows, `python -m benchmarks.lora_step`); attention-only adapters leave the MLP, three
quarters of the weights, without weight gradients or adapter products (7.9 s). RL needs little adapter
capacity (Schulman et al. 2025, "LoRA Without Regret", find low ranks enough for policy gradient).

The optimizer state covers the adapters only, the sampler receives the adapters after each step
(it keeps its own copy of the base), and a checkpoint holds the adapters and the fingerprint of the
base they belong to. LoRA's best learning rate is about ten times full fine-tuning's for the same
model and task (Schulman et al. 2025, "LoRA Without Regret"), so 2e-4 where the full demo uses 2e-5;
alpha = 2 · rank. Everything else (task, reward, batch, evaluation) is the full demo's, so the two
compare step for step (benchmarks/lora_vs_full.py).

  python launch/train.py --config=configs/smollm2_arithmetic_lora.py --config.workdir=runs/lora
  python launch/train.py --config=configs/smollm2_arithmetic_lora.py:debug --config.workdir=/tmp/l

QLoRA: add --config.lora.base_quantization=int8 (or nf4) to keep the frozen base quantized.
"""

from configs import _sizes


def get_config(variant: str = ""):
  c = _sizes.base("smollm2_arithmetic_lora", variant)
  c.lora.rank = 16
  c.lora.alpha = 32.0
  c.lora.target_modules = r"layers/\d+/attn"
  c.lora.sampler_weights = "adapters"
  c.optim.learning_rate = 2e-4 if variant == "" else 3e-2
  return c
