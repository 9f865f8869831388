"""The trusted side inside the sandbox: builds the program's world, runs the tests, reports verdicts.

Run as `python -I supervisor.py` by `reasoning_rl.verifiers.sandbox`, with a JSON spec on
stdin. With `isolation == "namespaces"` it is the init process (pid 1) of fresh user, mount, pid, net,
IPC and UTS namespaces, which has three consequences the design relies on:

* It assembles a private root (`linux.build_private_root`): read-only system and Python
  directories, a read-only procfs, two small writable tmpfs (/scratch, /tmp), nothing else of the host.
* Other members of its pid namespace cannot signal it (the kernel drops signals to a namespace init
  unless it installed a handler, and it installs none), and when it exits every process in the
  namespace is killed: nothing the program starts can outlive the run.
* It is not dumpable and the program's process has no capabilities, so the program can neither
  ptrace it nor read its memory, file descriptors or environment through /proc.

Why the verdict cannot be forged: the program runs in a separate process (the "worker",
`server.py`) that never receives the tests. The tests execute *here*, in a fresh namespace
each, where the program's top-level names appear as proxies (`Remote`). Calling one sends the
arguments to the worker and gets back either plain data (checked by exact type, so no rigged
`__eq__`) or an opaque handle that compares equal only to itself. The program's `sys.exit`,
`os._exit`, printed output, patched builtins, signals or files therefore cannot touch the
assertions, which run with this interpreter's own builtins. A test passes only when its code runs
to the end here without an exception; each verdict goes to the host over a pipe only this process
holds, tagged with a per-run nonce.
"""

import builtins
import importlib.util
import json
import os
import signal
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_HARNESS_FILES = ("wire.py", "server.py")
_DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]
_WHY_CHARS = 300
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


class _Abort(BaseException):
  """The worker is gone, out of time or misbehaving: stop the current test. A BaseException so a
  test's own `except Exception` cannot swallow it."""


class RemoteError(Exception):
  """An exception raised by the program that has no builtin counterpart here."""


def _remote_exception(name: object, message: object) -> Exception:
  """Rebuilds an exception of the program as a builtin Exception subclass, or RemoteError.

  Never a BaseException outside Exception (SystemExit, KeyboardInterrupt…): those would act on
  this process instead of failing a test.
  """
  text = str(message)[:_WHY_CHARS]
  kind = getattr(builtins, str(name), None)
  if isinstance(kind, type) and issubclass(kind, Exception):
    try:
      return kind(text)
    except Exception:  # builtins with a richer constructor (UnicodeDecodeError …)
      pass
  return RemoteError(f"{name}: {text}")


class Remote:
  """An object that lives in the program's process; only calls, attribute reads, indexing,
  iteration, len, bool and str are forwarded. Equal only to itself."""

  __slots__ = ("_connection", "_handle")

  def __init__(self, connection: "_Connection", handle: int):
    object.__setattr__(self, "_connection", connection)
    object.__setattr__(self, "_handle", handle)

  def _ask(self, op: str, **fields):
    return self._connection.ask(op, self._handle, **fields)

  def __call__(self, *args, **kwargs):
    encode = self._connection.encode
    return self._ask("call", args=encode(list(args)), kwargs=encode(dict(kwargs)))

  def __getattr__(self, name: str):
    if name.startswith("__") and name.endswith("__"):
      raise AttributeError(name)
    return self._ask("getattr", name=name)

  def __getitem__(self, key):
    return self._ask("getitem", key=self._connection.encode(key))

  def __iter__(self):
    iterator = self._ask("iter")
    if not isinstance(iterator, Remote):
      raise TypeError("the program's __iter__ did not return an iterator")
    return iterator

  def __next__(self):
    return self._ask("next")

  def __len__(self):
    return self._ask("len")

  def __bool__(self):
    return self._ask("bool")

  def __str__(self):
    return self._ask("str")

  def __repr__(self):
    if self._connection.failure:
      return f"<program object #{self._handle}>"
    return self._ask("repr")

  def __eq__(self, other):
    return (isinstance(other, Remote) and other._connection is self._connection
            and other._handle == self._handle)

  def __hash__(self):
    return hash(self._handle)


class _Connection:
  """Request/reply with the worker; any transport failure ends the run for all later tests."""

  def __init__(self, process: subprocess.Popen, request_fd: int, reply_fd: int, deadline: float,
               max_processes: int | None):
    self.process, self.request_fd, self.reply_fd = process, request_fd, reply_fd
    self.deadline, self.max_processes = deadline, max_processes
    self.failure: str | None = None
    self.failure_detail = ""
    self._remotes: dict[int, Remote] = {}

  def exchange(self, message: dict) -> dict:
    if self.failure:
      raise _Abort(self.failure)
    try:
      wire.write_frame(self.request_fd, message)
      reply = wire.read_frame(self.reply_fd, self.deadline, self._watch_processes)
      if type(reply) is not dict or type(reply.get("ok")) is not bool:
        raise wire.WireError("reply is not an object with a boolean 'ok'")
      return reply
    except wire.FrameTimeout:
      self._fail("timeout", "the program ran past the time limit")
    except wire.PeerGone:
      self._fail(*self._exit_status())
    except wire.WireError as error:
      self._fail("error", f"protocol violation: {error}")

  def _watch_processes(self) -> None:
    """Enforces the process limit by counting this pid namespace's members (init mode only).

    Needed because the kernel exempts uid 0 of the initial user namespace from RLIMIT_NPROC, and
    the sandbox's uid maps to it when the caller runs as root. Checked every WAIT_TICK_S, so a fork
    bomb can overshoot the limit briefly before everything is killed.
    """
    if self.max_processes is None:
      return
    members = sum(1 for entry in os.listdir("/proc") if entry.isdigit()) - 1  # minus this process
    if members > self.max_processes:
      self._fail("killed", f"the program ran more than {self.max_processes} processes")

  def _exit_status(self) -> tuple[str, str]:
    try:
      code = self.process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
      return "error", "the program closed its channel"
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

  def encode(self, value):
    def handle_of(item):
      if isinstance(item, Remote) and item._connection is self:
        return item._handle
      raise TypeError(f"cannot pass a {type(item).__name__} to the program: only plain data and "
                      "objects it returned cross the sandbox")
    return wire.to_wire(value, handle_of)

  def remote(self, handle: int) -> Remote:
    if handle not in self._remotes:
      self._remotes[handle] = Remote(self, handle)
    return self._remotes[handle]

  def ask(self, op: str, target: int, **fields):
    reply = self.exchange({"op": op, "target": target, **fields})
    if reply["ok"]:
      return self.decode(reply.get("value"))
    raise _remote_exception(reply.get("exc"), reply.get("msg"))


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
    if name not in _BUILTIN_NAMES:  # the program may not redefine what the tests rely on
      try:
        namespace[name] = wire.from_wire(data, connection.remote)
      except wire.WireError:
        pass
  try:
    exec(compile(test, f"<test {index}>", "exec"), namespace)  # pylint: disable=exec-used
  except BaseException as error:  # a failing assert, the program's exception, or _Abort
    return False, f"{type(error).__name__}: {error}"[:_WHY_CHARS]
  if connection.failure:  # the test swallowed the abort
    return False, connection.failure_detail
  return True, ""


_BUILTIN_NAMES = frozenset(dir(builtins))


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
  sys.set_int_max_str_digits(100_000)
  harness_sources = {}
  for name in _HARNESS_FILES:
    with open(os.path.join(_HERE, name)) as handle:
      harness_sources[name] = handle.read()
  harness_dir, scratch, tmp = _prepare_world(spec, harness_sources)
  if spec["isolation"] == "namespaces":  # first, so the host learns it even if it must kill us
    reporter.send(pid_namespace=os.readlink("/proc/self/ns/pid"))
  process, request_fd, reply_fd = _start_worker(harness_dir, scratch, tmp, spec["limits"])
  in_namespace = spec["isolation"] == "namespaces"
  connection = _Connection(process, request_fd, reply_fd, spec["deadline"],
                           spec["limits"]["processes"] if in_namespace else None)
  names, detail = {}, ""
  try:
    loaded = connection.exchange({"program": spec["program"]})
    if loaded["ok"]:
      names = loaded.get("names") if type(loaded.get("names")) is dict else {}
    else:
      connection.failure = "error"
      connection.failure_detail = detail = (
          f"the program raised {loaded.get('exc')}: {str(loaded.get('msg'))[:_WHY_CHARS]}")
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
  status = connection.failure or ("passed" if all_passed else "failed")
  reporter.send(status=status, detail=connection.failure_detail or detail)
  connection.kill()
  os._exit(0)


if __name__ == "__main__":
  main()
