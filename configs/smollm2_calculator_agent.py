"""The CPU demo's calculator run (configs/smollm2_calculator.py) with the episodes played by an
agent program through the rollout server instead of the in-process environment: SmolLM2-135M-
Instruct writes until "=", the agent (reasoning_rl/agents/examples/calculator_agent.py, `run`)
appends the exact value and sends the assistant's message back open
(`continue_final_message`), and the reward is the in-process run's. Same data, model, budgets,
rewards and algorithm; the episodes draw the same tokens for the same seed.

  python launch/train.py --config=configs/smollm2_calculator_agent.py \\
      --config.workdir=runs/calculator_agent
"""

from configs import smollm2_calculator


def get_config():
  c = smollm2_calculator.get_config()
  c.environment.name = ""  # the agent plays the episode
  c.agent.entry = "reasoning_rl.agents.examples.calculator_agent:run"
  c.agent.episode_timeout_s = 900.0  # the first step's compiles count against the deadline
  return c
