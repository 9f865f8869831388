"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
arXiv:2503.20783) on the CPU demo's model and task. GRPO with its two biases removed:

- no division by the group's reward standard deviation (question-level difficulty bias):
  advantage = r − mean of the group (`algo.estimator = "dr_grpo"`);
- no division by each response's own length (length bias: long wrong answers are penalised
  less per token): token sums divided by one constant, the generation budget
  (`algo.loss_agg = "seq-mean-token-sum-norm"`).
No KL term (β = 0), one update per rollout batch, PPO's ε = 0.2, as in the paper's runs.

  python launch/train.py --config=configs/drgrpo_smollm2.py --config.workdir=runs/drgrpo
  python launch/train.py --config=configs/drgrpo_smollm2.py:debug --config.workdir=/tmp/drgrpo
"""

from configs import _sizes


def get_config(variant: str = ""):
  c = _sizes.base("drgrpo_smollm2", variant)
  c.algo.estimator = "dr_grpo"
  c.algo.loss_type = "ppo"
  c.algo.epsilon_low = 0.2
  c.algo.epsilon_high = 0.2
  c.algo.loss_agg = "seq-mean-token-sum-norm"
  c.algo.num_iterations = 1
  c.algo.num_mini_batches = 1
  c.beta = 0.0
  return c
