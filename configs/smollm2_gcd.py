"""A second task for the CPU demo's model: GRPO on SmolLM2-135M-Instruct for reasoning-gym gcd.

Greatest common divisor of two numbers from 1 to 50 ("Find the Greatest Common Divisor (GCD) of
these numbers: 30, 50. Give only the GCD as your final answer."), everything else as the
arithmetic demo (configs/smollm2_arithmetic.py): free-text answers read by the math verifier
(`extract="final_answer"`), 40 steps of 4 prompts × 8 samples, held-out 100 examples greedy under
the task's own wording and two rewordings.

reasoning-gym draws pairs with a common factor more often than chance: 32 of the 100 held-out
answers are 2 and 21 are 3, so a policy that always answered 2 would score 32 %. The held-out
accuracy is read against that floor (benchmarks/RESULTS.md reports it per answer).

  python launch/train.py --config=configs/smollm2_gcd.py --config.workdir=runs/gcd
"""

from configs import smollm2_arithmetic

GCD = dict(min_value=1, max_value=50)


def get_config():
  c = smollm2_arithmetic.get_config()
  c.data.train = dict(kind="reasoning_gym", name="gcd", seed=1, size=100_000, params=GCD)
  c.data.eval = dict(kind="reasoning_gym", name="gcd", seed=987_654, size=100, params=GCD)
  c.rollout.max_prefill_length = 96  # 63 tokens in the chat template, 78 reworded
  c.eval.canaries = ("Find the Greatest Common Divisor (GCD) of these numbers: 36, 48. Give only "
                     "the GCD as your final answer.",)
  c.eval.instruction_variants = (
      "Solve this problem and state the final result as a number.\n\n{prompt}",
      "{prompt}\nWork it out, then finish with: The answer is <number>.",
  )
  return c
