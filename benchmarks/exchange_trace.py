"""Runs launch/train.py (the path in argv[1], further arguments its flags) with every coordination
store operation of its `Exchange` traced, for revisions whose exchange traces nothing itself:
the same JSON lines `reasoning_rl.multihost.bulk.Trace` writes (channel, op, name, bytes, s) to
`$REASONING_RL_EXCHANGE_TRACE/p<process>.jsonl`. Read seconds start once a value is complete (the
wait for its writer is not the channel's cost), as in the traced exchange. Used by
`benchmarks/multihost_channels.py` for the "before" side."""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time

_waited = threading.local()


def _record(process: int, op: str, key: str, num_bytes: int, seconds: float) -> None:
  directory = os.environ["REASONING_RL_EXCHANGE_TRACE"]
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, f"p{process}.jsonl"), "a", encoding="utf-8") as handle:
    handle.write(json.dumps({"channel": "store", "op": op, "name": key.split("/")[-2],
                             "bytes": num_bytes, "s": round(seconds, 6)}) + "\n")


class _CountingClient:
  """The coordination client, counting the bytes of values and the time spent waiting."""

  def __init__(self, client):
    self._client, self.moved = client, 0

  def key_value_set_bytes(self, key, value):
    self.moved += len(value)
    return self._client.key_value_set_bytes(key, value)

  def blocking_key_value_get_bytes(self, key, timeout_ms):
    value = self._client.blocking_key_value_get_bytes(key, timeout_ms)
    self.moved += len(value)
    return value

  def blocking_key_value_get(self, key, timeout_ms):
    start = time.perf_counter()
    try:
      return self._client.blocking_key_value_get(key, timeout_ms)
    finally:
      _waited.s = getattr(_waited, "s", 0.0) + time.perf_counter() - start

  def __getattr__(self, name):
    return getattr(self._client, name)


def _patch() -> None:
  from reasoning_rl.multihost import exchange  # pylint: disable=import-outside-toplevel

  if hasattr(exchange, "MAX_VALUE_BYTES"):
    return  # this revision traces itself
  original_init, publish, read = (exchange.Exchange.__init__, exchange.Exchange._publish,
                                  exchange.Exchange._read)

  def init(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    self._client = _CountingClient(self._client)

  def traced_publish(self, call, key, value):
    before, start = self._client.moved, time.perf_counter()
    publish(self, call, key, value)
    _record(self.process_index, "write", key, self._client.moved - before,
            time.perf_counter() - start)

  def traced_read(self, key):
    before, start, _waited.s = self._client.moved, time.perf_counter(), 0.0
    value = read(self, key)
    _record(self.process_index, "read", key, self._client.moved - before,
            time.perf_counter() - start - _waited.s)
    return value

  exchange.Exchange.__init__ = init
  exchange.Exchange._publish = traced_publish
  exchange.Exchange._read = traced_read


if __name__ == "__main__":
  script = sys.argv[1]
  sys.argv = sys.argv[1:]
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(script))))
  _patch()
  runpy.run_path(script, run_name="__main__")
