"""Debug config of a mixture of experts: `debug_cpu.py`'s tiny random model and task with each
MLP replaced by 4 routed experts of which every token takes 2 (a Qwen3-MoE layout), rollouts that
record each token's experts, and routing replay on (`algo.routing_replay`, docs/moe.md). Seconds
per step on 2 CPU cores; used by the MoE tests."""

from configs import debug_cpu


def get_config():
  c = debug_cpu.get_config()
  c.model.random.model_type = "qwen3_moe"
  c.model.random.qk_norm = True
  c.model.random.attention_bias = False
  c.model.random.moe = dict(num_experts=4, experts_per_token=2, intermediate_size=48,
                            normalize_top_k=True)
  c.algo.routing_replay = True
  # The debug task's character vocabulary gives a handful of distinct hidden states, so hard
  # top-2 routing of this random router piles onto one expert within a few steps (the router's
  # probabilities stay near uniform: routing/entropy ≈ ln 4); the collapse guard is for real
  # models and tasks, tested on its own (tests/test_moe_rl.py).
  c.guards.max_routing_collapse = 1.0
  return c
