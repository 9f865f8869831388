"""The CPU demo (configs/smollm2_arithmetic.py) on a mixture of experts: SmolLM2-135M-Instruct
upcycled into 4 experts per layer, each token sent to 2 (Komatsuzaki et al. 2022; the upcycled
model computes what SmolLM2 computes until training makes the experts differ, docs/moe.md),
trained with the demo's recipe and rollout routing replay (R3, Ma et al. 2025): the trainer
routes every token through the experts the sampler chose. Without replay:
--config.algo.routing_replay=False (benchmarks/RESULTS.md compares the two).

  python launch/train.py --config=configs/smollm2_moe_arithmetic.py --config.workdir=runs/moe
"""

from configs import smollm2_arithmetic


def get_config():
  c = smollm2_arithmetic.get_config()
  c.model.upcycle.num_experts = 4
  c.model.upcycle.experts_per_token = 2
  c.algo.routing_replay = True
  # A router on SmolLM2's hidden states sends most tokens to the same experts: drawn at random,
  # train/routing/collapse (the busiest expert's share of its ceiling: 0.5 is balanced for 2 of
  # 4 experts, 1.0 means it takes every token) was 0.996 at step 1. Upcycling now centres each
  # router on its layer's inputs (docs/moe.md): the demo starts at 0.72 and stays within
  # 0.72-0.80 for its 30 steps (benchmarks/RESULTS.md). Switch Transformer's load-balancing loss
  # spreads the tokens further (Fedus et al. 2021; Mixtral and Qwen3-MoE train with a weight of
  # 0.001-0.02). The collapse guard stays off: the upcycled experts start identical, so a
  # collapsed router costs this demo unused experts, not wrong answers.
  c.algo.moe_load_balance_coef = 0.01
  c.guards.max_routing_collapse = 1.0
  return c
