"""Host-side messages between the processes of a run, through JAX's coordination service.

Every process runs the same loop; the decisions the loop takes on the host (which groups were kept,
whether a guard trips, whether to save and stop) must be identical everywhere, or the processes
would part ways and hang in their next collective. So every host value a decision depends on has one
owner that computes it and publishes it, and every process reads the same bytes: `broadcast` (one
owner) and `gather` (each process contributes its part, everyone gets the list in process order).

Values are JSON, zlib-compressed, split into chunks under the store's message limits. Keys carry a
call counter that advances identically on every process (they make the same calls in the same
order). A process deletes its own keys once a `gather` completes: every process has published
its part of that gather, so every process has read everything before it. A lost peer is handled by
the runtime's watcher (`runtime.watch_peers`), so the waits here need no timeout of their own beyond
a generous bound; should the coordination service itself vanish under a wait, the process ends the
same way the watcher would end it (`runtime.stop_lost_run`), not with an abort at exit.

The store is for control messages. It lives in process 0, which holds and relays every value, and
each value here is read by every process: a large one costs every host, and a slow one stalls them
all. A value whose compressed form exceeds `MAX_VALUE_BYTES` (1 MiB) is refused with an error
naming its key; bulk data (rollouts, evaluation records) goes through the files of
`multihost.bulk` and only their descriptors through here (docs/multihost.md, "Channels").
"""

from __future__ import annotations

import contextlib
import json
import time
import zlib
from typing import Any

from reasoning_rl.errors import ReasoningRLError
from reasoning_rl.multihost import runtime
from reasoning_rl.multihost.bulk import Trace, encode

MAX_VALUE_BYTES = 1 << 20  # compressed; bulk values go through multihost.bulk
_CHUNK_BYTES = 8 << 20
_WAIT_MS = 24 * 3600 * 1000  # a lost peer ends the process long before this (runtime.py)


@contextlib.contextmanager
def _service_calls():
  """A coordination-service call that finds the service gone ends the run like a lost peer."""
  try:
    yield
  except Exception as error:  # pylint: disable=broad-except
    if not str(error).startswith("UNAVAILABLE"):
      raise
    runtime.stop_lost_run("the coordination service (process 0) is unreachable: "
                          f"{str(error).splitlines()[0]}")


class ValueTooLarge(ReasoningRLError):
  """A value too large for the coordination service's store (a bug of the caller: bulk data
  belongs in `multihost.bulk`)."""


class LocalExchange:
  """The single-process exchange: nothing to send, every value is already everyone's."""

  process_index = 0
  num_processes = 1

  def broadcast(self, name: str, value: Any = None, *, source: int = 0) -> Any:  # noqa: ARG002
    del name, source
    return value

  def gather(self, name: str, value: Any) -> list:
    del name
    return [value]

  def any(self, name: str, flag: bool) -> bool:
    del name
    return bool(flag)


class Exchange(LocalExchange):
  """Broadcast / gather of JSON values among all processes of a `jax.distributed` run."""

  def __init__(self, client=None, *, process_index: int | None = None,
               num_processes: int | None = None, prefix: str = "reasoning_rl"):
    import jax  # pylint: disable=import-outside-toplevel

    if client is None:
      from jax._src import distributed  # pylint: disable=import-outside-toplevel

      client = distributed.global_state.client
    self._client = client
    self.process_index = jax.process_index() if process_index is None else process_index
    self.num_processes = jax.process_count() if num_processes is None else num_processes
    self._prefix = prefix
    self._calls = 0
    self._published: dict[int, list[str]] = {}
    self.max_value_bytes = MAX_VALUE_BYTES
    self.last_gather = 0  # the newest gather call this process completed (multihost.bulk)
    self._trace = Trace(self.process_index)

  @property
  def calls(self) -> int:
    """Exchange calls made so far (the same count on every process)."""
    return self._calls

  def _key(self, call: int, name: str, source: int) -> str:
    return f"{self._prefix}/{call}/{name}/{source}"

  def _publish(self, call: int, key: str, value: Any) -> None:
    start = time.perf_counter()
    data = encode(value)
    if len(data) > self.max_value_bytes:
      raise ValueTooLarge(
          f"exchange value {key!r}: {len(data)} bytes compressed, over the coordination store's "
          f"limit of {self.max_value_bytes} bytes; send bulk data through "
          "reasoning_rl.multihost.bulk (a file in the workdir) and only its descriptor here")
    chunks = [data[i:i + _CHUNK_BYTES] for i in range(0, len(data), _CHUNK_BYTES)] or [b""]
    keys = [f"{key}/{i}" for i in range(len(chunks))]
    for chunk_key, chunk in zip(keys, chunks):
      self._client.key_value_set_bytes(chunk_key, chunk)
    self._client.key_value_set(f"{key}/n", str(len(chunks)))  # last: the value is complete
    self._published[call] = keys + [f"{key}/n"]
    self._trace.record("store", "write", key.split("/")[-2], len(data),
                       time.perf_counter() - start)

  def _delete_before(self, call: int) -> None:
    for old in [c for c in self._published if c < call]:
      for old_key in self._published.pop(old):
        self._client.key_value_delete(old_key)

  def _read(self, key: str) -> Any:
    count = int(self._client.blocking_key_value_get(f"{key}/n", _WAIT_MS))
    start = time.perf_counter()  # the value is complete: from here on, transfer and decoding
    data = b"".join(self._client.blocking_key_value_get_bytes(f"{key}/{i}", _WAIT_MS)
                    for i in range(count))
    value = json.loads(zlib.decompress(data))
    self._trace.record("store", "read", key.split("/")[-2], len(data), time.perf_counter() - start)
    return value

  def broadcast(self, name: str, value: Any = None, *, source: int = 0) -> Any:
    """`source`'s value on every process (the others' `value` is ignored)."""
    self._calls += 1
    key = self._key(self._calls, name, source)
    with _service_calls():
      if self.process_index == source:
        self._publish(self._calls, key, value)
      return self._read(key)

  def gather(self, name: str, value: Any) -> list:
    """Every process's value, in process order, on every process."""
    self._calls += 1
    with _service_calls():
      self._publish(self._calls, self._key(self._calls, name, self.process_index), value)
      values = [self._read(self._key(self._calls, name, p)) for p in range(self.num_processes)]
      self._delete_before(self._calls)
    self.last_gather = self._calls
    return values

  def any(self, name: str, flag: bool) -> bool:
    """True on every process when any process passes True (e.g. a signal one process caught)."""
    return any(self.gather(name, bool(flag)))
