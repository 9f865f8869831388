"""The trusted side inside the sandbox: builds the program's world, runs the tests, reports verdicts.

Run as `python -I supervisor.py` by `reasoning_rl.verifiers.sandbox`, with a JSON spec on
stdin. With `isolation == "namespaces"` it is the init process (pid 1) of fresh user, mount, pid, net,
IPC and UTS namespaces, which has three consequences the design relies on:

* It assembles a private root (`linux.build_private_root`): read-only system and Python
  directories, read-only device nodes, a read-only procfs, two small writable tmpfs (/scratch,
  /tmp), nothing else of the host.
* Other members of its pid namespace cannot signal it (the kernel drops signals to a namespace init
  unless it installed a handler, and it installs none), and when it exits every process in the
  namespace is killed: nothing the program starts can outlive the run.
* It is not dumpable and the program's process has no capabilities, so the program can neither
  ptrace it nor read its memory, file descriptors or environment through /proc.

It first leaves the caller's session keyring for a fresh anonymous one, and puts itself under
its own limits (a soft address-space limit, `supervisor_memory_bytes`, and a CPU limit), so the
program's replies cannot make it grow or spin without bound; replies are read only up to
`wire.MAX_REPLY_BYTES`. The program's process additionally runs under a seccomp filter that
refuses keyctl / add_key / request_key, and is moved into the run's memory cgroup when the host
made one (`cgroup_procs`); otherwise, in namespace mode, a watchdog thread sums the memory of
every process of the namespace each `WATCH_TICK_S` and kills them all past the limit. The same
thread enforces the process limit.

Why the verdict cannot be forged: the program runs in a separate process (the "worker",
`server.py`) that never receives the tests. The tests execute *here*, in a fresh namespace
each, where the program's top-level names appear as proxies (`proxies.Remote`). Calling one sends
the arguments to the worker and gets back either plain data (checked by exact type, so no rigged
`__eq__`) or an opaque handle that can be compared only by identity. The program's `sys.exit`,
`os._exit`, printed output, patched builtins, signals or files therefore cannot touch the
assertions, which run with this interpreter's own builtins. A test passes only when its code runs
to the end here without an exception; each verdict goes to the host over a pipe only this process
holds, tagged with a per-run nonce. `proxies.py` has the rules the tests run under.
"""

import builtins
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_HARNESS_FILES = ("wire.py", "server.py")
_DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]
# Numeric libraries would start one thread per core, which counts against the process limit.
_ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def _load_sibling(name: str):
  """Imports a module of this directory by path: `python -I` keeps the directory off sys.path, and
  this package's `__init__` must not run here (it imports the rest of `reasoning_rl`)."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, name + ".py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


wire = _load_sibling("wire")
linux = _load_sibling("linux")
proxies = _load_sibling("proxies")
WATCH_TICK_S = 0.02


class _Abort(BaseException):
  """The worker is gone, out of time or misbehaving: stop the current test. A BaseException so a
  test's own `except Exception` cannot swallow it."""


class _Connection:
  """Request/reply with the worker; any transport failure ends the run for all later tests."""

  def __init__(self, process: subprocess.Popen, request_fd: int, reply_fd: int, deadline: float):
    self.process, self.request_fd, self.reply_fd = process, request_fd, reply_fd
    self.deadline = deadline
    self.failure: str | None = None
    self.failure_detail = ""
    self.violation: tuple[str, str] | None = None  # set by the watchdog thread
    self._remotes: dict[int, proxies.Remote] = {}

  def exchange(self, message: dict) -> dict:
    if self.failure:
      raise _Abort(self.failure)
    try:
      wire.write_frame(self.request_fd, message)
      reply = wire.read_frame(self.reply_fd, self.deadline, wire.MAX_REPLY_BYTES)
      if type(reply) is not dict or type(reply.get("ok")) is not bool:
        raise wire.WireError("reply is not an object with a boolean 'ok'")
      return reply
    except wire.FrameTimeout:
      self._fail("timeout", "the program ran past the time limit")
    except wire.PeerGone:
      self._fail(*self._exit_status())
    except wire.WireError as error:
      self._fail(*(self.violation or ("error", f"protocol violation: {error}")))

  def violate(self, status: str, detail: str) -> None:
    """The watchdog's verdict: recorded, then every process of the program is killed (the
    exchange in progress, if any, then fails with it)."""
    self.violation = (status, detail)
    self.kill()

  def _exit_status(self) -> tuple[str, str]:
    if self.violation:
      return self.violation
    try:
      code = self.process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
      return "error", "the program closed its channel"
    if self.violation:
      return self.violation
    if code == -signal.SIGXCPU:
      return "timeout", "the program used up its CPU time"
    if code < 0:
      return "killed", f"the program was killed by signal {-code}"
    return "error", f"the program exited with status {code}"

  def _fail(self, status: str, detail: str):
    self.failure, self.failure_detail = status, detail
    self.kill()
    raise _Abort(status)

  def kill(self) -> None:
    """Kills the worker and everything it started (all of it only in namespace mode)."""
    try:
      if os.getpid() == 1:  # init of the sandbox's pid namespace: -1 means every other member
        os.kill(-1, signal.SIGKILL)
      else:
        os.killpg(self.process.pid, signal.SIGKILL)
    except OSError:
      pass

  def decode(self, data):
    try:
      return wire.from_wire(data, self.remote)
    except wire.WireError as error:
      self._fail("error", f"protocol violation: {error}")
    except MemoryError:
      self._fail("error", "protocol violation: a reply too large to decode")

  def encode(self, value):
    def handle_of(item):
      if isinstance(item, proxies.Remote) and item._connection is self:
        return item._handle
      raise TypeError(f"cannot pass a {type(item).__name__} to the program: only plain data and "
                      "objects it returned cross the sandbox")
    return wire.to_wire(value, handle_of)

  def remote(self, handle: int) -> proxies.Remote:
    if handle not in self._remotes:
      self._remotes[handle] = proxies.Remote(self, handle)
    return self._remotes[handle]

  def ask(self, op: str, target: int, **fields):
    reply = self.exchange({"op": op, "target": target, **fields})
    if reply["ok"]:
      return self.decode(reply.get("value"))
    raise proxies.remote_exception(reply.get("exc"), reply.get("msg"), op)


class _Watchdog:
  """Every WATCH_TICK_S, counts the processes of this pid namespace and, with `memory_bytes`,
  sums their memory (anonymous and shared resident pages, from /proc/PID/status); past either
  limit it has the connection kill them all. Init mode only.

  Needed for processes because the kernel exempts uid 0 of the initial user namespace from
  RLIMIT_NPROC, and the sandbox's uid maps to it when the caller runs as root; for memory where no
  cgroup bounds the program's processes together. Polled, so a fork bomb or a burst of
  allocation can overshoot for up to one tick (each process stays under its own RLIMIT_AS).
  """

  def __init__(self, connection: _Connection, max_processes: int, memory_bytes: int | None):
    self.connection, self.max_processes, self.memory_bytes = connection, max_processes, memory_bytes
    self._stop = threading.Event()

  def start(self) -> None:
    threading.Thread(target=self._run, name="sandbox-watchdog", daemon=True).start()

  def stop(self) -> None:
    self._stop.set()

  def _run(self) -> None:
    while not self._stop.wait(WATCH_TICK_S):
      problem = self.check()
      if problem is not None:
        self.connection.violate("killed", problem)
        return

  def check(self) -> str | None:
    members = [entry for entry in os.listdir("/proc") if entry.isdigit() and entry != "1"]
    if len(members) > self.max_processes:
      return f"the program ran more than {self.max_processes} processes"
    if self.memory_bytes is not None:
      used = sum(_resident_bytes(pid) for pid in members)
      if used > self.memory_bytes:
        return (f"the program's processes together used more than {self.memory_bytes >> 20} MB "
                "of memory")
    return None


def _resident_bytes(pid: str) -> int:
  total = 0
  try:
    with open(f"/proc/{pid}/status") as handle:
      for line in handle:
        if line.startswith(("RssAnon:", "RssShmem:")):
          total += int(line.split()[1]) << 10
  except (OSError, ValueError, IndexError):  # gone meanwhile, or a kernel thread
    pass
  return total


class _Reporter:
  """Writes JSON lines to the host over the one descriptor the program cannot reach."""

  def __init__(self, fd: int, nonce: str):
    self.fd, self.nonce = fd, nonce

  def send(self, **fields) -> None:
    line = json.dumps({"nonce": self.nonce, **fields}).encode() + b"\n"
    try:
      os.write(self.fd, line)
    except OSError:  # the host gave up on us; nothing left to do
      os._exit(1)


def _start_worker(harness_dir: str, scratch: str, tmp: str, limits: dict) -> tuple:
  request_read, request_write = os.pipe()
  reply_read, reply_write = os.pipe()
  bootstrap = (f"import sys; sys.path.insert(0, {harness_dir!r}); "
               "import server; server.main()")
  env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": tmp,
         "LANG": "C.UTF-8", **_ONE_THREAD}

  def enter_worker():  # runs in the forked child, before exec; this process is single-threaded
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    os.nice(10)  # a CPU-bound program must not starve this supervisor of its deadline
    linux.apply_limits(limits)
    linux.drop_all_privileges()
    linux.refuse_key_syscalls()

  process = subprocess.Popen(
      [sys.executable, "-I", "-B", "-c", bootstrap, str(request_read), str(reply_write)],
      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
      cwd=scratch, env=env, pass_fds=(request_read, reply_write), start_new_session=True,
      preexec_fn=enter_worker)
  os.close(request_read)
  os.close(reply_write)
  return process, request_write, reply_read


def _run_test(connection: _Connection, names: dict, test: str, index: int) -> tuple[bool, str]:
  namespace = {"__builtins__": builtins, "__name__": "__tests__"}
  for name, data in names.items():
    try:
      namespace[name] = wire.from_wire(data, connection.remote)
    except (wire.WireError, MemoryError):
      pass
  try:
    exec(compile(test, f"<test {index}>", "exec"), namespace)  # pylint: disable=exec-used
  except BaseException as error:  # a failing assert, the program's exception, or _Abort
    return False, f"{type(error).__name__}: {error}"[:proxies.WHY_CHARS]
  if connection.failure:  # the test swallowed the abort
    return False, connection.failure_detail
  return True, ""


def _prepare_world(spec: dict, harness_sources: dict) -> tuple[str, str, str]:
  """Returns (harness_dir, scratch, tmp) inside the world the worker will see."""
  if spec["isolation"] == "namespaces":
    sizes = {"/scratch": spec["scratch_bytes"], "/tmp": spec["scratch_bytes"]}
    linux.build_private_root(spec["workdir"], spec["read_only_dirs"], _DEVICES, sizes)
    harness_dir, scratch, tmp = "/.harness", "/scratch", "/tmp"
  else:
    workdir = spec["workdir"]
    harness_dir, scratch, tmp = (os.path.join(workdir, part) for part in ("harness", "scratch",
                                                                           "tmp"))
    os.makedirs(scratch)
    os.makedirs(tmp)
  os.makedirs(harness_dir)
  for name, source in harness_sources.items():
    with open(os.path.join(harness_dir, name), "w") as handle:
      handle.write(source)
  if spec["isolation"] == "namespaces":
    linux.seal_root()
  return harness_dir, scratch, tmp


def _limit_myself(spec: dict) -> None:
  """This process's own bounds: a soft address-space limit (the worker, forked from here, raises
  its own to the program's limit: the hard limit stays open for that) and a CPU limit a little
  above the program's (SIGXCPU, then SIGKILL)."""
  resource.setrlimit(resource.RLIMIT_AS, (spec["supervisor_memory_bytes"], resource.RLIM_INFINITY))
  cpu_s = spec["limits"]["cpu_s"] + 1
  resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))


def _join_cgroup(procs_fd: int | None, pid: int) -> str | None:
  """Moves the worker into the run's memory cgroup (before it has read the program, so before it
  can fork); None on success, else why not."""
  if procs_fd is None:
    return "no cgroup was made for this run"
  try:
    os.write(procs_fd, str(pid).encode())
    return None
  except OSError as error:
    return f"moving the program into its memory cgroup failed ({error.strerror})"
  finally:
    os.close(procs_fd)


def main() -> None:
  spec = json.loads(sys.stdin.buffer.read())
  report_fd = os.dup(1)
  devnull = os.open(os.devnull, os.O_RDWR)
  for fd in (0, 1):  # tests may print; nothing but the reporter may write to the host's pipe
    os.dup2(devnull, fd)
  reporter = _Reporter(report_fd, spec["nonce"])
  linux.prctl(linux.PR_SET_DUMPABLE, 0)
  for number in range(1, signal.NSIG):
    if number not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE):
      try:
        signal.signal(number, signal.SIG_DFL)
      except (OSError, ValueError):
        pass
  linux.join_fresh_session_keyring()  # the program's process inherits it: no caller's keys
  _limit_myself(spec)
  sys.set_int_max_str_digits(100_000)
  harness_sources = {}
  for name in _HARNESS_FILES:
    with open(os.path.join(_HERE, name)) as handle:
      harness_sources[name] = handle.read()
  procs_fd = os.open(spec["cgroup_procs"], os.O_WRONLY) if spec["cgroup_procs"] else None
  harness_dir, scratch, tmp = _prepare_world(spec, harness_sources)
  in_namespace = spec["isolation"] == "namespaces"
  if in_namespace:  # first, so the host learns it even if it must kill us
    reporter.send(pid_namespace=os.readlink("/proc/self/ns/pid"))
  missing = linux.seccomp_unavailable()
  if missing is not None:  # the program would hold the caller's key system calls
    reporter.send(status="error", detail=f"the sandbox needs a seccomp filter: {missing}")
    os._exit(0)
  process, request_fd, reply_fd = _start_worker(harness_dir, scratch, tmp, spec["limits"])
  cgroup_problem = _join_cgroup(procs_fd, process.pid)
  if spec["cgroup_procs"] and cgroup_problem:
    reporter.send(memory_cgroup_failed=cgroup_problem)
  connection = _Connection(process, request_fd, reply_fd, spec["deadline"])
  watchdog = None
  if in_namespace:
    watchdog = _Watchdog(connection, spec["limits"]["processes"],
                         spec["memory_bytes"] if cgroup_problem else None)
    watchdog.start()
  names, detail = {}, ""
  try:
    loaded = connection.exchange({"program": spec["program"]})
    if loaded["ok"]:
      offered = loaded.get("names") if type(loaded.get("names")) is dict else {}
      own = proxies.suite_names(spec["tests"])  # the tests' own names are never the program's
      names = {name: data for name, data in offered.items() if name not in own}
    else:
      connection.failure = "error"
      connection.failure_detail = detail = (
          f"the program raised {loaded.get('exc')}: "
          f"{str(loaded.get('msg'))[:proxies.WHY_CHARS]}")
  except _Abort:
    pass
  all_passed = True
  for index, test in enumerate(spec["tests"]):
    if connection.failure:
      passed, why = False, connection.failure_detail
    else:
      passed, why = _run_test(connection, names, test, index)
    all_passed &= passed
    detail = detail or why
    reporter.send(test=index, passed=passed, why=why)
  if watchdog is not None:
    watchdog.stop()
  if connection.violation and not connection.failure:  # past a limit after the last exchange
    connection.failure, connection.failure_detail = connection.violation
  status = connection.failure or ("passed" if all_passed else "failed")
  reporter.send(status=status, detail=connection.failure_detail or detail)
  connection.kill()
  os._exit(0)


if __name__ == "__main__":
  main()
