"""Process flags from the environment a TPU host gets, for processes that see no TPU.

On a Cloud TPU VM JAX reads the slice's workers from the VM's metadata, and in a GKE TPU pod from
`TPU_WORKER_HOSTNAMES` / `TPU_WORKER_ID` (which JobSet / GKE inject), but only once it found TPU
chips on the machine (jax/_src/cloud_tpu_init.py sets `running_in_cloud_tpu_vm` only then; the
cluster classes in jax/_src/clusters/cloud_tpu_cluster.py ask for it). The local stand-ins of a
slice (tests/fake_gcloud.py, tests/jobset_runner.py: one CPU process per TPU host, with the
variables a host gets) need the same variables read here: the coordinator is the first host, on
`JAX_COORDINATOR_PORT` or JAX's TPU default 8482, as JAX itself would choose.

Multi-slice runs (several slices joined over the data-center network, "Multislice") add
`MEGASCALE_NUM_SLICES`, `MEGASCALE_SLICE_ID` and `MEGASCALE_COORDINATOR_ADDRESS` (slice 0's first
host); `TPU_WORKER_HOSTNAMES` / `TPU_WORKER_ID` then describe the host's own slice. Processes are
numbered slice by slice, process id = slice id × hosts per slice + worker id, and the coordinator
is the MEGASCALE coordinator's host, as in JAX's cloud_tpu_cluster.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from reasoning_rl.errors import ConfigError
from reasoning_rl.multihost.runtime import ProcessFlags

JAX_TPU_COORDINATOR_PORT = 8482  # jax/_src/clusters/cloud_tpu_cluster.py's default


def _integer(environ: Mapping[str, str], name: str, default: int) -> int:
  value = environ.get(name, "")
  if not value:
    return default
  if not value.strip().isdigit():
    raise ConfigError(f"{name}={value!r}: the host's environment must give a non-negative "
                      "integer")
  return int(value)


def flags_from_tpu_environment(environ: Mapping[str, str] = os.environ) -> ProcessFlags:
  """The flags `TPU_WORKER_HOSTNAMES` (comma-separated, ordered by worker id), `TPU_WORKER_ID` and,
  on several slices, the `MEGASCALE_*` variables imply; empty flags when they describe a single
  process."""
  hostnames = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
  worker_id = environ.get("TPU_WORKER_ID")
  num_slices = _integer(environ, "MEGASCALE_NUM_SLICES", 1)
  if not hostnames or worker_id is None or num_slices < 1:
    return ProcessFlags()
  slice_id = _integer(environ, "MEGASCALE_SLICE_ID", 0) if num_slices > 1 else 0
  if num_slices * len(hostnames) < 2:
    return ProcessFlags()
  if slice_id >= num_slices:
    raise ConfigError(f"MEGASCALE_SLICE_ID={slice_id}: must be below MEGASCALE_NUM_SLICES="
                      f"{num_slices}")
  worker = _integer(environ, "TPU_WORKER_ID", 0)
  port = _integer(environ, "JAX_COORDINATOR_PORT", JAX_TPU_COORDINATOR_PORT)
  coordinator_host = hostnames[0]
  if num_slices > 1 and environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
    # "host" or "host:port" (the port is the DCN transport's, not the JAX coordinator's)
    coordinator_host = environ["MEGASCALE_COORDINATOR_ADDRESS"].rsplit(":", 1)[0]
  process_id = slice_id * len(hostnames) + worker
  own_host = hostnames[worker] if worker < len(hostnames) else hostnames[0]
  return ProcessFlags(coordinator_address=f"{coordinator_host}:{port}",
                      num_processes=num_slices * len(hostnames), process_id=process_id,
                      transfer_address=f"{own_host}:{port + 1 + process_id}",
                      num_slices=num_slices)
