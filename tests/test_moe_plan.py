"""The planner and the FLOP model on mixtures of experts: active parameters per token, expert-
sharded memory, the token exchange of expert parallelism, and configs/r1zero_moe_tpu.py's plan
(Qwen3-30B-A3B on a v5p-64), each against a hand computation."""

import sys

import ml_collections

from reasoning_rl import flops, planning
from reasoning_rl.models.config import ModelConfig

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from configs import r1zero_moe_tpu  # noqa: E402  pylint: disable=wrong-import-position

Q = r1zero_moe_tpu.QWEN3_30B_A3B
D, F, E, K, L, V = (Q["hidden_size"], Q["moe_intermediate_size"], Q["num_experts"],
                    Q["num_experts_per_tok"], Q["num_hidden_layers"], Q["vocab_size"])
HEADS, KV, HD = Q["num_attention_heads"], Q["num_key_value_heads"], Q["head_dim"]
ATTENTION = D * HD * 2 * (HEADS + KV)  # q, o; k, v
EXPERTS = E * 3 * D * F
ROUTER = D * E
NORMS = 2 * D + 2 * HD  # input / post-attention norms, q / k norms


def _model() -> ModelConfig:
  return ModelConfig.from_hf_config(dict(Q))


def test_parameters_total_and_active_by_hand():
  m = _model()
  total = L * (ATTENTION + EXPERTS + ROUTER + NORMS) + 2 * V * D + D
  active = L * (ATTENTION + K * 3 * D * F + ROUTER + NORMS) + 2 * V * D + D
  assert m.num_params() == total and m.num_params(active=True) == active
  assert round(total / 1e9, 1) == 30.5 and int(active / 1e8) == 33  # the card: 30.5 B, 3.3 B


def test_flops_count_the_active_experts():
  m = _model()
  assert flops.matmul_weights(m) == L * (ATTENTION + K * 3 * D * F + ROUTER)
  assert flops.forward_flops(m, 1, 0, projected_tokens=0) == 2 * L * (
      ATTENTION + K * 3 * D * F + ROUTER)


def test_r1zero_moe_plan_on_a_v5p_64_by_hand():
  c = r1zero_moe_tpu.get_config()
  plan = planning.plan(c, _model(), target=dict(c.target))
  assert plan.fits
  trainer = plan.slice("trainer")
  assert dict(trainer.mesh.shape) == {"data": 1, "fsdp": 4, "expert": 4, "tensor": 1}
  # experts split over expert (4) and their embedding dim over fsdp (4): 1/16 each; every other
  # matrix over fsdp alone (tensor is 1); the norms replicated
  per_device = (L * EXPERTS / 16 + (L * (ATTENTION + ROUTER) + 2 * V * D) / 4
                + L * NORMS + D) * 4
  assert trainer.by_name()["master weights (float32)"] == int(per_device)
  # the expert exchange: 48 sparse layers x (2 passes per update + the reference
  # forward) x all-gather + reduce-scatter, 3 peers' tokens of hidden width in bfloat16
  tokens_per_device = 64 * 16 * (512 + 4096) / 16
  forwards = 2 * 1 + 1  # μ = 1 (π_old is the forward itself: no extra pass); β > 0: reference
  expected = L * forwards * 2 * 3 * tokens_per_device * D * 2
  t = plan.throughput
  assert t.expert_bytes_per_device == expected
  assert abs(t.expert_s - expected / 600e9) < 1e-9
  assert "3.353 B active" in plan.model_summary
  assert "tokens exchanged along the expert axis" in plan.table()


def test_a_dense_plan_has_no_expert_exchange():
  c = r1zero_moe_tpu.get_config()
  c.mesh.trainer = (1, -1, 4)
  dense = ModelConfig.from_hf_config(dict(c.model.hf_config_for_planning, model_type="qwen3"))
  plan = planning.plan(c, dense, target=dict(c.target))
  assert plan.throughput.expert_bytes_per_device == 0
  assert "expert" not in plan.slice("trainer").mesh.axis_names
  assert isinstance(c.model.hf_config_for_planning, ml_collections.ConfigDict)
