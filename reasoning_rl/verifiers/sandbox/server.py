"""Runs inside the untrusted process: loads the program, then answers the test runner's requests.

Nothing here is trusted. The program executes in this very interpreter and may rewrite any of it;
that is fine, because the verdict is decided elsewhere (see `supervisor.py`): this process
only ever hands back plain data or opaque handles, and it never sees the tests or their expected
values. Started as `python -I -c ...` with the request and response pipe numbers in argv.

Stdlib-only; copied into the sandbox next to `wire.py`.
"""

import sys
import types

import wire

_MESSAGE_CHARS = 500


class _Handles:
  """Keeps every object handed out alive, so an id stays valid for the whole run."""

  def __init__(self):
    self.objects: dict[int, object] = {}
    self._by_identity: dict[int, int] = {}

  def handle_of(self, value: object) -> int:
    key = id(value)
    if key not in self._by_identity:
      self._by_identity[key] = len(self.objects)
      self.objects[len(self.objects)] = value
    return self._by_identity[key]

  def resolve(self, handle: int) -> object:
    if handle not in self.objects:
      raise wire.WireError(f"unknown handle {handle}")
    return self.objects[handle]


def _error_reply(error: BaseException) -> dict:
  return {"ok": False, "exc": type(error).__name__, "msg": str(error)[:_MESSAGE_CHARS]}


def _answer(request: dict, handles: _Handles) -> dict:
  decode = lambda data: wire.from_wire(data, handles.resolve)  # noqa: E731
  target = handles.resolve(request["target"])
  op = request["op"]
  if op == "call":
    args = decode(request["args"])
    kwargs = decode(request["kwargs"])
    result = target(*args, **kwargs)
  elif op == "getattr":
    result = getattr(target, request["name"])
  elif op == "getitem":
    result = target[decode(request["key"])]
  elif op == "iter":
    result = iter(target)
  elif op == "next":
    result = next(target)
  elif op == "len":
    result = len(target)
  elif op == "bool":
    result = bool(target)
  elif op == "str":
    result = str(target)
  elif op == "repr":
    result = repr(target)
  else:
    raise wire.WireError(f"unknown op {op!r}")
  return {"ok": True, "value": wire.to_wire(result, handles.handle_of)}


def _offered_names(module: types.ModuleType, handles: _Handles) -> dict:
  """The module's public names as wire values. Plain values cross as data while they fit in half a
  reply frame together; the rest (and anything not plain) cross as handles."""
  names, budget = {}, wire.MAX_REPLY_BYTES // 2
  for name, value in list(module.__dict__.items()):
    if not name.isidentifier() or name.startswith("__"):
      continue
    try:
      data = wire.to_wire(value, handles.handle_of)
      size = len(wire.encoded(data))
      if size > budget:
        data, size = {"h": handles.handle_of(value)}, 16
      budget -= size
      names[name] = data
    except BaseException:  # a value that cannot be sent is simply not offered
      pass
  return names


def _reply(reply_fd: int, message: dict) -> None:
  wire.write_frame(reply_fd, message, wire.MAX_REPLY_BYTES)


def main() -> None:
  request_fd, reply_fd = int(sys.argv[1]), int(sys.argv[2])
  sys.set_int_max_str_digits(100_000)
  handles = _Handles()
  load = wire.read_frame(request_fd)
  module = types.ModuleType("solution")
  sys.modules["solution"] = module
  try:
    exec(compile(load["program"], "<program>", "exec"), module.__dict__)  # pylint: disable=exec-used
  except BaseException as error:  # SystemExit too: the program failed to load
    _reply(reply_fd, _error_reply(error))
    return
  _reply(reply_fd, {"ok": True, "names": _offered_names(module, handles)})
  while True:
    try:
      request = wire.read_frame(request_fd)
    except wire.PeerGone:
      return
    try:
      _reply(reply_fd, _answer(request, handles))
    except wire.PeerGone:
      return
    except BaseException as error:  # the program's own exceptions, SystemExit, a value too large
      _reply(reply_fd, _error_reply(error))


if __name__ == "__main__":
  main()
