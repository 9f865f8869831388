"""Host side of the code sandbox: starts the supervisor in fresh Linux namespaces, enforces the wall
clock, bounds the memory of the program's processes together, and collects the verdicts only the
supervisor can send.

Isolation (`isolation="namespaces"`, the default), all from the `unshare` tool of util-linux plus a
small Python supervisor (`supervisor.py`), so no extra system package is needed:

* user namespace (the caller's uid becomes root inside, with capabilities only for setting up),
  mount namespace with a private root (read-only /usr and the Python installation, read-only procfs,
  device nodes bound read-only, writable tmpfs /scratch and /tmp, no /work, /root, /home, /etc, or
  host /tmp), pid namespace (killing its init kills everything the program started), empty net
  namespace (no network, not even the host's loopback), private IPC and UTS namespaces;
* a fresh anonymous session keyring, and a seccomp filter on the program's process that refuses
  keyctl, add_key and request_key: the caller's keys can be neither read, revoked nor joined by
  planted ones (where the kernel has no seccomp filter, or the machine is neither x86_64 nor
  aarch64, the sandbox refuses to run and says why);
* the program's process holds no capabilities (bounding set empty, securebits lock root out),
  has no_new_privs, and runs under rlimits (CPU seconds, address space, file size, processes, open
  files) in a scrubbed environment;
* memory for all its processes together: a memory cgroup per run where this host lets us make one
  (`cgroups.py`), else a watchdog in the supervisor that sums their resident memory every 20 ms
  (`memory_enforcement()` says which, and why);
* the supervisor itself under a soft address-space limit and a CPU limit, reading replies of at
  most `wire.MAX_REPLY_BYTES`;
* a wall deadline: the supervisor stops at `timeout_s`, and this side kills the whole process group
  (and with it the namespace) half a second later if the supervisor has not finished.

`isolation="rlimits_only"` keeps the separate process, the rlimits, the keyring and seccomp
measures, the memory cgroup where there is one, the scrubbed environment and the unforgeable
verdict, but has no private file system, no network isolation, cannot reap processes that escape
with setsid (unless a cgroup holds them), has no whole-tree memory bound without a cgroup and (when
the caller is root) no process limit. It exists for hosts without user namespaces, must be asked
for explicitly, and logs a warning.

Known limits of the namespace mode: the program's uid maps to the caller's uid (so, for a root
caller, to host root without any capability; the mount view is what keeps host files out of reach,
and /proc and the device nodes are read-only so root-owned sysctls and nodes cannot be changed);
the seccomp filter refuses only the key system calls, so the rest of the kernel's system-call
surface is reachable; without a cgroup the memory bound is polled (a burst can overshoot for one
poll) and counts resident pages, not kernel memory such as pipe buffers; the tests themselves run
in the supervisor and are trusted.
"""

import dataclasses
import functools
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from reasoning_rl.errors import VerifierError
from reasoning_rl.verifiers.sandbox import cgroups

ISOLATION_MODES = ("namespaces", "rlimits_only")
_SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor.py")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_KILL_GRACE_S = 0.5
# Tests run in the supervisor, under its own memory limit: a numeric library a test imports must
# not start (and reserve memory for) one thread per core of a large host.
_SUPERVISOR_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
                   **{name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                             "MKL_NUM_THREADS")}}
_STDERR_KEEP_BYTES = 4096
_logger = logging.getLogger(__name__)
_warned_rlimits_only = False
_warned_memory: set[str] = set()


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Resource limits of the program's processes (each rlimit applies per process).

  Attributes:
    memory_mb: address-space limit of each process (RLIMIT_AS), and the memory all the program's
      processes may use together (a memory cgroup, or the supervisor's watchdog in namespace mode;
      see `memory_enforcement`).
    max_processes: processes of the program (RLIMIT_NPROC, which also counts threads). The kernel
      exempts the host's root user from RLIMIT_NPROC, and the sandbox's uid maps to the caller's,
      so in namespace mode the supervisor also counts its pid namespace every 20 ms while the
      program runs and kills everything past the limit (status "killed").
    file_size_mb: largest file the program may write (RLIMIT_FSIZE).
    open_files: file descriptors (RLIMIT_NOFILE).
    scratch_mb: size of each writable tmpfs (/scratch, /tmp) in namespace mode.
    supervisor_memory_mb: the trusted supervisor's own address-space limit (it decodes the
      program's replies and runs the tests).
  """
  memory_mb: int = 1024
  max_processes: int = 16
  file_size_mb: int = 16
  open_files: int = 256
  scratch_mb: int = 32
  supervisor_memory_mb: int = 1024

  def validate(self) -> None:
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if type(value) is not int or value <= 0:
        raise VerifierError(f"SandboxLimits.{field.name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SandboxOutcome:
  """What the supervisor reported: per-test verdicts it confirmed, and how the run ended."""
  verdicts: dict[int, bool]
  reasons: dict[int, str]
  status: str
  detail: str
  pid_namespace: str


def _unshare_binary() -> str | None:
  return shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")


def _read_only_dirs() -> list[str]:
  dirs = set(_SYSTEM_DIRS) | {sys.prefix, sys.base_prefix,
                              os.path.dirname(os.path.realpath(sys.executable))}
  return sorted(path for path in dirs if os.path.lexists(path))


def _command(isolation: str) -> list[str]:
  python = [sys.executable, "-I", "-B", _SUPERVISOR]
  if isolation == "rlimits_only":
    return python
  return [_unshare_binary(), "--user", "--map-root-user", "--mount", "--propagation", "private",
          "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts"] + python


def _kill_group(process: subprocess.Popen) -> None:
  """SIGKILLs the process group (unshare and the supervisor; with the supervisor, the namespace)."""
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _group_members(pgid: int) -> list[int]:
  members = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as handle:
          fields = handle.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if int(fields[2]) == pgid:
        members.append(int(entry))
  return members


def _wait_gone(pids: list[int], limit_s: float) -> None:
  end = time.monotonic() + limit_s
  while time.monotonic() < end and any(os.path.exists(f"/proc/{pid}") for pid in pids):
    time.sleep(0.005)


def _reap(process: subprocess.Popen, graceful: bool) -> None:
  """Waits for the sandbox to end, killing its process group unless it finishes by itself.

  In namespace mode the supervisor is the namespace's init, so once it is gone so is every process
  the program started; its pid is awaited explicitly because unshare may be reaped first.
  """
  if graceful:
    try:
      process.wait(timeout=1.0)
      return
    except subprocess.TimeoutExpired:
      pass
  members = _group_members(process.pid)
  _kill_group(process)
  process.wait()
  _wait_gone(members, 2.0)


def run_in_sandbox(program: str, tests: list[str], *, timeout_s: float, isolation: str,
                   limits: SandboxLimits) -> SandboxOutcome:
  """Runs `tests` against `program` in the sandbox; callers validate arguments (see code.py)."""
  global _warned_rlimits_only
  if isolation == "rlimits_only" and not _warned_rlimits_only:
    _warned_rlimits_only = True
    _logger.warning(
        "CODE SANDBOX RUNS WITH RLIMITS ONLY (isolation='rlimits_only'): the program can read and "
        "write the host's files, reach the network, and leave daemon processes behind. Use it only "
        "where user namespaces are unavailable and the programs are not adversarial.")
  start = time.monotonic()
  deadline = start + timeout_s
  nonce = secrets.token_hex(16)
  # rlimits_only: the run's files live here. namespaces: the (empty) mount point of the private
  # root; a fresh directory can never hide a read-only bind source, as mounting over a parent of
  # one (say /tmp, when the venv is under /tmp) would.
  workdir = tempfile.mkdtemp(prefix="rrl-sandbox-")
  memory_bytes = limits.memory_mb << 20
  group = _memory_cgroup(nonce, memory_bytes, isolation)
  spec = {
      "nonce": nonce, "isolation": isolation, "program": program, "tests": tests,
      "deadline": deadline, "read_only_dirs": _read_only_dirs(), "workdir": workdir,
      "scratch_bytes": limits.scratch_mb << 20, "memory_bytes": memory_bytes,
      "supervisor_memory_bytes": limits.supervisor_memory_mb << 20,
      "cgroup_procs": group.procs_file if group else None,
      "limits": {"cpu_s": int(timeout_s) + 1, "address_space_bytes": memory_bytes,
                 "file_size_bytes": limits.file_size_mb << 20,
                 "processes": limits.max_processes, "open_files": limits.open_files},
  }
  oom_kills = 0
  try:
    process = subprocess.Popen(
        _command(isolation), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=_SUPERVISOR_ENV,
        start_new_session=True, close_fds=True)
    finished = False
    try:
      lines, stderr, finished = _talk(process, json.dumps(spec).encode(), deadline + _KILL_GRACE_S)
    finally:
      _reap(process, graceful=finished)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
    if group is not None:
      oom_kills = group.oom_kills()
      group.remove()
  outcome = _outcome(lines, stderr, nonce, timed_out=time.monotonic() >= deadline,
                     isolation=isolation)
  if oom_kills and outcome.status in ("killed", "error", "failed"):
    outcome = dataclasses.replace(outcome, status="killed", detail=(
        f"the program's processes together used more than memory_mb={limits.memory_mb} MB"))
  return outcome


def _memory_cgroup(name: str, limit_bytes: int, isolation: str) -> cgroups.MemoryCgroup | None:
  """The run's memory cgroup, or None (the supervisor then polls memory, in namespace mode)."""
  try:
    return cgroups.create(name, limit_bytes)
  except OSError as error:
    _warn_memory_once(error.strerror or str(error), isolation)
    return None


def _warn_memory_once(reason: str, isolation: str) -> None:
  if reason in _warned_memory:
    return
  _warned_memory.add(reason)
  if isolation == "namespaces":
    _logger.warning(
        "code sandbox: %s; the memory of a program's processes together is bounded by polling "
        "them every 20 ms instead (a burst can overshoot for one poll). A writable memory cgroup "
        "(root, or a delegated cgroup v2 subtree) makes it a hard limit.", reason)
  else:
    _logger.warning("code sandbox (rlimits_only): %s; memory is bounded per process only.", reason)


def memory_enforcement() -> str:
  """How the sandbox bounds the memory of a program's processes together on this host: "cgroup
  v1 under DIR", "cgroup v2 under DIR", or "polling (namespace mode only): WHY no cgroup"."""
  found = cgroups.find_parent()
  if isinstance(found, str):
    return f"polling (namespace mode only): {found}"
  return f"cgroup v{found[0]} under {found[1]}"


def _talk(process: subprocess.Popen, spec: bytes, kill_at: float) -> tuple[list[bytes], bytes,
                                                                            bool]:
  """Feeds the spec, reads report lines until the supervisor closes its pipe or `kill_at` passes.

  Returns (stdout lines, stderr tail, whether stdout reached its end).
  """
  out, err = bytearray(), bytearray()
  selector = selectors.DefaultSelector()
  os.set_blocking(process.stdin.fileno(), False)
  selector.register(process.stdin, selectors.EVENT_WRITE)
  selector.register(process.stdout, selectors.EVENT_READ)
  selector.register(process.stderr, selectors.EVENT_READ)
  pending = memoryview(spec)
  finished = False
  try:
    while not finished:
      left = kill_at - time.monotonic()
      if left <= 0:
        break
      for key, _ in selector.select(left):
        if key.fileobj is process.stdin:
          try:
            pending = pending[os.write(process.stdin.fileno(), pending[:1 << 16]):]
          except BrokenPipeError:
            pending = pending[:0]
          if not pending:
            selector.unregister(process.stdin)
            process.stdin.close()
          continue
        chunk = os.read(key.fileobj.fileno(), 1 << 16)
        if key.fileobj is process.stdout:
          out += chunk
          finished = not chunk
        else:
          err = (err + chunk)[-_STDERR_KEEP_BYTES:]
          if not chunk:
            selector.unregister(process.stderr)
  finally:
    selector.close()
    for stream in (process.stdin, process.stdout, process.stderr):
      if not stream.closed:
        stream.close()
  return bytes(out).splitlines(), bytes(err), finished


def _outcome(lines: list[bytes], stderr: bytes, nonce: str, timed_out: bool,
             isolation: str = "namespaces") -> SandboxOutcome:
  verdicts, reasons, status, detail, pid_namespace = {}, {}, None, "", ""
  for line in lines:
    try:
      message = json.loads(line)
    except ValueError:
      continue
    if type(message) is not dict or message.get("nonce") != nonce:
      continue
    if "pid_namespace" in message:
      pid_namespace = str(message["pid_namespace"])
    elif "memory_cgroup_failed" in message:
      _warn_memory_once(str(message["memory_cgroup_failed"]), isolation)
    elif "test" in message:
      verdicts[message["test"]] = message.get("passed") is True
      reasons[message["test"]] = str(message.get("why", ""))
    elif "status" in message:
      status, detail = message["status"], str(message.get("detail", ""))
  if status is None:
    if timed_out:
      status, detail = "timeout", "the sandbox did not finish before the deadline and was killed"
    else:
      status = "error"
      detail = "the sandbox supervisor failed: " + stderr.decode(errors="replace")[-1000:]
  return SandboxOutcome(verdicts, reasons, status, detail, pid_namespace)


@functools.lru_cache(maxsize=1)
def namespace_probe_failure() -> str | None:
  """None when the namespace sandbox works on this host, else why not (runs it once, cached)."""
  if not sys.platform.startswith("linux"):
    return f"the sandbox needs Linux namespaces; this is {sys.platform}"
  if _unshare_binary() is None:
    return "the `unshare` tool of util-linux is not installed"
  try:
    outcome = run_in_sandbox("value = 6 * 7", ["assert value == 42"], timeout_s=20.0,
                             isolation="namespaces", limits=SandboxLimits())
  except OSError as error:
    return f"starting the sandbox failed: {error}"
  if outcome.verdicts != {0: True}:
    return f"a trivial program did not pass in the sandbox ({outcome.status}: {outcome.detail})"
  return None


def sandbox_available() -> bool:
  """Whether `run_tests(..., isolation="namespaces")` can run here."""
  return namespace_probe_failure() is None
