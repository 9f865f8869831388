"""Configs the tests build: the debug config with overrides, a demo config file, the planner's tiny
model. (From test_config.py, test_environments_wiring.py, test_planning.py.)"""

import importlib.util
import sys

from reasoning_rl.config import base_config
from reasoning_rl.models.config import ModelConfig
from tests.conftest import REPO


def debug_config(**overrides):
  sys.path.insert(0, str(REPO))
  from configs import debug_cpu

  config = debug_cpu.get_config()
  config.workdir = "/tmp/unused"
  for dotted, value in overrides.items():
    node = config
    *parents, last = dotted.split(".")
    for part in parents:
      node = node[part]
    node[last] = value
  return config


def demo_config(name: str):
  """configs/<name>.py's config (configs import each other as `configs.…`)."""
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.workdir = "/tmp/unused"
  return config


# 3 query heads and 1 KV head do not divide a tensor axis of 2, nor does the MLP width 21: those
# dimensions stay replicated, which the hand counts below must reflect.
TINY = ModelConfig(model_type="qwen2", vocab_size=96, hidden_size=16, intermediate_size=21,
                   num_layers=2, num_heads=3, num_kv_heads=1, head_dim=4, attention_bias=True,
                   tie_word_embeddings=False)


def _config():
  c = base_config()
  c.rollout.num_prompts, c.rollout.num_samples = 4, 4  # 16 completions
  c.rollout.max_prefill_length, c.rollout.max_new_tokens = 32, 16  # rows of S = 48 tokens
  c.rollout.max_concurrent_decodes = 8
  c.algo.num_micro_batches = 2
  c.algo.packing = False  # the layout is set: step_flops reads the step's configuration
  c.algo.logprob_chunk = 8
  c.mesh.num_trainer_devices = 8
  c.mesh.trainer = (1, 4, 2)
  c.mesh.sampler = (1, 2, 2)  # one replica: the 4 chips of one v5p host
  return c
