"""The weight sync's buckets (packing round trip, a whole sync on one process, the trainer-side
cast) and its deadline (a stalled sampler process stops every process; a rerun resumes)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reasoning_rl import sharding
from reasoning_rl.errors import ExitCode
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model
from reasoning_rl.multihost import param_sync, runtime, sync_watch
from reasoning_rl.multihost.topology import Topology
from tests import multihost_runs as runs

# ------------------------------------------------------------------------------------ buckets


def test_buckets_group_by_dtype_split_at_the_size_and_round_trip_bit_identically():
  rng = np.random.default_rng(0)
  shards = [rng.standard_normal((3, 5)).astype(np.float32),
            rng.standard_normal((128,)).astype(jnp.bfloat16),
            rng.standard_normal((1, 128)).astype(np.float32),  # a Qwen-like tiny bias
            rng.standard_normal((64, 8)).astype(np.float32),  # 2048 bytes: more than a bucket
            rng.integers(-9, 9, (4, 2)).astype(np.int32),
            rng.standard_normal((2, 2, 2)).astype(np.float32)]
  avals = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shards]
  buckets = param_sync.plan_buckets(avals, bucket_bytes=1024)
  assert [(np.dtype(b.dtype).name, [s.leaf for s in b.slots]) for b in buckets] == [
      ("float32", [0, 2]), ("float32", [3]), ("float32", [5]), ("bfloat16", [1]),
      ("int32", [4])]
  assert [s.offset for s in buckets[0].slots] == [0, 15]
  flats = jax.jit(lambda *xs: param_sync.pack(xs, buckets))(*shards)
  assert [f.shape for f in flats] == [(143,), (512,), (8,), (128,), (8,)]
  back = jax.jit(lambda *fs: param_sync.unpack(fs, buckets))(*flats)
  assert len(back) == len(shards)
  for original, restored in zip(shards, back):
    assert restored.shape == original.shape and restored.dtype == original.dtype
    np.testing.assert_array_equal(np.asarray(restored).view(np.uint8),
                                  np.asarray(original).view(np.uint8))


def _tiny_params(dtype):
  config = ModelConfig(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       tie_word_embeddings=True, attention_bias=True)
  return nnx.state(create_model(config, seed=3, param_dtype=dtype), nnx.Param)


@pytest.mark.parametrize("trainer_dtype, sampler_dtype", [
    (jnp.float32, jnp.float32), (jnp.float32, jnp.bfloat16)], ids=["f32", "f32_to_bf16"])
def test_a_sync_inside_one_process_hands_the_replica_exactly_the_cast_parameters(
    trainer_dtype, sampler_dtype):
  """Trainer mesh on devices 0-3 (fsdp 4), one replica on devices 4-5 (tensor 2): the replica
  gets every leaf bit-identical to `params.astype(sampler dtype)`, sharded as its mesh wants,
  through a few buckets (tiny here, to force several) instead of one transfer per leaf."""
  devices = jax.devices()
  trainer_mesh = sharding.make_mesh((1, 4, 1), devices[:4])
  replica_mesh = sharding.make_mesh((1, 1, 2), devices[4:6])
  params = _tiny_params(trainer_dtype)
  params = jax.device_put(params, sharding.param_shardings(params, trainer_mesh))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, sampler_dtype), params)
  topology = Topology(process_index=0, num_processes=1, trainer_devices=tuple(devices[:4]),
                      replicas=(tuple(devices[4:6]),))
  sync = param_sync.ParamSync(abstract, topology, [replica_mesh], bucket_bytes=16 << 10)
  leaves = jax.tree.leaves(params)
  assert 1 < len(sync.buckets) < len(leaves)
  assert sync.num_transfers == 2 * len(sync.buckets)  # one per bucket and device pair
  received = sync.send(params)
  expected = jax.tree.leaves(jax.tree.map(lambda x: x.astype(sampler_dtype), params))
  wanted = jax.tree.leaves(sharding.param_shardings(abstract, replica_mesh))
  assert jax.tree.structure(received) == jax.tree.structure(params)
  for got, want, placement in zip(jax.tree.leaves(received), expected, wanted):
    assert got.dtype == sampler_dtype and got.shape == want.shape
    assert got.sharding.is_equivalent_to(placement, got.ndim)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))
  shard_bytes = [np.prod(p.shard_shape(x.shape)) * x.dtype.itemsize
                 for p, x in zip(wanted, expected)]
  assert sync.bytes_per_sync == 2 * sum(shard_bytes)  # what crosses: sampler-dtype shards


# ------------------------------------------------------------------------------------ deadline


class FakeStore:
  """The coordination service's key-value store as the processes' watches share it."""

  def __init__(self):
    self.values, self.condition, self.deleted = {}, threading.Condition(), []

  def key_value_set(self, key, value):
    with self.condition:
      self.values[key] = value
      self.condition.notify_all()

  def blocking_key_value_get(self, key, timeout_ms):
    with self.condition:
      if not self.condition.wait_for(lambda: key in self.values, timeout_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self.values[key]

  def key_value_dir_get(self, prefix):
    with self.condition:
      return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]

  def key_value_delete(self, key):
    with self.condition:
      self.deleted.append(key)
      self.values.pop(key, None)


def _watch(store, me, stops, *, number=1, deadline_s=30.0):
  def stop(reason, live):  # like runtime.stop_lost_run, which acts once per process
    if me not in [s[0] for s in stops]:
      stops.append((me, reason, list(live)))

  return sync_watch.SyncWatch(client=store, number=number, version=7, deadline_s=deadline_s,
                              deadline_text=f"{deadline_s:g} s", process_index=me,
                              num_processes=3, peers=[0, 1] if me == 2 else [2], stop=stop)


def test_a_sync_every_process_finished_returns_everywhere_and_drops_the_previous_keys():
  store, stops = FakeStore(), []
  watches = [_watch(store, me, stops, number=2) for me in range(3)]
  threads = [threading.Thread(target=w.confirm) for w in watches]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(30)
  assert stops == []
  assert sorted(store.values) == [f"reasoning_rl/sync/2/done/{p}" for p in range(3)]
  assert sorted(store.deleted) == [f"reasoning_rl/sync/1/done/{p}" for p in range(3)]


def test_past_the_deadline_the_line_names_the_sync_the_version_and_the_stalled_peer():
  """Processes 0 and 1 finished, process 2 never did: 0 and 1 stop naming process 2; process 2's
  own watchdog stops it naming the processes its transfers were waiting on."""
  store, stops = FakeStore(), []
  waiting = [_watch(store, me, stops, deadline_s=0.5) for me in (0, 1)]
  stalled = _watch(store, 2, stops, deadline_s=0.5)
  threads = [threading.Thread(target=w.confirm) for w in waiting]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(30)
  for watch in waiting + [stalled]:
    watch._thread.join(30)  # noqa: SLF001  (the watchdogs)
  head = "weight sync 1 (policy version 7) did not finish within its deadline of 0.5 s"
  assert sorted(stops) == [
      (0, f"{head}: waiting for process 2, which had not finished their part", [1, 2]),
      (1, f"{head}: waiting for process 2, which had not finished their part", [0, 2]),
      (2, f"{head}: this process's transfers with processes 0, 1 had not completed", [0, 1])]


def test_a_finished_sync_never_fires_its_watchdog():
  store, stops = FakeStore(), []
  watch = _watch(store, 0, stops, deadline_s=0.3)
  store.key_value_set("reasoning_rl/sync/1/done/1", "1")
  store.key_value_set("reasoning_rl/sync/1/done/2", "1")
  watch.confirm()
  watch._thread.join(30)  # noqa: SLF001
  assert stops == []


def test_the_deadline_is_a_floor_plus_the_bytes_at_a_bandwidth_floor(monkeypatch):
  devices = jax.devices()
  params = _tiny_params(jnp.float32)
  topology = Topology(process_index=0, num_processes=1, trainer_devices=tuple(devices[:4]),
                      replicas=(tuple(devices[4:6]),))
  replica_mesh = sharding.make_mesh((1, 1, 2), devices[4:6])
  sync = param_sync.ParamSync(params, topology, [replica_mesh], deadline_floor_s=60,
                              deadline_bytes_per_s=1e3)
  assert sync.deadline_s == 60 + sync.bytes_per_sync / 1e3
  monkeypatch.setenv(param_sync.FLOOR_ENV, "5")
  monkeypatch.setenv(param_sync.BYTES_PER_S_ENV, "1e9")
  sync = param_sync.ParamSync(params, topology, [replica_mesh])
  assert sync.deadline_s == 5 + sync.bytes_per_sync / 1e9
  assert sync.describe_deadline() == f"5 s = 5 s + {sync.bytes_per_sync / 1e6:.1f} MB at 1000 MB/s"


# ------------------------------------------------------------------- a real multi-process run


@pytest.mark.slow
def test_a_stalled_sampler_process_stops_every_process_and_a_rerun_resumes(tmp_path, monkeypatch):
  """3 processes: 0-1 train, 2 samples. Process 2 stalls in the sync of policy version 2 (it
  sleeps a day, as a hung transfer would leave it): every process stops at the 20 s deadline
  with exit code 5 and the line naming the sync and the peer, instead of waiting forever; a rerun
  on the same workdir resumes from step 1's checkpoint and runs step 2."""
  monkeypatch.setenv(param_sync.FLOOR_ENV, "20")
  monkeypatch.setenv(sync_watch.STALL_ENV, "2:2")
  workdir = tmp_path / "run"
  overrides = ["--config.total_steps=2", "--config.checkpoint.every_steps=1",
               "--config.eval.num_examples=4", "--config.mesh.num_trainer_devices=4"]
  processes = runs.start_processes(workdir, overrides, num_processes=3)
  codes = runs.wait_all(processes, timeout_s=400)
  logs = [(tmp_path / f"run.p{i}.log").read_text(errors="replace") for i in range(3)]
  assert codes == [ExitCode.LOST_PEER] * 3, "\n".join(l[-3000:] for l in logs)
  head = "weight sync 2 (policy version 2) did not finish within its deadline of 20 s"
  for index, log in enumerate(logs):
    lines = [line for line in log.splitlines() if line.startswith(f"error: process {index}: ")]
    assert len(lines) == 1 and head in lines[0], log[-3000:]
    # the trainers wait for process 2; process 2's replica pulls from copy 0, on process 0
    assert (": this process's transfers with process 0 had not completed;" if index == 2 else
            ": waiting for process 2, which had not finished their part;") in lines[0]
  assert [r["step"] for r in runs.metrics_rows(workdir)] == [1]
  monkeypatch.delenv(sync_watch.STALL_ENV)
  processes = runs.start_processes(workdir, overrides, num_processes=3)
  assert runs.wait_all(processes, timeout_s=400) == [0, 0, 0]
  assert [r["step"] for r in runs.metrics_rows(workdir)] == [1, 2]
