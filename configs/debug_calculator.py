"""Debug multi-turn config: configs/debug_cpu.py's tiny random model, playing calculator episodes.

Each model turn that ends at "=" gets the exact value of the expression before it appended by the
`calculator` environment (reasoning_rl/environments/calculator.py), and the model goes on; the
character-level debug vocabulary spells every calculator observation, so even a random model
calls the tool. Used by the tests (multi-turn run, SIGKILL + resume); a few steps take well under
two minutes on 2 CPU cores.
"""

from configs import debug_cpu


def get_config():
  c = debug_cpu.get_config()
  c.environment.name = "calculator"
  c.environment.settings = {"max_calls": 4}
  c.environment.max_turns = 4
  c.environment.turn_tokens = 8
  c.environment.observation_format = "raw"  # the value right after "=", as GSM8K's calculator
  # rollout.max_new_tokens bounds the whole episode: model turns and calculator values
  c.rollout.max_new_tokens = 24
  c.rollout.max_prefill_length = 16
  return c
