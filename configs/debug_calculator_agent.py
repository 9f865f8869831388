"""Debug agent config: configs/debug_calculator.py's calculator episodes played by an agent
program through the rollout server (reasoning_rl/agents/examples/calculator_agent.py,
`debug_run`), on the tiny random model.

The prompt is rendered by a chat template spelled in the debug vocabulary
(`debug_arithmetic_chat`), since the agent talks chat completions. With `agent.entry` cleared and
`environment.name = "calculator"` (`in_process()`), the same config plays the same episodes in
process: tests/test_calculator_agent.py checks that the two give equal training batches, and that
a SIGKILL inside an episode then a rerun reproduce the run.
"""

from configs import debug_calculator


def get_config():
  c = debug_calculator.get_config()
  c.model.tokenizer = "debug_arithmetic_chat"
  c.data.template = "chat"  # the user message, as the agent sends it
  c.environment.name = ""  # the agent plays the episode
  c.agent.entry = "reasoning_rl.agents.examples.calculator_agent:debug_run"
  c.agent.min_episodes_per_group = c.rollout.num_samples  # an episode that fails is a bug here
  c.agent.episode_timeout_s = 600.0  # the first step's compiles count against the deadline
  return c


def in_process():
  """The same run with the calculator environment in process instead of the agent."""
  c = get_config()
  c.agent.entry = ""
  c.environment.name = "calculator"
  return c
