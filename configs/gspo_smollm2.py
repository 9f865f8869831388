"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071) on the CPU
demo's model and task: the importance ratio is taken per sequence, length-normalised,
s_i = exp(mean_t (log π − log π_old)), and clipped per sequence; every token of a sequence shares
its sequence's clipped term (`algo.loss_type = "gspo"`; `gspo-token` keeps the value but gives
each token its own gradient path, for per-token advantages).

Clip range: the paper's ε_low = 3e-4, ε_high = 4e-4 (§5.1) — two orders of magnitude below PPO's,
since a sequence ratio is a geometric mean of token ratios. Sequence-mean aggregation, no KL,
and two mini-batches per rollout batch (the paper uses four) so the ratio leaves 1.

  python launch/train.py --config=configs/gspo_smollm2.py --config.workdir=runs/gspo
  python launch/train.py --config=configs/gspo_smollm2.py:debug --config.workdir=/tmp/gspo
"""

from configs import _sizes


def get_config(variant: str = ""):
  c = _sizes.base("gspo_smollm2", variant)
  c.algo.estimator = "grpo"
  c.algo.loss_type = "gspo"
  c.algo.epsilon_low = 3e-4
  c.algo.epsilon_high = 4e-4
  c.algo.loss_agg = "seq-mean-token-mean"
  c.algo.num_mini_batches = 2
  c.beta = 0.0
  return c
