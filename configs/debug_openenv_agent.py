"""Debug agent-hub config: configs/debug_cpu.py's tiny random model playing an OpenEnv environment
(docs/agent_hubs.md) — the test environment tests/data/hub_envs/openenv_guess (guess a number
from 1 to 10: +1 for the right guess, which ends the episode, -0.25 for a wrong one; three guesses).

The environment must be importable by the trainer:
    pip install -e tests/data/hub_envs/openenv_guess
    # or: PYTHONPATH=tests/data/hub_envs/openenv_guess
    python launch/train.py --config=configs/debug_openenv_agent.py --config.workdir=/tmp/guess

The training data are JSONL rows whose extra keys (target, max_guesses) are the arguments of the
environment's reset. The model's reply becomes a guess through `first_digit` below (a random
model writes digits often, but seldom a reply that is one number). The held-out evaluation stays
the debug config's (single-turn synthetic arithmetic scored by config.rewards).
"""

import pathlib

from configs import debug_cpu

TASKS = (pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "hub_envs"
         / "openenv_guess" / "guess_tasks.jsonl")


def first_digit(reply: str) -> dict:
  """agent.action: the reply's first digit is the guess; a reply without one is no action."""
  digits = [c for c in reply if c.isdigit()]
  if not digits:
    raise ValueError("no digit in the reply")
  return {"guess": int(digits[0])}


def get_config():
  c = debug_cpu.get_config()
  c.model.tokenizer = "debug_arithmetic_chat"  # the adapter talks to the model in chat requests
  c.agent.entry = "reasoning_rl.agents.openenv_hub:agent_from_settings"
  c.agent.environment = "rrl_openenv_guess:GuessEnvironment"
  c.agent.transport = "in_process"
  c.agent.action = "configs.debug_openenv_agent:first_digit"
  c.agent.max_turns = 4
  c.agent.turn_tokens = 4
  c.data.train = dict(kind="jsonl", path=str(TASKS))
  # the environment's opening message (~85 characters, letters one <unk> token each), then up to
  # four turns of 4 tokens and the environment's answers between them ("Invalid action: no digit
  # in the reply" is ~40 tokens): the episode's whole token budget
  c.rollout.max_prefill_length = 96
  c.rollout.max_new_tokens = 192
  return c
