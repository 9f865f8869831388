"""Several TPU slices: the hosts' environment, which device belongs to which slice, the trainer's
mesh stacked along `data`, the roles, the config checks and the dry run's DCN traffic.

The end-to-end run of slices as local processes lives in the launcher's tests (tests/test_gcp_*).
"""

import dataclasses

import jax
import numpy as np
import pytest

from reasoning_rl import config as config_lib
from reasoning_rl import planning, sharding
from reasoning_rl.errors import ConfigError
from reasoning_rl.multihost.topology import make_topology
from reasoning_rl.multihost.tpu_env import flags_from_tpu_environment
from reasoning_rl.rl.step_config import StepConfig
from tests.support.configs import TINY, _config
from tests.support.steps import assert_same_gradient, make_batch, step_gradient


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  process_index: int
  slice_index: int | None = None


def host_environment(slice_id, worker, *, hosts=2, slices=2, coordinator="h-0-0:8080"):
  return {"TPU_WORKER_HOSTNAMES": ",".join(f"h-{slice_id}-{w}" for w in range(hosts)),
          "TPU_WORKER_ID": str(worker), "MEGASCALE_NUM_SLICES": str(slices),
          "MEGASCALE_SLICE_ID": str(slice_id), "MEGASCALE_COORDINATOR_ADDRESS": coordinator}


def test_hosts_of_several_slices_are_numbered_slice_by_slice():
  flags = [flags_from_tpu_environment(host_environment(s, w)) for s in (0, 1) for w in (0, 1)]
  assert [f.process_id for f in flags] == [0, 1, 2, 3]
  assert {f.num_processes for f in flags} == {4} and {f.num_slices for f in flags} == {2}
  # every process meets at slice 0's first host, on JAX's TPU coordinator port (not DCN's 8080)
  assert {f.coordinator_address for f in flags} == {"h-0-0:8482"}
  assert flags[3].transfer_address == "h-1-1:8486"  # its own host, a port unique per process
  for f in flags:
    f.check()
  one_host_each = flags_from_tpu_environment(host_environment(1, 0, hosts=1))
  assert (one_host_each.process_id, one_host_each.num_processes) == (1, 2)
  with pytest.raises(ConfigError, match="MEGASCALE_SLICE_ID=2"):
    flags_from_tpu_environment(host_environment(2, 0))
  single = host_environment(0, 0, hosts=1, slices=1)
  assert not flags_from_tpu_environment(single).given  # one host of one slice: one process


def test_device_slices_come_from_the_devices_or_equal_groups():
  assert sharding.device_slice_ids(jax.devices(), 2) == [0] * 4 + [1] * 4
  assert sharding.device_slice_ids(jax.devices()) == [0] * 8
  # several processes: whole processes per slice, never a host cut in two
  devices = [FakeDevice(i, i // 2) for i in range(8)]
  assert sharding.device_slice_ids(devices, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
  assert sharding.device_slice_ids(devices, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
  with pytest.raises(ConfigError, match="config.mesh.num_slices=3"):
    sharding.device_slice_ids(devices, 3)
  # TPU devices of a multi-slice run say it themselves
  tpu = [FakeDevice(i, i // 4, slice_index=i // 8) for i in range(16)]
  assert sharding.count_slices(tpu) == 2 and sharding.count_slices(tpu, 2) == 2
  with pytest.raises(ConfigError, match="leave it 0"):
    sharding.count_slices(tpu, 4)


def test_the_mesh_stacks_slices_along_data():
  mesh = sharding.make_mesh((1, 2, 2), jax.devices(), num_slices=2, field="config.mesh.trainer")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  slice_ids = dict(zip(jax.devices(), sharding.device_slice_ids(jax.devices(), 2)))
  for index, expected in ((0, 0), (1, 1)):
    assert {slice_ids[d] for d in mesh.devices[index].flat} == {expected}
  # -1 takes what one slice leaves; the slices multiply data
  assert sharding.multi_slice_mesh_shape((1, -1, 1), 8, 2) == (2, 4, 1)
  assert sharding.multi_slice_mesh_shape((2, -1, 2), 16, 4) == (8, 1, 2)
  with pytest.raises(ConfigError, match="config.mesh.trainer"):
    sharding.multi_slice_mesh_shape((1, 8, 1), 8, 2, field="config.mesh.trainer")


def test_a_step_on_two_slices_takes_the_single_device_gradient_and_keeps_weights_per_slice():
  batch = make_batch()
  config = StepConfig(learning_rate=1e-3, beta=0.05, loss_agg="token-mean", num_micro_batches=2)
  single, single_stats = step_gradient(config, batch, ref_seed=1)
  mesh = sharding.make_mesh((1, 2, 2), jax.devices(), num_slices=2)
  sliced, sliced_stats = step_gradient(config, batch, mesh=mesh, ref_seed=1)
  assert_same_gradient(sliced, single)
  assert sliced_stats["loss"] == pytest.approx(single_stats["loss"], abs=1e-5)
  # No parameter is split across slices: each slice holds every weight (fsdp / tensor inside
  # it), so only the gradient reduction over `data` has to cross the data-center network.
  from tests.support.steps import fresh_params

  _, params = fresh_params()
  for spec in jax.tree.leaves(sharding.param_shardings(params, mesh),
                              is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding)):
    assert "data" not in jax.tree.leaves(tuple(spec.spec)), spec


def test_the_trainer_takes_part_of_a_slice_or_whole_slices():
  devices = [FakeDevice(i, i // 2) for i in range(8)]  # 4 processes of 2 devices, 2 slices
  colocated = make_topology(0, devices, process_index=0, num_processes=4, num_slices=2)
  assert colocated.trainer_num_slices == 2 and len(colocated.replicas) == 4
  split = make_topology(4, devices, process_index=0, num_processes=4, num_slices=2)
  assert split.trainer_num_slices == 1 and split.trainer_processes == (0, 1)
  assert [r[0].process_index for r in split.replicas] == [2, 3]  # slice 1 samples
  with pytest.raises(ConfigError, match="num_trainer_devices=6: covers 1 slices"):
    make_topology(6, devices, process_index=0, num_processes=4, num_slices=2)
  one_process = make_topology(0, jax.devices(), process_index=0, num_processes=1, num_slices=2)
  assert one_process.trainer_num_slices == 2


def test_config_checks_the_per_slice_trainer_mesh():
  from configs import debug_cpu

  c = debug_cpu.get_config()
  c.workdir = "/tmp/unused"
  c.rollout.num_prompts, c.rollout.num_samples = 4, 2
  c.mesh.trainer = (1, 4, 1)  # one slice's mesh: 2 slices of 4 devices
  config_lib.validate(c, num_devices=8, num_slices=2)
  with pytest.raises(ConfigError, match="config.mesh.trainer"):
    config_lib.validate(c, num_devices=8, num_slices=1)
  c.rollout.num_prompts = 3  # 6 completions over data 2 x fsdp 4
  with pytest.raises(ConfigError, match="data x fsdp = 2 x 4"):
    config_lib.validate(c, num_devices=8, num_slices=2)


def test_dry_run_counts_the_gradient_all_reduces_over_dcn():
  c = _config()
  c.mesh.num_trainer_devices = 0  # colocated: the trainer spans every slice
  c.mesh.trainer = (1, 4, 2)
  c.mesh.sampler = (1, 2, 2)
  c.algo.num_mini_batches = 2
  one = planning.plan(c, TINY, target={"tpu": "v5p", "num_devices": 8})
  four = planning.plan(c, TINY, target={"tpu": "v5p", "num_devices": 8, "num_slices": 4})
  assert dict(four.slice("shared").mesh.shape) == {"data": 4, "fsdp": 4, "tensor": 2}
  # weights per device as on one slice: nothing is split across slices
  assert four.slice("shared").item("trainer: master weights") == \
      one.slice("shared").item("trainer: master weights")
  t = four.throughput
  # 2 updates x 2 micro-batches; each all-reduces the 1264-element float32 gradient shard of the
  # (1, 4, 2) mesh (tests/test_planning.py) with 3 peers: 2 (k - 1) / k = 1.5 of it
  assert t.dcn_reductions == 4
  assert t.dcn_bytes_per_device == pytest.approx(4 * 1264 * 4 * 1.5)
  assert t.dcn_s == pytest.approx(t.dcn_bytes_per_device / (50e9 / 8))
  assert one.throughput.dcn_reductions == 0 and one.throughput.dcn_s == 0
  assert "gradient all-reduce(s) across slices over DCN" in four.table()
  assert "= 4 slices of v5p-16" in four.table()
  with pytest.raises(ConfigError, match="target.num_slices=0"):
    planning.plan(c, TINY, target={"tpu": "v5p", "num_devices": 8, "num_slices": 0})


def test_the_split_trainer_of_two_slices_is_one_whole_slice():
  c = _config()  # 8 trainer chips of a v5p-16 (2 hosts), 2 sampler hosts
  p = planning.plan(c, TINY, target={"tpu": "v5p", "num_devices": 16, "num_slices": 2})
  assert p.num_devices == 32 and p.num_processes == 8
  assert dict(p.slice("trainer").mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  assert p.slice("sampler").num_replicas == 6  # slice 0's 2 other hosts + slice 1's 4
  assert p.throughput.dcn_reductions == 0
  c.mesh.num_trainer_devices = 20
  with pytest.raises(ConfigError, match="a multiple of 16"):
    planning.plan(c, TINY, target={"tpu": "v5p", "num_devices": 16, "num_slices": 2})
  np.testing.assert_equal(p.slice("trainer").item("master weights"), 1264 * 4)
