"""DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476) on the CPU demo's model and task. DAPO's four changes to GRPO, each one line:

- clip-higher (§3.1): ε_low = 0.2, ε_high = 0.28, so low-probability tokens can still grow;
- dynamic sampling (§3.2): groups whose rewards are all equal carry no signal; they are dropped
  and more prompts are sampled (up to `dynamic_sampling.max_rounds` rounds);
- token-level loss (§3.3): every token of the batch weighs the same (`token-mean`);
- overlong reward shaping (§3.4): a soft length penalty over the last L_cache tokens before
  the limit, -1 for a truncated answer (`rewards.length`, method `dapo`).
No KL term (β = 0). Several optimizer updates per rollout batch (mini-batches), so the ratio moves
off 1 and the clip bounds matter at all (with one update per batch they never fire).

  python launch/train.py --config=configs/dapo_smollm2.py --config.workdir=runs/dapo
  python launch/train.py --config=configs/dapo_smollm2.py:debug --config.workdir=/tmp/dapo
"""

from configs import _sizes


def get_config(variant: str = ""):
  c = _sizes.base("dapo_smollm2", variant)
  c.algo.estimator = "grpo"
  c.algo.loss_type = "ppo"
  c.algo.epsilon_low = 0.2
  c.algo.epsilon_high = 0.28
  c.algo.loss_agg = "token-mean"
  c.algo.num_mini_batches = 2
  c.dynamic_sampling.enabled = True
  c.dynamic_sampling.max_rounds = 3
  c.beta = 0.0
  # DAPO's L_cache is a fifth of the generation budget (4096 of 20480 tokens)
  c.rewards = {**c.rewards.to_dict(),
               "length": {"weight": 1.0, "method": "dapo",
                          "cache_len": max(1, c.rollout.max_new_tokens // 5)}}
  return c
