"""Code verifier: runs a generated program against unit tests in the sandbox (`sandbox/`).

Semantics of a run:
* The program is executed once, as a module named `solution` (so `if __name__ == "__main__"`
  blocks do not run), in its own process inside the sandbox.
* Each test is a Python snippet executed afterwards in a fresh namespace of the trusted
  supervisor, where the program's top-level names are visible, except the names the tests own:
  builtins (a program cannot redefine `abs` or `AssertionError` for the tests), every name any
  test of the run binds (a helper one test defines stays the tests' in the others), and `check`,
  `candidate`, `expected`; a test that uses one of those without binding it gets a NameError,
  never the program's. A test passes when it runs to the end without raising. Typical tests:
  `assert add(2, 3) == 5`, or a HumanEval `check` function followed by `check(entry_point)`.
* Values cross from the program to the tests only as plain data (None, bool, int, float, complex,
  str, bytes, list, tuple, dict, set, frozenset, and numpy values converted with `tolist`), in
  replies of at most 4 MiB; any other object arrives as a handle that can be called, indexed,
  iterated, measured with len/bool/str and compared by identity (`is`), but comparing it by value
  (==, !=, <, in) or hashing it raises TypeError: comparisons are made on the plain values the
  harness rebuilt, never on an object whose answers the program chooses. Arguments are passed by
  value, so a test cannot observe the program mutating them in place, and tests cannot pass their
  own functions to the program.
* A StopIteration (or StopAsyncIteration) that leaves the program anywhere but an iterator's
  `next` is an error, not the end of the test's loop over it.
* The program's module state is shared by the tests of one run, in order.

Statuses: `passed` (all tests passed), `failed` (ran to the end, some failed), `timeout` (the wall
or CPU limit ended the run; tests not finished by then failed), `error` (the program did not load,
exited, or broke the protocol), `killed` (the program's process died from a signal other than the
CPU limit, e.g. SIGKILL or SIGSEGV).
"""

import dataclasses
import time

from reasoning_rl.errors import VerifierError
from reasoning_rl.verifiers import sandbox
from reasoning_rl.verifiers.sandbox import SandboxLimits, sandbox_available

__all__ = ["TestResult", "SandboxLimits", "run_tests", "sandbox_available"]

STATUSES = ("passed", "failed", "timeout", "error", "killed")


@dataclasses.dataclass(frozen=True)
class TestResult:
  """Outcome of `run_tests`.

  Attributes:
    passed: number of tests the trusted supervisor confirmed as passed.
    total: number of tests given.
    status: one of `passed|failed|timeout|error|killed` (see the module docstring).
    test_passed: per-test verdicts, in order.
    test_reasons: per test, why it failed ("" when it passed).
    detail: why the first failing test failed, or why the run ended early.
    wall_s: wall-clock seconds of the whole call.
    isolation: the isolation mode the program ran under.
    pid_namespace: the sandbox's pid namespace as /proc/PID/ns/pid shows it ("pid:[inode]"), so
      a caller can check that no process of the run is left; "" in rlimits_only mode or when the
      supervisor was killed before reporting.
  """
  __test__ = False  # not a pytest class, despite the name

  passed: int
  total: int
  status: str
  test_passed: tuple[bool, ...]
  test_reasons: tuple[str, ...]
  detail: str
  wall_s: float
  isolation: str
  pid_namespace: str

  @property
  def pass_rate(self) -> float:
    return self.passed / self.total


def _validate(program: object, tests: object, timeout_s: object, isolation: object,
              limits: object) -> None:
  if not isinstance(program, str):
    raise VerifierError(f"run_tests: `program` must be a str, got {type(program).__name__}")
  if not isinstance(tests, (list, tuple)) or not tests:
    raise VerifierError("run_tests: `tests` must be a non-empty list of Python snippets (str)")
  for index, test in enumerate(tests):
    if not isinstance(test, str):
      raise VerifierError(f"run_tests: tests[{index}] must be a str, got {type(test).__name__}")
    try:
      compile(test, f"<test {index}>", "exec")
    except SyntaxError as error:
      raise VerifierError(f"run_tests: tests[{index}] is not valid Python ({error}); fix the "
                          "test data") from None
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
      0 < timeout_s <= 600):
    raise VerifierError(f"run_tests: `timeout_s` must be a number in (0, 600], got {timeout_s!r}")
  if isolation not in sandbox.ISOLATION_MODES:
    raise VerifierError(f"run_tests: `isolation` must be one of {sandbox.ISOLATION_MODES}, got "
                        f"{isolation!r}")
  if not isinstance(limits, SandboxLimits):
    raise VerifierError("run_tests: `limits` must be a SandboxLimits")
  limits.validate()


def run_tests(program: str, tests: list[str], *, timeout_s: float = 5.0,
              isolation: str = "namespaces", limits: SandboxLimits | None = None) -> TestResult:
  """Runs `tests` against `program` in the sandbox and counts the tests that passed.

  Args:
    program: Python source of the solution (untrusted).
    tests: Python snippets, each one test (trusted; they must compile).
    timeout_s: wall-clock budget for the whole run, start-up included; the CPU limit of the
      program's process is the same, rounded up, plus one second.
    isolation: "namespaces" (default; refuses to run where Linux namespaces are unavailable) or
      "rlimits_only" (explicit opt-in to weaker isolation; logs a warning).
    limits: resource limits; defaults to `SandboxLimits()`.

  Returns:
    A `TestResult`.

  Raises:
    VerifierError: on invalid arguments, or when the namespace sandbox is unavailable.
  """
  limits = SandboxLimits() if limits is None else limits
  _validate(program, tests, timeout_s, isolation, limits)
  if isolation == "namespaces":
    reason = sandbox.namespace_probe_failure()
    if reason is not None:
      raise VerifierError(
          f"the code sandbox cannot run here: {reason}. Enable unprivileged user namespaces "
          "(sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces>0) and install "
          "util-linux, or pass isolation='rlimits_only' to accept rlimit-only isolation (the "
          "program can then read host files and reach the network).")
  start = time.monotonic()
  outcome = sandbox.run_in_sandbox(program, list(tests), timeout_s=float(timeout_s),
                                   isolation=isolation, limits=limits)
  verdicts = tuple(outcome.verdicts.get(index, False) for index in range(len(tests)))
  status = outcome.status if outcome.status in STATUSES else "error"
  if status == "passed" and not all(verdicts):  # a verdict line was lost: never over-report
    status = "failed"
  reasons = tuple(outcome.reasons.get(index, "" if verdicts[index] else outcome.detail)
                  for index in range(len(tests)))
  return TestResult(passed=sum(verdicts), total=len(tests), status=status, test_passed=verdicts,
                    test_reasons=reasons,
                    detail=outcome.detail, wall_s=time.monotonic() - start, isolation=isolation,
                    pid_namespace=outcome.pid_namespace)
