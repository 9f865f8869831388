"""The dry-run plan against what the real programs hold, for small split runs on CPU.

A split run laid out as four "hosts" of two CPU devices (the 8 devices conftest.py asks for): two
hosts train (devices 0-3), two each run a sampler replica (devices 4-5 and 6-7) with its own
engine holding every decode slot. Mixed precision as the project runs it: float32 master
weights, bfloat16 compute, the sampler's weights and KV cache in bfloat16.

What is compared, per device:
- trainer: master weights, AdamW moments and the reference against the live shards of the real
  `TrainStep` state (exact), and the whole step (held + its transients) against XLA's
  `memory_analysis()` of the compiled step, within 25 %;
- sampler: its weights, KV cache and next-token logits against the live shards of a real `Engine`
  on a replica's mesh (exact), and against the arguments of the compiled decode program (within
  25 %: the rest of the decode state is small vectors);
- weight sync: what the trainer sends per device is, by `multihost.param_sync`'s construction,
  one replica device's shards in the sampler dtype (its send mesh lays the trainer devices out as
  copies of the replica mesh): checked against the engine's live shards and the sync's buckets.
  (The temporaries of the reshard to the send layout are not planned: see
  `memory_plan.sync_items`.)
The activation coefficients (`memory_plan.Assumptions`) are fitted at larger shapes
(tests/test_planning.py); at these tiny shapes only the step's total is held to 25 % (measured:
planned 0.94 of XLA's figure). Not held to a ratio: the planned decode temporaries (logits and
attention scores of one step), tiny here next to XLA's fixed overheads. What the plan relies on
is checked instead: the decode program updates the KV cache in place, holding no second copy of
it. That holds for a float32 cache; with a bfloat16 cache XLA:CPU keeps 2-2.6x the cache as
temporaries (its buffer assignment shows each layer's K and V converted to float32, scattered
and converted back: XLA:CPU scatters bfloat16 through float32), which TPUs, with native
bfloat16, are not expected to need; the plan does not count it.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from reasoning_rl import memory_plan, planning, sharding
from reasoning_rl.build import step_config
from reasoning_rl.config import base_config
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model

MODEL = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True,
                    tie_word_embeddings=False)
TARGET = {"tpu": "cpu", "num_devices": 8, "devices_per_host": 2}

CASES = {  # trainer mesh, replica mesh, micro-batches, beta
    "fsdp 2 x tensor 2, 2 micro-batches / replica tensor 2": ((1, 2, 2), (1, 1, 2), 2, 0.0),
    "fsdp 4 / replica data 2": ((1, 4, 1), (2, 1, 1), 1, 0.0),
}
TRAINER_CASES = list(CASES)[:1]  # one compiled step (13-29 s on 2 shared cores) is enough


def _config(trainer, replica, micro, beta):
  c = base_config()
  c.model.dtype = "bfloat16"  # compute; the master weights stay float32 (model.weight_dtype)
  c.rollout.num_prompts, c.rollout.num_samples = 4, 4
  c.rollout.max_prefill_length, c.rollout.max_new_tokens = 16, 16
  c.rollout.max_concurrent_decodes, c.rollout.steps_per_call = 8, 4
  c.algo.num_micro_batches, c.beta, c.algo.logprob_chunk = micro, beta, 16
  c.algo.packing = False  # XLA is read on the padded step
  c.mesh.num_trainer_devices, c.mesh.trainer, c.mesh.sampler = 4, trainer, replica
  return c


def _shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of arrays (each leaf's first addressable shard)."""
  return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("case", TRAINER_CASES)
def test_trainer_plan_matches_the_real_step(case):
  from reasoning_rl.rl.step import TrainStep

  trainer_shape, replica_shape, micro, beta = CASES[case]
  c = _config(trainer_shape, replica_shape, micro, beta)
  plan = planning.plan(c, MODEL, target=TARGET)
  trainer = plan.slice("trainer")
  assert plan.slice("sampler").num_replicas == 2

  mesh = sharding.make_mesh(trainer_shape, jax.devices()[:4], field="mesh.trainer")
  graphdef, params = nnx.split(create_model(MODEL, seed=0, dtype=jnp.bfloat16,
                                            param_dtype=jnp.float32))
  reference = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params) if beta > 0 else None
  step = TrainStep(graphdef, step_config(c), mesh)
  state = step.init_state(params, ref_params=reference)
  assert _shard_bytes(state.params) == trainer.item("master weights")
  assert _shard_bytes(state.opt_state) == pytest.approx(trainer.item("AdamW moments"), abs=64)
  if beta > 0:
    assert _shard_bytes(state.ref_params) == trainer.item("reference weights")

  rows, length = 16, 32
  batch = dict(tokens=jnp.zeros((rows, length), jnp.int32),
               attention_mask=jnp.ones((rows, length), jnp.int32),
               completion_mask=jnp.ones((rows, 16), jnp.int32),
               advantages=jnp.ones((rows,), jnp.float32),
               # split runs sample ahead by default and correct against the sampler's log-probs
               behavior_logprobs=jnp.zeros((rows, 16), jnp.float32))
  analysis = step.compile(state, batch).lower(state, batch).compile().memory_analysis()
  batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch)) // 4  # rows over data x fsdp = 4
  assert analysis.argument_size_in_bytes - batch_bytes == pytest.approx(trainer.held, rel=0.01)
  held = (analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
          + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
  in_step = trainer.held + trainer.phase_bytes("train step")
  assert in_step == pytest.approx(held, rel=0.25), (in_step, held)


@pytest.mark.parametrize("case", list(CASES))
def test_sampler_plan_matches_a_replicas_engine_and_what_the_sync_sends(case):
  from reasoning_rl.build import build_engine

  trainer_shape, replica_shape, micro, beta = CASES[case]
  c = _config(trainer_shape, replica_shape, micro, beta)
  plan = planning.plan(c, MODEL, target=TARGET)
  sampler, trainer = plan.slice("sampler"), plan.slice("trainer")
  devices = jax.devices()
  mesh = sharding.make_mesh(replica_shape, devices[4:6], field="mesh.sampler")
  model = create_model(MODEL, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  engine = build_engine(c, model, mesh=mesh)
  assert engine.max_concurrent_decodes == 8  # each replica holds every slot
  state = engine.init_decode_state()
  weights = _shard_bytes(engine.params)
  assert weights == sampler.item("weights")
  assert _shard_bytes(state.cache) == sampler.item("KV cache")
  assert _shard_bytes(state.next_logits) == sampler.item("next-token logits")
  # the trainer sends, and the replica receives, one replica device's shards per device
  assert trainer.item("weights to send") == sampler.item("weights received") == weights

  generate = engine._generate_fn.lower(engine.params, state, jnp.bool_(False),
                                       key_length=engine.cache_length).compile()
  analysis = generate.memory_analysis()
  assert analysis.argument_size_in_bytes == pytest.approx(sampler.held, rel=0.25), (
      analysis.argument_size_in_bytes, sampler.held)

  from reasoning_rl.multihost.param_sync import ParamSync
  from reasoning_rl.multihost.topology import Topology

  topology = Topology(process_index=0, num_processes=1, trainer_devices=tuple(devices[:4]),
                      replicas=(tuple(devices[4:6]), tuple(devices[6:8])))
  replica_meshes = [mesh, sharding.make_mesh(replica_shape, devices[6:8], field="mesh.sampler")]
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.state(model))
  sync = ParamSync(abstract, topology, replica_meshes)
  assert sync.num_copies == 2  # the 4 trainer devices as two copies of a replica's 2
  assert sum(b.nbytes for b in sync.buckets) == trainer.item("weights to send")
  # packing holds the laid-out shards and the buckets at once
  assert trainer.phase_bytes("weight sync") == 2 * sum(b.nbytes for b in sync.buckets)


def test_the_decode_program_updates_the_kv_cache_in_place():
  """The plan counts one KV cache per replica device and per-step temporaries far smaller than
  it: the compiled decode program must not hold a second copy of the cache (float32 cache, 32
  slots x 128 tokens; see the module docstring for bfloat16 on XLA:CPU)."""
  from reasoning_rl.build import build_engine

  c = _config((1, 2, 2), (1, 1, 2), 1, 0.0)
  c.model.dtype = "float32"
  c.rollout.max_concurrent_decodes, c.rollout.max_new_tokens = 32, 112
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[4:5], field="mesh.sampler")
  engine = build_engine(c, create_model(MODEL, seed=0), mesh=mesh)
  state = engine.init_decode_state()
  cache = _shard_bytes(state.cache)
  assert cache == memory_plan.kv_cache_bytes(c, MODEL, mesh.abstract_mesh, 32)
  analysis = engine._generate_fn.lower(engine.params, state, jnp.bool_(False),
                                       key_length=engine.cache_length).compile().memory_analysis()
  assert analysis.temp_size_in_bytes < 0.5 * cache, (analysis.temp_size_in_bytes, cache)
  assert analysis.alias_size_in_bytes >= cache  # the donated state's cache is the output's
