"""A second task for the CPU demo's model: GRPO on SmolLM2-135M-Instruct for reasoning-gym
number_format.

Pick the largest or the smallest of 2–3 numbers from 1 to 1000 written in different notations
("pick the smallest number of the following candidates: 5.619080000000000e+02 556.269"): reading
scientific notation and comparing magnitudes, not arithmetic. Everything else is the arithmetic
demo (configs/smollm2_arithmetic.py): free-text answers read by the math verifier
(`extract="final_answer"`; the answer may be written in any notation of the same value), 4
prompts × 8 samples, held-out 100 examples greedy under the task's own wording and two
rewordings. Prompts run ~100 tokens in the chat template.

Untrained, greedy, held-out: 32 % (39 % and 21 % reworded), completions of 29 tokens on average.
74 of the 100 answers name a candidate, and 43 % of those are right: chance, since a random
candidate would be right 42 % of the time (a half or a third per question). So the held-out
accuracy is read beside how often the answer is a candidate, and how often that candidate is
the right one (benchmarks/RESULTS.md). A first run was stopped at step 9 with the train reward at
0–0.09: at temperature 1, 31–59 % of the samples ran into the 64-token budget. It is not yet a
second task that learns.

  python launch/train.py --config=configs/smollm2_number_format.py --config.workdir=runs/nf
"""

from configs import smollm2_arithmetic

NUMBER_FORMAT = dict(min_num_candidates=2, max_num_candidates=3, min_n=1, max_n=1000)


def get_config():
  c = smollm2_arithmetic.on_task("number_format", NUMBER_FORMAT)
  c.rollout.max_prefill_length = 160
  c.eval.canaries = ("Your task is to pick the largest/smallest number out of several options."
                     "\n\nYour output should be only the number of interest.\n\nNow, pick the "
                     "largest number of the following candidates: 3.512000000000000e+01 "
                     "29.870000\n",)
  c.eval.instruction_variants = (
      "Compare the numbers below and answer with the one asked for.\n\n{prompt}",
      "{prompt}\nThink it through, then finish with: The answer is <number>.",
  )
  return c
