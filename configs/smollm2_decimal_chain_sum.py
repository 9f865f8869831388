"""A second task for the CPU demo's model: GRPO on SmolLM2-135M-Instruct for reasoning-gym
decimal_chain_sum.

Add or subtract two numbers with one decimal place and a one-digit whole part ("State the final
answer to the following arithmetic problem: 4.9 + 4.3 ="). The demo's integers are not enough:
the untrained model mostly answers with a whole number near the result ("9" for 9.2), so the
skill to learn is carrying the tenths. Answers are spread over many values, so no constant answer
pays. Everything else is the arithmetic demo (configs/smollm2_arithmetic.py): free-text answers
read by the math verifier (`extract="final_answer"`), 4 prompts × 8 samples, held-out 100
examples greedy under the task's own wording and two rewordings.

Rollouts sample at temperature 0.7, with the truncated importance ratio correcting for it: at
temperature 1 the untrained model is right 0.75 % of the time (pass@8 6 %, with two-digit whole
parts), at 0.7 3.5 % (pass@8 22 %), so most groups at temperature 1 carry no signal.

Measured (benchmarks/RESULTS.md, 2 cores, 16 min, 8.6 GiB): held-out 5 % → 29 % in 40 steps
(reworded 8 % → 32 % and 5 % → 32 %). The gain is all in the additions (15 of 22 without a carry,
10 of 30 with one); subtractions did not move, and negative results stay at zero.

  python launch/train.py --config=configs/smollm2_decimal_chain_sum.py --config.workdir=runs/decimal
"""

from configs import smollm2_arithmetic

DECIMAL_SUM = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, min_decimal_places=1,
                   max_decimal_places=1, allow_negation=False)


def get_config():
  c = smollm2_arithmetic.on_task("decimal_chain_sum", DECIMAL_SUM)
  c.rollout.max_prefill_length = 96  # the reworded held-out prompts run to ~70 tokens
  c.rollout.temperature = 0.7
  c.eval.canaries = ("State the final answer to the following arithmetic problem: 4.9 + 4.3 =",)
  return c
