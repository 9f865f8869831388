"""Tool-integrated RL on the CPU demo: SmolLM2-135M-Instruct solves the demo's arithmetic
(configs/smollm2_arithmetic.py) with a calculator, over several turns of one episode.

The `calculator` environment is GSM8K's calculator (Cobbe et al. 2021): whenever the model writes
"=" after an arithmetic expression, its turn ends there, the exact value of the expression is
appended ("17 + 25 =" → "42") and the model goes on from it. The model is not told about the tool:
it writes equations on its own, and RL decides whether writing them out pays. The calculator's
values are computed, not claimed, so the demo's verifier (`extract="final_answer"`) reads the whole
conversation. Held-out evaluation plays the same episodes.

  python launch/train.py --config=configs/smollm2_calculator.py --config.workdir=runs/calculator
"""

from configs import smollm2_arithmetic


def get_config():
  c = smollm2_arithmetic.get_config()
  c.total_steps = 40  # as measured (benchmarks/RESULTS.md); the arithmetic demo runs 30
  c.environment.name = "calculator"
  c.environment.settings = {"max_calls": 4}
  c.environment.max_turns = 5
  c.environment.turn_tokens = 64
  c.environment.observation_format = "raw"
  # the whole episode, calculator values included
  c.rollout.max_new_tokens = 96
  return c
