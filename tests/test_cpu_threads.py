"""reasoning_rl/cpu_threads.py: the XLA CPU thread pool a simulated mesh's collectives need."""

import os

import pytest

from reasoning_rl import cpu_threads


@pytest.mark.parametrize("environ, devices", [
    ({}, 1),
    ({"XLA_FLAGS": "--xla_cpu_use_onednn=true"}, 1),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 8),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_dump_to=/tmp/d "
                   "--xla_force_host_platform_device_count=4"}, 4),
    ({"JAX_NUM_CPU_DEVICES": "6"}, 6),
    ({"JAX_NUM_CPU_DEVICES": "2", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 8),
])
def test_the_forced_device_count_is_read_from_xla_flags_and_jax(environ, devices):
  assert cpu_threads.forced_cpu_device_count(environ) == devices


@pytest.mark.parametrize("devices, cores, threads", [
    (1, 2, None),    # no collectives
    (8, 2, 16),      # this machine: XLA would give 8
    (2, 2, 4),
    (8, 12, 16),     # XLA would give 12
    (8, 16, None),   # XLA's own 16 suffice
    (4, 64, None),
])
def test_twice_the_devices_unless_the_cores_give_as_many(devices, cores, threads):
  assert cpu_threads.collective_thread_count(devices, cores) == threads


def test_the_pool_size_is_set_only_when_the_user_left_it_unset(monkeypatch):
  monkeypatch.setattr(os, "cpu_count", lambda: 2)
  flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  environ = dict(flags)
  cpu_threads.reserve_collective_threads(environ)
  assert environ["PJRT_NPROC"] == "16"
  for chosen in ({"PJRT_NPROC": "8"}, {"NPROC": "3"}):
    environ = {**flags, **chosen}
    cpu_threads.reserve_collective_threads(environ)
    assert environ == {**flags, **chosen}
  environ = {}
  cpu_threads.reserve_collective_threads(environ)
  assert environ == {}

