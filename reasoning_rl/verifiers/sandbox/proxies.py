"""What the tests see of the program: proxies of its objects, its exceptions, and its names.

Trusted side (imported by `supervisor.py`); stdlib only. The rules, each closing a way a program
could pass a test without computing the answer:

* An object of the program that is not plain data arrives as a `Remote`. It can be called, have
  attributes read, be indexed, iterated and measured (len, bool, str), and compared by identity
  (`is`); comparing it by value (`==`, `!=`, `<`, `in`, `not in`) or hashing it raises TypeError.
  Comparisons are therefore made on plain values the harness rebuilt from the wire, never on an
  object whose answers the program chooses (an object that "equals nothing" would pass every
  `!=` and `not in` a test makes).
* A StopIteration or StopAsyncIteration leaving the program anywhere but an iterator's `next`
  becomes a `RemoteError`: raised from a function that `map` or a generator calls, it would
  otherwise end the test's loop early and silently (`all(map(...))` of nothing is True).
* The program's names are visible to a test except names the suite itself uses as its own
  (`suite_names`: bound anywhere in any test, or a conventional test name such as `check`): those
  resolve to the test's own binding or raise NameError, so a program defining `check` or
  `expected` cannot stand in for a test's helper that a test forgot to define.
"""

from __future__ import annotations

import ast
import builtins

WHY_CHARS = 300
# Names test suites give their own helpers and expected values (HumanEval's `check(candidate)`);
# never taken from the program, even by a test that does not define them.
TEST_SCAFFOLDING_NAMES = frozenset({"check", "candidate", "expected"})
_CONTROL_FLOW = ("StopIteration", "StopAsyncIteration")
BUILTIN_NAMES = frozenset(dir(builtins))


class RemoteError(Exception):
  """An exception raised by the program that has no builtin counterpart here, or a control-flow
  exception that left the program where it may not."""


def remote_exception(name: object, message: object, op: str) -> Exception:
  """Rebuilds an exception the program raised during `op` as a builtin Exception subclass, or
  RemoteError.

  Never a BaseException outside Exception (SystemExit, KeyboardInterrupt…): those would act on
  this process instead of failing a test. Never StopIteration / StopAsyncIteration except
  StopIteration from `next` (the end of an iterator): elsewhere they would act as control flow
  in the test.
  """
  name, text = str(name), str(message)[:WHY_CHARS]
  if name in _CONTROL_FLOW and not (op == "next" and name == "StopIteration"):
    return RemoteError(f"the program raised {name} ({text}) out of a {op}; a control-flow "
                       "exception leaving the program is an error")
  kind = getattr(builtins, name, None)
  if isinstance(kind, type) and issubclass(kind, Exception):
    try:
      return kind(text)
    except Exception:  # builtins with a richer constructor (UnicodeDecodeError …)
      pass
  return RemoteError(f"{name}: {text}")


def _refuse_comparison(*_):
  raise TypeError("an object of the program (not plain data) cannot be compared by value or "
                  "hashed: compare the plain values it gives (its attributes, list(it), str(it)), "
                  "or identity with `is`")


class Remote:
  """An object that lives in the program's process; calls, attribute reads, indexing,
  iteration, len, bool and str are forwarded. Identity (`is`) is its only comparison."""

  __slots__ = ("_connection", "_handle")

  def __init__(self, connection, handle: int):
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

  __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __contains__ = _refuse_comparison
  __hash__ = _refuse_comparison


class _BoundNames(ast.NodeVisitor):
  """Collects every name a piece of code binds, in any scope."""

  def __init__(self):
    self.names: set[str] = set()

  def visit_Name(self, node: ast.Name) -> None:  # noqa: N802 (ast's names)
    if isinstance(node.ctx, (ast.Store, ast.Del)):
      self.names.add(node.id)

  def _definition(self, node) -> None:
    self.names.add(node.name)
    self.generic_visit(node)

  visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _definition  # noqa: N815

  def visit_arg(self, node: ast.arg) -> None:
    self.names.add(node.arg)

  def visit_alias(self, node: ast.alias) -> None:
    self.names.add(node.asname or node.name.split(".")[0])

  def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:  # noqa: N802
    if node.name:
      self.names.add(node.name)
    self.generic_visit(node)

  def visit_Global(self, node: ast.Global) -> None:  # noqa: N802
    self.names.update(node.names)

  visit_Nonlocal = visit_Global  # noqa: N815

  def visit_MatchAs(self, node) -> None:  # noqa: N802
    if node.name:
      self.names.add(node.name)
    self.generic_visit(node)

  def visit_MatchStar(self, node) -> None:  # noqa: N802
    if node.name:
      self.names.add(node.name)

  def visit_MatchMapping(self, node) -> None:  # noqa: N802
    if node.rest:
      self.names.add(node.rest)
    self.generic_visit(node)


def suite_names(tests: list[str]) -> frozenset[str]:
  """Names the tests own: bound anywhere in any test (a helper one test defines and another
  calls stays the tests' even there), plus TEST_SCAFFOLDING_NAMES and the builtins."""
  collector = _BoundNames()
  for test in tests:
    try:
      collector.visit(ast.parse(test))
    except SyntaxError:  # run_tests compiled them already; a test that does not parse fails
      pass
  return frozenset(collector.names) | TEST_SCAFFOLDING_NAMES | BUILTIN_NAMES
