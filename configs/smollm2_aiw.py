"""A second task for the CPU demo's model: GRPO on SmolLM2-135M-Instruct for reasoning-gym aiw.

"Alice in Wonderland" questions (Nezhurina et al. 2024, "Alice in Wonderland: Simple Tasks Showing
Complete Reasoning Breakdown in State-Of-the-Art Large Language Models"): "Patricia has 4 sisters
and she also has 1 brothers. How many sisters does William's brother have?" (5: her sisters and
herself), the same about male / female friends, and about two overlapping groups of colleagues.
The answer is a count read from the question by one step of reasoning (one more than a number
it states, for siblings and friends); the held-out answers spread over 2 to 7 (the most common,
5, is 20 %), so no constant answer scores more than 20 %. The untrained model scores 11 % greedy
(benchmarks/RESULTS.md). Everything else is the arithmetic demo (configs/smollm2_arithmetic.py):
free-text answers read by the math verifier, 40 steps of 4 prompts × 8 samples, the held-out 100
examples greedy under the task's own wording and two rewordings. Completions get 160 tokens: the
untrained model's working runs ~96 tokens and half of it passed 128.

Measured (benchmarks/RESULTS.md): at these settings it does not learn. The training reward fell
from 0.03–0.16 (steps 1–8) to 0–0.03 (steps 9–13) while the completions grew into the budget
(72–94 % cut at 160), and the run was stopped at step 13. Not a second task that learns; it
stays as the starting point of that work.

  python launch/train.py --config=configs/smollm2_aiw.py --config.workdir=runs/aiw
"""

from configs import smollm2_arithmetic


def get_config():
  c = smollm2_arithmetic.on_task("aiw")
  c.rollout.max_prefill_length = 192  # the colleagues questions, reworded, run to ~150
  c.rollout.max_new_tokens = 160
  c.eval.canaries = ("Mary has 3 sisters and she also has 2 brothers. How many sisters does "
                     "Mary's brother have?",)
  return c
