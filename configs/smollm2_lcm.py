"""A second task for the CPU demo's model: GRPO on SmolLM2-135M-Instruct for reasoning-gym lcm.

Least common multiple of two numbers from 1 to 20 ("Find the Least Common Multiple (LCM) of these
numbers: 4, 16"). The task's wording leaves room to work before answering (reasoning-gym's gcd
asks for "only the GCD", and trained a policy that answered first and guessed: RESULTS.md).
Everything else is the arithmetic demo (configs/smollm2_arithmetic.py): free-text answers read by
the math verifier (`extract="final_answer"`), 40 steps of 4 prompts × 8 samples, held-out 100
examples greedy under the task's own wording and two rewordings. Completions get 128 tokens
instead of 64: the untrained model's working runs 55 tokens on average and 15 % of it is cut at
128.

The held-out answers are spread out (the most common, 12, 16, 30 and 60, are 7 % each), so a
constant answer scores at most 7 %; the untrained model scores 13 %. But in 42 of the 100 held-out
pairs one number divides the other, so "the larger number" is right there. Measured
(benchmarks/RESULTS.md): 40 steps take held-out accuracy from 13 % to 33 %, every correct answer
before and after on those 42 pairs and none on the other 58. The policy learned that shortcut
(answering in 13 tokens instead of 55), not the LCM: this config does not yet pass as a second
task that learns; it stays as the starting point of that work.

  python launch/train.py --config=configs/smollm2_lcm.py --config.workdir=runs/lcm
"""

from configs import smollm2_arithmetic

LCM = dict(min_value=1, max_value=20)


def get_config():
  c = smollm2_arithmetic.on_task("lcm", LCM)
  c.rollout.max_prefill_length = 96  # 48-50 tokens in the chat template, 63-65 reworded
  c.rollout.max_new_tokens = 128
  c.eval.canaries = ("Find the Least Common Multiple (LCM) of these numbers: 6, 8",)
  return c
