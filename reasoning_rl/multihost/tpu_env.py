"""Process flags from the environment a TPU host gets, for processes that see no TPU.

On a Cloud TPU VM JAX reads the slice's workers from the VM's metadata, and in a GKE TPU pod from
`TPU_WORKER_HOSTNAMES` / `TPU_WORKER_ID` (which JobSet / GKE inject), but only once it found TPU
chips on the machine (jax/_src/cloud_tpu_init.py sets `running_in_cloud_tpu_vm` only then; the
cluster classes in jax/_src/clusters/cloud_tpu_cluster.py ask for it). The local stand-ins of a
slice (tests/fake_gcloud.py, tests/jobset_runner.py: one CPU process per TPU host, with the
variables a host gets) need the same variables read here: the coordinator is the first host, on
`JAX_COORDINATOR_PORT` or JAX's TPU default 8482, as JAX itself would choose.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from reasoning_rl.multihost.runtime import ProcessFlags

JAX_TPU_COORDINATOR_PORT = 8482  # jax/_src/clusters/cloud_tpu_cluster.py's default


def flags_from_tpu_environment(environ: Mapping[str, str] = os.environ) -> ProcessFlags:
  """The flags `TPU_WORKER_HOSTNAMES` (comma-separated, ordered by worker id) and `TPU_WORKER_ID`
  imply; empty flags when they are absent or name one host (a single-process run)."""
  hostnames = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
  worker_id = environ.get("TPU_WORKER_ID")
  if len(hostnames) < 2 or worker_id is None:
    return ProcessFlags()
  port = int(environ.get("JAX_COORDINATOR_PORT") or JAX_TPU_COORDINATOR_PORT)
  process_id = int(worker_id)
  host = hostnames[process_id] if 0 <= process_id < len(hostnames) else hostnames[0]
  return ProcessFlags(coordinator_address=f"{hostnames[0]}:{port}",
                      num_processes=len(hostnames), process_id=process_id,
                      transfer_address=f"{host}:{port + 1 + process_id}")
