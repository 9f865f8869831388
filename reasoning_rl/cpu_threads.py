"""Enough XLA CPU threads for a simulated multi-device mesh's collectives not to deadlock.

XLA's CPU client runs every program on one pool of max(cores, devices) threads (`PJRT_NPROC`
overrides the first term). A collective holds one thread per device until every device has
joined. Its thunk executor orders collectives by *start*, not by completion, so one device can
be inside a collective nested in a `conditional` or `while` (our empty-micro-batch skip, a
scanned layer stack) while its next top-level collective waits in the pool's queue. On a
2-core machine with 8 simulated devices the pool has exactly 8 threads. Seven devices then hold
them in the top-level collective, waiting for the eighth, whose share of it never gets a thread.
XLA aborts after its collective timeout. `configs/debug_cpu.py` with `model.scan_layers=True`
did so in 5 of 18 runs on 8 devices and 2 cores; with 16 threads, in none of 24.

`reserve_collective_threads()` sets `PJRT_NPROC` to twice the forced device count, so every
device can hold one thread in a nested collective and one in the next. It does nothing when
there is one device, when the machine has that many cores anyway, or when the user set
`PJRT_NPROC`/`NPROC`. It must run before JAX creates its CPU client (the first device query):
launch/train.py and launch/evaluate.py call it first thing (and tests/conftest.py, whose
settings the runs the tests start inherit).
"""

import os
import re

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def forced_cpu_device_count(environ) -> int:
  """The simulated CPU device count asked for: `XLA_FLAGS`' (the last one given) or JAX's
  `JAX_NUM_CPU_DEVICES`, else 1."""
  counts = _DEVICE_COUNT_FLAG.findall(environ.get("XLA_FLAGS", ""))
  jax_count = environ.get("JAX_NUM_CPU_DEVICES", "")
  return max(int(counts[-1]) if counts else 1, int(jax_count) if jax_count.isdigit() else 1)


def collective_thread_count(devices: int, cores: int) -> int | None:
  """The `PJRT_NPROC` to set for `devices` simulated devices on `cores` cores, or None when
  XLA's own pool (max(cores, devices) threads) already has 2 × devices."""
  wanted = 2 * devices
  return wanted if devices > 1 and max(cores, devices) < wanted else None


def reserve_collective_threads(environ=os.environ) -> None:
  """Sets `PJRT_NPROC` as the module docstring says, unless the user chose a pool size."""
  if "PJRT_NPROC" in environ or "NPROC" in environ:
    return
  threads = collective_thread_count(forced_cpu_device_count(environ), os.cpu_count() or 1)
  if threads is not None:
    environ["PJRT_NPROC"] = str(threads)
