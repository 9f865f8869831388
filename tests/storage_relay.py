"""A TCP relay in front of a storage server that can go silent or slow on command: the stalled
storage path of issue 49, made on purpose.

`Relay(port)` listens on a free local port and forwards every connection to 127.0.0.1:`port` (the
GCS emulator). `silence()` stops forwarding in both directions while every socket stays open and
new connections are still accepted: a client sees a server that takes its request and never
answers, what fake-gcs-server does by itself under load and what a half-open connection to GCS
looks like. `slow(bytes_per_s)` forwards at that rate; `relay()` goes back to normal (what was
held back then flows). The relay runs in threads of the process that made it.

By hand (a run against a store you can stall from another terminal):

    python -m tests.storage_relay --port EMULATOR_PORT --control FILE
    # prints: export STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT
    echo silent > FILE    # or: echo slow 20000 > FILE / echo relay > FILE
"""

from __future__ import annotations

import argparse
import pathlib
import select
import socket
import threading
import time

_CHUNK = 16384


class Relay:
  def __init__(self, target_port: int, *, target_host: str = "127.0.0.1"):
    self._target = (target_host, target_port)
    self._listener = socket.socket()
    self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._listener.bind(("127.0.0.1", 0))
    self._listener.listen(128)
    self.port = self._listener.getsockname()[1]
    self._mode: tuple[str, float] = ("relay", 0.0)
    self._closed = threading.Event()
    self._sockets: list[socket.socket] = []
    self._lock = threading.Lock()
    self.connections = 0  # accepted so far
    threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def silence(self) -> None:
    self._mode = ("silent", 0.0)

  def slow(self, bytes_per_s: float) -> None:
    self._mode = ("slow", float(bytes_per_s))

  def relay(self) -> None:
    self._mode = ("relay", 0.0)

  @property
  def mode(self) -> str:
    return self._mode[0]

  def close(self) -> None:
    self._closed.set()
    with self._lock:
      for sock in [self._listener, *self._sockets]:
        try:
          sock.close()
        except OSError:
          pass

  def _accept(self) -> None:
    while not self._closed.is_set():
      try:
        client, _ = self._listener.accept()
      except OSError:
        return
      try:
        upstream = socket.create_connection(self._target, timeout=10)
      except OSError:
        client.close()
        continue
      upstream.settimeout(None)
      pair = [client, upstream]
      with self._lock:
        self._sockets += pair
        self.connections += 1
      ended = threading.Barrier(2, action=lambda pair=pair: self._release(pair))
      for source, sink in ((client, upstream), (upstream, client)):
        threading.Thread(target=self._pump, args=(source, sink, ended), daemon=True).start()

  def _release(self, pair: list[socket.socket]) -> None:
    """Both directions of a connection ended: its sockets are closed (a long soak opens
    thousands)."""
    with self._lock:
      for sock in pair:
        if sock in self._sockets:
          self._sockets.remove(sock)
        sock.close()

  def _pump(self, source: socket.socket, sink: socket.socket, ended: threading.Barrier) -> None:
    """Copies source to sink while relaying; holds everything (reads nothing) while silent."""
    readable = select.poll()  # select.select refuses descriptors above 1023
    readable.register(source, select.POLLIN)
    try:
      while not self._closed.is_set():
        mode, rate = self._mode
        if mode == "silent":
          time.sleep(0.05)
          continue
        try:
          if not readable.poll(50):
            continue
          data = source.recv(_CHUNK if mode == "relay" else max(1, min(_CHUNK, int(rate / 20))))
        except OSError:
          data = b""
        if not data:
          self._shut(sink)
          return
        try:
          sink.sendall(data)
        except OSError:
          self._shut(source)
          return
        if mode == "slow":
          time.sleep(len(data) / rate)
    finally:
      try:
        ended.wait(timeout=3600)
      except threading.BrokenBarrierError:
        pass

  @staticmethod
  def _shut(sock: socket.socket) -> None:
    try:
      sock.shutdown(socket.SHUT_WR)
    except OSError:
      pass


def main() -> None:
  parser = argparse.ArgumentParser(description="A relay to a storage server that can stall.")
  parser.add_argument("--port", type=int, required=True, help="the server's local port")
  parser.add_argument("--control", required=True,
                      help="a file holding 'relay', 'silent' or 'slow BYTES_PER_S'")
  args = parser.parse_args()
  relay = Relay(args.port)
  control = pathlib.Path(args.control)
  control.write_text("relay\n")
  print(f"export STORAGE_EMULATOR_HOST={relay.url}", flush=True)
  applied = None
  try:
    while True:
      words = control.read_text().split() if control.exists() else ["relay"]
      if words != applied:
        {"silent": lambda: relay.silence(), "slow": lambda: relay.slow(float(words[1]))}.get(
            words[0] if words else "relay", relay.relay)()
        applied = words
      time.sleep(0.2)
  except KeyboardInterrupt:
    relay.close()


if __name__ == "__main__":
  main()
