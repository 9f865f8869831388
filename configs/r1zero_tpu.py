"""DeepSeek-R1-Zero recipe (DeepSeek-AI 2025) on a Cloud TPU slice: RL straight from a base model.

Qwen2.5-7B base from a local Hugging Face directory; countdown (Gandhi et al. 2025 / TinyZero) and
GSM-style symbolic math (reasoning-gym gsm_symbolic); G = 16 samples per prompt; long completions;
a v5p-64 slice (32 chips on 8 hosts of 4) split by hosts: 4 trainer hosts (16 chips, FSDP 4 ×
tensor 4) and 4 sampler hosts, each sampler host its own replica (tensor 4) fed device to device
after every step (docs/multihost.md); KL k3 (β small); DAPO's clip-higher and
dynamic sampling (Yu et al. 2025); Dr. GRPO's length-unbiased aggregation (Liu et al. 2025).

  python launch/train.py --config=configs/r1zero_tpu.py --config.workdir=gs://…/run \
      --config.model.path=/mnt/models/Qwen2.5-7B
  python launch/train.py --config=configs/r1zero_tpu.py --config.dry_run=True   # memory plan
"""

import ml_collections

from reasoning_rl.config import base_config

# Qwen2.5-7B's published config.json: the dry run plans with it when model.path is not readable
# on the machine that prints the plan.
QWEN25_7B = dict(
    model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, tie_word_embeddings=False, max_position_embeddings=131072)


def get_config():
  c = base_config()
  c.total_steps = 1000
  c.model.path = "/mnt/models/Qwen2.5-7B"
  c.model.dtype = "bfloat16"  # compute; the trainer keeps float32 master weights and moments
  c.model.weight_dtype = "float32"  # (a 1e-6 AdamW step would be rounded away in bf16 weights)
  c.model.hf_config_for_planning = ml_collections.ConfigDict(QWEN25_7B)
  c.data.train = dict(kind="mixture", weights=(0.5, 0.5), sources=(
      dict(kind="reasoning_gym", name="countdown", seed=0, size=200_000),
      dict(kind="reasoning_gym", name="gsm_symbolic", seed=0, size=200_000)))
  c.data.eval = dict(kind="mixture", weights=(0.5, 0.5), sources=(
      dict(kind="reasoning_gym", name="countdown", seed=777, size=2_000),
      dict(kind="reasoning_gym", name="gsm_symbolic", seed=777, size=2_000)))
  c.data.template = "r1zero"
  c.rollout.num_prompts = 64
  c.rollout.num_samples = 16
  c.rollout.max_new_tokens = 4096
  c.rollout.max_prefill_length = 512
  c.rollout.max_concurrent_decodes = 512
  c.rollout.steps_per_call = 64
  c.rollout.temperature = 1.0
  c.rewards = {
      "correct": {"weight": 1.0, "verifier": "auto", "extract": "answer"},
      "format": {"weight": 0.1, "think_open_in_prompt": False},
      "length": {"weight": 1.0, "method": "dapo", "cache_len": 512},
  }
  c.verifier.num_workers = 16
  c.algo.estimator = "grpo"
  c.algo.kl_estimator = "k3"
  c.algo.epsilon_low = 0.2
  c.algo.epsilon_high = 0.28
  c.algo.loss_agg = "seq-mean-token-sum-norm"
  c.algo.num_micro_batches = 32  # 32 rows of 4.6k tokens per micro-batch, 8 per device
  c.algo.logprob_chunk = 256
  c.algo.remat = "full"  # 4.6k-token rows: keep one layer's attention scores, not 28
  c.beta = 0.001
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.01
  c.dynamic_sampling.enabled = True
  c.dynamic_sampling.max_rounds = 3
  # v5p-64 = 32 chips (JAX devices), 4 per host on 8 hosts; the split falls between hosts
  # 1024 rows per batch shard evenly over 4 FSDP groups (not over 6: 24 trainer chips would not
  # divide the batch); each replica's 4 chips divide the 16 trainer chips (the weight sync's rule)
  c.mesh.num_trainer_devices = 16  # hosts 0-3 train; hosts 4-7 sample
  # split slices: batch s + 1 is sampled while step s trains (async_rollouts.enabled unset = on
  # here), one policy version behind, corrected by truncated importance sampling
  c.async_rollouts.max_staleness = 1
  c.mesh.trainer = (1, -1, 4)  # fsdp 4 × tensor 4
  c.mesh.sampler = (-1, 1, 4)  # per sampler host (1, 1, 4): the dry run plans each replica so
  c.target.tpu, c.target.num_devices = "v5p", 32  # one v5p-64 slice
  # Spot gives 30 s of notice and a train step (~2 min) cannot be cut: a notice mid-step is lost
  # with the work since the last save. A time-based save every 10 min (asynchronous, ~11 s of
  # writes per trainer device in the plan) bounds that to ~14 min; every 25 steps alone was ~53.
  c.checkpoint.every_steps = 25
  c.checkpoint.every_minutes = 10
  c.checkpoint.keep = 3
  c.eval.every_steps = 25
  c.eval.num_examples = 512
  c.guards.max_kl = 0.5
  c.guards.min_entropy = 0.05
  return c
