"""The DeepSeek-R1-Zero recipe (configs/r1zero_tpu.py) on a mixture of experts: Qwen3-30B-A3B base
(30.5 B parameters, 3.3 B active: top-8 of 128 experts in each of its 48 layers) on a Cloud TPU
v5p slice, with rollout routing replay (R3, Ma et al. 2025: the trainer routes every token
through the experts the sampler chose; docs/moe.md) and the trainer's experts split over an
expert mesh axis.

Slice: v5p-64 (32 chips on 8 hosts of 4), the smallest v5p slice the plan fits: 4 trainer hosts
(16 chips: FSDP 4 x expert 4, 67 % of usable HBM at the peak) and 4 sampler hosts, each its own
replica (tensor 4, 82 %), fed device to device after every step. On a v5p-32 the trainer's 8
chips would need 99 GiB each (over by 14). The dry run prints the memory and time of each slice
(benchmarks/RESULTS.md, "Planning Qwen3-30B-A3B").

  python launch/train.py --config=configs/r1zero_moe_tpu.py --config.workdir=gs://…/run \
      --config.model.path=/mnt/models/Qwen3-30B-A3B-Base
  python launch/train.py --config=configs/r1zero_moe_tpu.py --config.dry_run=True
"""

import ml_collections

from configs import r1zero_tpu

# Qwen3-30B-A3B's published config.json (the fields the architecture needs): the dry run plans
# with it when model.path is not readable on the machine that prints the plan.
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, tie_word_embeddings=False, max_position_embeddings=40960)


def get_config():
  c = r1zero_tpu.get_config()
  c.model.path = "/mnt/models/Qwen3-30B-A3B-Base"
  c.model.hf_config_for_planning = ml_collections.ConfigDict(QWEN3_30B_A3B)
  c.algo.routing_replay = True
  # 4.6k-token rows carry 48 x 8 expert ids each: a rollout record would hold ~1.8 MB of them
  c.logging.rollout_experts = False
  c.rollout.max_concurrent_decodes = 256  # per replica: 256 x 4.6k tokens of KV fit beside it
  c.mesh.num_trainer_devices = 16  # hosts 0-3 train; hosts 4-7 sample
  c.mesh.trainer = (1, -1, 4, 1)  # fsdp 4 x expert 4: each device holds 32 of 128 experts
  c.mesh.sampler = (-1, 1, 4)  # per sampler host (1, 1, 4)
  c.algo.num_micro_batches = 32
  c.target.tpu, c.target.num_devices = "v5p", 32  # one v5p-64 slice
  return c
