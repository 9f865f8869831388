"""Debug agent-hub config: configs/debug_cpu.py's tiny random model playing a verifiers environment
(docs/agent_hubs.md) — the test environment tests/data/hub_envs/verifiers_addition (2-digit
addition, exact-answer reward, a one-turn chat harness that runs in-process).

The environment must be importable by the trainer:
    pip install -e tests/data/hub_envs/verifiers_addition
    # or: PYTHONPATH=tests/data/hub_envs/verifiers_addition
    python launch/train.py --config=configs/debug_verifiers_agent.py --config.workdir=/tmp/vf

The training data are the taskset's tasks (data.train.kind='agent'); the rewards are the
environment's. The held-out evaluation stays the debug config's (single-turn synthetic arithmetic
scored by config.rewards): an agent's tasks are not a held-out set the trainer can score.
"""

from configs import debug_cpu


def get_config():
  c = debug_cpu.get_config()
  c.model.tokenizer = "debug_arithmetic_chat"  # the environment's harness sends chat requests
  c.agent.entry = "reasoning_rl.agents.verifiers_hub:agent_from_settings"
  c.agent.env_id = "rrl_vf_addition"
  c.agent.env_args = {"taskset": {"count": 8, "seed": 0}}
  c.data.train = dict(kind="agent")
  # the harness's prompt: a system message and "What is a + b?" (each letter one <unk> token)
  c.rollout.max_prefill_length = 64
  c.rollout.max_new_tokens = 8
  return c
