"""Joining a multi-process run: `jax.distributed.initialize` plus what our runs need around it.

A run spans processes either because the launcher got the three flags
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (any machines, e.g. several
local processes on a laptop or a CPU CI box), or because JAX detects a cluster on its own (Cloud TPU
VMs, GKE TPU pods, Slurm, ...), in which case no flag is needed. Single-process runs never call
anything here that changes behaviour.

Around the initialize call:
- cross-host device transfers (weights from trainer to sampler hosts) need a socket for backends
  without their own transport (CPU, GPU): `jax_cross_host_transfer_socket_address` is set to
  `--transfer_address`, or derived from the coordinator address;
- a lost process must stop the others quickly and clearly rather than leave them waiting in a
  collective or a queue: the runtime runs in JAX's recoverable mode (a peer's death does not abort
  the others from inside C++), with a short heartbeat timeout, and a watcher thread polls which
  processes are alive and ends this process with one line naming the lost one and exit code
  `ExitCode.LOST_PEER`. Process 0 hosts the coordination service, so it leaves last: it waits
  (bounded) until the others announce that they are stopping. An error that a lost peer caused in
  the main thread (a wait or collective that lost its partner) ends the same way. If the lost process is process 0, which hosts the coordination service,
  JAX itself terminates the others at once with a message naming the coordination service.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence

from reasoning_rl.errors import ConfigError, ExitCode

log = logging.getLogger("reasoning_rl")

# Seconds without a heartbeat after which the coordination service declares a process dead, by
# default (`--heartbeat_timeout_s`); the watcher notices within one poll after that, well inside a
# 60 s budget.
HEARTBEAT_TIMEOUT_S = 30
_WATCH_PERIOD_S = 1.0
_LEAVE_GRACE_S = 3.0
_STOP_WAIT_S = 30.0  # how long process 0 keeps the service up for the others to stop (a
# loaded 2-core machine took over 10 s to get a live process there: it then aborted, not exited 5)
_stopping = threading.Lock()  # held by the one thread that ends a process for a lost peer
_finished = threading.Event()  # set once every process reached the end: peers may then leave


@dataclasses.dataclass(frozen=True)
class ProcessFlags:
  """The launcher flags of a multi-process run (all None: single process or auto-detected)."""

  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  transfer_address: str | None = None
  # Slices the processes form when a TPU host's environment says so (MEGASCALE_NUM_SLICES; see
  # multihost/tpu_env.py); None: one slice, or the devices say it themselves (slice_index).
  num_slices: int | None = None
  # Seconds without a heartbeat before a process counts as lost and every other one stops (exit
  # 5): shorter finds a dead host sooner, longer rides out a stalled network or a busy host.
  heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S

  @property
  def given(self) -> bool:
    return any(v is not None for v in (self.coordinator_address, self.num_processes,
                                       self.process_id))

  def check(self) -> None:
    """One ConfigError naming the flag when the three flags are incomplete or inconsistent."""
    if not 2 <= self.heartbeat_timeout_s <= 3600:
      raise ConfigError(f"--heartbeat_timeout_s={self.heartbeat_timeout_s}: must be in 2..3600 "
                        f"seconds (default {HEARTBEAT_TIMEOUT_S})")
    if not self.given:
      if self.transfer_address is not None:
        raise ConfigError("--transfer_address: only meaningful with --coordinator_address, "
                          "--num_processes and --process_id")
      return
    missing = [name for name, value in (("--coordinator_address", self.coordinator_address),
                                        ("--num_processes", self.num_processes),
                                        ("--process_id", self.process_id)) if value is None]
    if missing:
      raise ConfigError(f"{', '.join(missing)}: missing; a multi-process run needs all three of "
                        "--coordinator_address=HOST:PORT --num_processes=N --process_id=I")
    host, _, port = self.coordinator_address.rpartition(":")
    if not host or not port.isdigit():
      raise ConfigError(f"--coordinator_address={self.coordinator_address}: use HOST:PORT")
    if self.num_processes < 1:
      raise ConfigError(f"--num_processes={self.num_processes}: must be at least 1")
    if not 0 <= self.process_id < self.num_processes:
      raise ConfigError(f"--process_id={self.process_id}: must be in 0..{self.num_processes - 1} "
                        f"for --num_processes={self.num_processes}")
    if self.num_slices is not None and (self.num_slices < 1
                                        or self.num_processes % self.num_slices):
      raise ConfigError(f"MEGASCALE_NUM_SLICES={self.num_slices}: must divide the "
                        f"{self.num_processes} processes into equal slices")

  def derived_transfer_address(self) -> str:
    """This process's socket for cross-host transfers: `--transfer_address`, else the
    coordinator's host with port coordinator port + 1 + process id (unique per process on one
    machine; on several machines pass --transfer_address=THIS_HOST_IP:PORT)."""
    if self.transfer_address:
      return self.transfer_address
    host, _, port = self.coordinator_address.rpartition(":")
    return f"{host}:{int(port) + 1 + self.process_id}"


def ephemeral_port_range() -> tuple[int, int]:
  """The kernel's range for ports it assigns by itself (Linux; IANA's 49152-65535 elsewhere)."""
  try:
    low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()  # noqa: SIM115
    return int(low), int(high)
  except (OSError, ValueError):
    return 49152, 65535


def warn_if_ephemeral(address: str) -> None:
  """A warning when a listening port lies in the ephemeral range: any outgoing connection or
  gloo listener on this machine may take it first, and the weight transfers then fail with
  errors that do not name the port (seen: "recv() failed errno: 107")."""
  port = int(address.rpartition(":")[2])
  low, high = ephemeral_port_range()
  if low <= port <= high:
    log.warning("cross-host transfer port %d lies in this machine's ephemeral port range "
                    "%d-%d, where the OS may hand it to another socket first; choose "
                    "--coordinator_address with a port below %d (or --transfer_address)",
                    port, low, high, low)


def define_absl_flags():
  """Defines `--coordinator_address --num_processes --process_id --transfer_address
  --heartbeat_timeout_s` for an absl launcher; returns a function that reads them into `ProcessFlags` (after flag parsing)."""
  from absl import flags  # pylint: disable=import-outside-toplevel

  # On Cloud TPU / GKE JAX finds its peers by itself and these stay unset; elsewhere (several
  # local processes, plain VMs) give the first three on every process.
  coordinator = flags.DEFINE_string("coordinator_address", None,
                                    "HOST:PORT of process 0's coordination service.")
  num_processes = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
  process_id = flags.DEFINE_integer("process_id", None, "This process's index, 0..N-1.")
  transfer = flags.DEFINE_string(
      "transfer_address", None, "HOST:PORT this process listens on for cross-host weight "
      "transfers (default: the coordinator's host, port + 1 + process id).")
  heartbeat = flags.DEFINE_integer(
      "heartbeat_timeout_s", HEARTBEAT_TIMEOUT_S, "Seconds without a heartbeat after which a "
      "process counts as lost and the others stop (exit 5).")
  return lambda: ProcessFlags(coordinator_address=coordinator.value,
                              num_processes=num_processes.value, process_id=process_id.value,
                              transfer_address=transfer.value,
                              heartbeat_timeout_s=heartbeat.value)


def add_argparse_flags(parser) -> None:
  """The same five flags for an argparse launcher (`process_flags(args)` reads them back)."""
  parser.add_argument("--coordinator_address", default=None,
                      help="HOST:PORT of process 0's coordination service (multi-process runs).")
  parser.add_argument("--num_processes", type=int, default=None, help="Processes in the run.")
  parser.add_argument("--process_id", type=int, default=None, help="This process's index.")
  parser.add_argument("--transfer_address", default=None, help="HOST:PORT for cross-host "
                      "transfers (default: coordinator host, port + 1 + process id).")
  parser.add_argument("--heartbeat_timeout_s", type=int, default=HEARTBEAT_TIMEOUT_S,
                      help="Seconds without a heartbeat after which a process counts as lost.")


def process_flags(args) -> ProcessFlags:
  return ProcessFlags(coordinator_address=args.coordinator_address,
                      num_processes=args.num_processes, process_id=args.process_id,
                      transfer_address=args.transfer_address,
                      heartbeat_timeout_s=args.heartbeat_timeout_s)


def cluster_detected() -> bool:
  """Whether JAX's own cluster detection finds a multi-host environment (TPU VM slice, GKE, ...)."""
  from jax._src import clusters  # pylint: disable=import-outside-toplevel

  opt_in = {"Mpi4pyCluster"}  # needs an explicit request in JAX too
  return any(env.is_env_present() for env in clusters.ClusterEnv._cluster_types  # noqa: SLF001
             if env.__name__ not in opt_in)


def initialize(flags: ProcessFlags = ProcessFlags()) -> bool:
  """Joins the multi-process run described by `flags` (or detected); True if the run spans
  processes. Must run before anything touches JAX devices."""
  import jax  # pylint: disable=import-outside-toplevel

  flags.check()
  if not flags.given and not cluster_detected():
    return False
  jax.config.update("jax_enable_recoverability", True)
  # SIGTERM is ours (checkpoint, exit 143; reasoning_rl.stop_signals): JAX's preemption service
  # would take the signal over, and the processes agree on the stop step through the exchange
  jax.config.update("jax_enable_preemption_service", False)
  if flags.given:
    if flags.num_processes == 1:
      return False
    transfer_address = flags.derived_transfer_address()
    warn_if_ephemeral(transfer_address)
    jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
    jax.distributed.initialize(coordinator_address=flags.coordinator_address,
                               num_processes=flags.num_processes, process_id=flags.process_id,
                               heartbeat_timeout_seconds=flags.heartbeat_timeout_s)
  else:
    jax.distributed.initialize(heartbeat_timeout_seconds=flags.heartbeat_timeout_s)
  if jax.process_count() > 1:
    watch_peers()
  return jax.process_count() > 1


def _client():
  from jax._src import distributed  # pylint: disable=import-outside-toplevel

  return distributed.global_state.client


def coordination_client():
  """The coordination service's client (key-value store, barriers); None outside a
  multi-process run."""
  return _client()


def watch_peers(period_s: float = _WATCH_PERIOD_S) -> threading.Thread:
  """Starts the daemon thread that ends this process when another process of the run is lost."""
  import jax  # pylint: disable=import-outside-toplevel

  everyone = list(range(jax.process_count()))

  def watch():
    while not _finished.is_set():
      lost_reason, live = _lost_peers(everyone)
      if lost_reason and not _finished.is_set():
        stop_lost_run(lost_reason, live)
      time.sleep(period_s)

  thread = threading.Thread(target=watch, name="reasoning_rl-peer-watch", daemon=True)
  thread.start()
  return thread


def _lost_peers(everyone: list[int]) -> tuple[str | None, list[int]]:
  """(why the run has lost a process — the lost processes, or an unreachable service — or None;
  the processes still live). `get_live_nodes` is a collective of the coordination service: it
  returns once every live process has called it, so it is asked once per poll, never again on
  the way out (the others may have exited by then, and the call would wait for the service to
  declare them dead too, a heartbeat timeout later)."""
  try:
    live = sorted(_client().get_live_nodes(everyone))
  except Exception as error:  # pylint: disable=broad-except
    return (f"the coordination service (process 0) is unreachable: "
            f"{str(error).splitlines()[0]}", [])
  lost = sorted(set(everyone) - set(live))
  if not lost:
    return None, live
  return (f"process{'es' if len(lost) > 1 else ''} {', '.join(map(str, lost))} of "
          f"{len(everyone)} stopped sending heartbeats (killed, crashed or unreachable)", live)


def stop_if_a_peer_was_lost() -> None:
  """Called with an exception in flight in a multi-process run: when a lost process caused it (a
  collective or a wait that lost its peer), end the way the watcher would, naming the lost
  process, instead of with a traceback about the symptom. Otherwise returns (the caller re-raises)."""
  import jax  # pylint: disable=import-outside-toplevel

  if _client() is None or jax.process_count() == 1 or _finished.is_set():
    return
  reason, live = _lost_peers(list(range(jax.process_count())))
  if reason:
    stop_lost_run(reason, live)


def stop_lost_run(reason: str, live: Sequence[int] = ()) -> None:
  """Ends this process because the run lost a process: one line naming `reason`, exit code
  `ExitCode.LOST_PEER`. Every process but 0 announces that it is stopping; process 0 (which
  hosts the coordination service) waits up to `_STOP_WAIT_S` for the announcements of the
  processes in `live` (as the detection saw them), so that each of them names the lost process
  itself instead of finding the service gone mid-call (which JAX turns into an abort at
  interpreter exit)."""
  import jax  # pylint: disable=import-outside-toplevel

  if not _stopping.acquire(blocking=False):
    while True:  # another thread of this process is already ending it
      time.sleep(60)
  me = jax.process_index()
  print(f"error: process {me}: {reason}; stopping this process too. Rerun every "
        "process with the same flags on the same workdir to resume from the last checkpoint.",
        file=sys.stderr, flush=True)
  try:
    client = _client()
    if me != 0:
      client.key_value_set(f"reasoning_rl/stopping/{me}", "1")
    else:
      deadline = time.monotonic() + _STOP_WAIT_S
      for index in [p for p in live if p != 0]:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0:
          break
        client.blocking_key_value_get(f"reasoning_rl/stopping/{index}", remaining_ms)
      # the service records an announcement before its writer has had the reply and exited;
      # a service gone in between aborts that writer (exit -6, not LOST_PEER: seen in CI)
      time.sleep(_LEAVE_GRACE_S)
  except Exception:  # pylint: disable=broad-except
    pass  # the service or a peer is gone too: nothing left to wait for
  os._exit(ExitCode.LOST_PEER)  # pylint: disable=protected-access


def finish(timeout_s: float = 3600.0) -> None:
  """A normal end: waits until every process got here, stops watching peers, and leaves the run
  in order — the others disconnect first, process 0 (which hosts the coordination service) last,
  so no process loses the service while it shuts down. No-op in single-process runs."""
  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() == 1 or _finished.is_set():
    return
  client = _client()
  client.wait_at_barrier("reasoning_rl/finished", int(timeout_s * 1000))
  _finished.set()
  if jax.process_index() != 0:
    client.key_value_set(f"reasoning_rl/leaving/{jax.process_index()}", "1")
    jax.distributed.shutdown()
    return
  for index in range(1, jax.process_count()):
    client.blocking_key_value_get(f"reasoning_rl/leaving/{index}", 60_000)
  # the others disconnect within milliseconds of announcing it; the service must outlive that
  time.sleep(_LEAVE_GRACE_S)
  jax.distributed.shutdown()
