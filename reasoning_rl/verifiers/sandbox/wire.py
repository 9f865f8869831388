"""The wire between the trusted test runner and the untrusted program's process.

Only plain data crosses it: None, bool, int, float, complex, str, bytes, list, tuple, dict, set and
frozenset, matched by *exact* type, so a subclass with a rigged `__eq__` can never arrive as a value.
Anything else the program returns crosses as an opaque handle (`{"h": id}`) that the trusted side can
only call, index or iterate, never compare by value. Frames are a 4-byte big-endian length followed by
UTF-8 JSON; JSON (not pickle, not marshal) because the receiving side must be able to parse bytes
written by hostile code without executing or crashing on anything.

This module is stdlib-only on purpose: it is copied into the sandbox and imported there by a bare
interpreter that cannot see this package.
"""

import base64
import json
import os
import select
import struct
import time
from typing import Any, Callable

MAX_FRAME_BYTES = 16 << 20
# Replies of the untrusted program are smaller: decoding one costs the trusted supervisor up to
# ~55x its size in memory (4 MiB of "[[],[],…]" is ~220 MB of lists, twice over while decoded).
MAX_REPLY_BYTES = 4 << 20
MAX_DEPTH = 200
_HEADER = struct.Struct(">I")


class WireError(Exception):
  """A frame is malformed, too large, or holds something that is not plain data."""


class PeerGone(Exception):
  """The other end closed its pipe (usually: the process exited or was killed)."""


class FrameTimeout(Exception):
  """No complete frame arrived before the deadline (the program ran past its time limit)."""


def to_wire(value: Any, handle_of: Callable[[Any], int], depth: int = 0) -> Any:
  """Encodes `value` as JSON-able data; non-plain objects become handles via `handle_of`."""
  if depth > MAX_DEPTH:
    raise WireError(f"value nested deeper than {MAX_DEPTH} levels")
  kind = type(value)
  if value is None or kind is bool or kind is str or kind is int or kind is float:
    return value
  if kind is list:
    return [to_wire(item, handle_of, depth + 1) for item in value]
  if kind is tuple:
    return {"t": [to_wire(item, handle_of, depth + 1) for item in value]}
  if kind is dict:
    return {"d": [[to_wire(k, handle_of, depth + 1), to_wire(v, handle_of, depth + 1)]
                  for k, v in value.items()]}
  if kind is set or kind is frozenset:
    tag = "s" if kind is set else "f"
    return {tag: [to_wire(item, handle_of, depth + 1) for item in value]}
  if kind is bytes:
    return {"b": base64.b64encode(value).decode("ascii")}
  if kind is complex:
    return {"c": [value.real, value.imag]}
  if getattr(kind, "__module__", None) == "numpy" and hasattr(value, "tolist"):
    # numpy scalars/arrays are ordinary answers; converting them here (on the sending side) is safe
    # because whatever `tolist` returns is itself re-checked for plain types.
    return to_wire(value.tolist(), handle_of, depth + 1)
  return {"h": handle_of(value)}


def from_wire(data: Any, resolve_handle: Callable[[int], Any], depth: int = 0) -> Any:
  """Decodes `to_wire` output strictly; anything unexpected raises `WireError`."""
  if depth > MAX_DEPTH:
    raise WireError(f"value nested deeper than {MAX_DEPTH} levels")
  kind = type(data)
  if data is None or kind is bool or kind is str or kind is int or kind is float:
    return data
  if kind is list:
    return [from_wire(item, resolve_handle, depth + 1) for item in data]
  if kind is not dict or len(data) != 1:
    raise WireError(f"malformed value of type {kind.__name__}")
  (tag, payload), = data.items()
  try:
    if tag == "h" and type(payload) is int:
      return resolve_handle(payload)
    if tag == "b" and type(payload) is str:
      return base64.b64decode(payload, validate=True)
    if tag == "c" and type(payload) is list and len(payload) == 2:
      return complex(float(payload[0]), float(payload[1]))
    if type(payload) is not list:
      raise WireError(f"malformed payload for tag {tag!r}")
    if tag == "d":
      return {from_wire(k, resolve_handle, depth + 1): from_wire(v, resolve_handle, depth + 1)
              for k, v in payload}
    items = [from_wire(item, resolve_handle, depth + 1) for item in payload]
    if tag == "t":
      return tuple(items)
    if tag == "s":
      return set(items)
    if tag == "f":
      return frozenset(items)
  except (TypeError, ValueError) as error:  # unhashable keys, bad base64, bad pairs …
    raise WireError(f"malformed {tag!r} value: {error}") from None
  raise WireError(f"unknown tag {tag!r}")


def encoded(message: Any) -> bytes:
  """The body of the frame `write_frame` would send for `message`."""
  return json.dumps(message, separators=(",", ":")).encode("utf-8")


def write_frame(fd: int, message: Any, max_bytes: int = MAX_FRAME_BYTES) -> None:
  """Writes one frame; raises `PeerGone` if the reader has gone, `WireError` if it is larger
  than `max_bytes`."""
  body = encoded(message)
  if len(body) > max_bytes:
    raise WireError(f"message of {len(body)} bytes exceeds {max_bytes}")
  view = memoryview(_HEADER.pack(len(body)) + body)
  try:
    while view:
      view = view[os.write(fd, view):]
  except (BrokenPipeError, OSError) as error:
    raise PeerGone(str(error)) from None


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
  chunks, remaining = [], size
  while remaining:
    if deadline is not None:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        raise FrameTimeout()
    try:
      chunk = os.read(fd, min(remaining, 1 << 20))
    except OSError as error:
      raise PeerGone(str(error)) from None
    if not chunk:
      raise PeerGone("end of stream")
    chunks.append(chunk)
    remaining -= len(chunk)
  return b"".join(chunks)


def read_frame(fd: int, deadline: float | None = None, max_bytes: int = MAX_FRAME_BYTES) -> Any:
  """Reads one frame (JSON value).

  Args:
    fd: the descriptor to read.
    deadline: a `time.monotonic()` instant, or None to block without limit.
    max_bytes: a larger frame is refused (`WireError`) from its header, before its body is read.
  """
  (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
  if size > max_bytes:
    raise WireError(f"frame of {size} bytes exceeds {max_bytes}")
  try:
    return json.loads(_read_exact(fd, size, deadline).decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as error:
    raise WireError(f"frame is not valid JSON: {error}") from None
  except MemoryError:  # past the supervisor's own memory limit
    raise WireError(f"frame of {size} bytes does not fit in memory once decoded") from None
