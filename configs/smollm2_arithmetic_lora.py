"""The CPU demo (configs/smollm2_arithmetic.py) with LoRA (Hu et al. 2021, arXiv:2106.09685):
rank-16 adapters on every projection (attention q, k, v, o and MLP gate, up, down) of every layer
of SmolLM2-135M-Instruct, the base frozen.

Why the MLP too: measured on this demo (benchmarks/RESULTS.md, 30 steps, held-out greedy),
attention-only adapters gained 29 → 47 % in 40 steps at this learning rate and 29 → 41 % in 30
steps at 5e-4, where full fine-tuning gains 29 → 53 %; with the MLP adapted too, 29 → 51 % (and
29 → 48 %, 23 → 53 % reworded, against full fine-tuning's 49 % and 56 %): within 3 points on every
wording. "LoRA Without Regret" (Schulman et al. 2025) finds the same: attention-only adapters
underperform, adapters on the MLP layers match full fine-tuning. Rank 16 is more than RL needs
there (they find low ranks enough for policy gradient); it is kept from the earlier runs.

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
  c.lora.target_modules = r"layers/\d+/(attn|mlp)"
  c.lora.sampler_weights = "adapters"
  c.optim.learning_rate = 2e-4 if variant == "" else 3e-2
  return c
