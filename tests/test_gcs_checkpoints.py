"""Checkpoints on gs:// (issue 26): neither a save's manifest nor a restore's check downloads the
step's files (GCS's own checksums are compared), and a store that stops answering fails a write
instead of hanging it. Whole runs against slow and silent stores: tests/test_gcs_deadlines.py.

Against a real emulator (fake-gcs-server, tests/gcs_emulator.py); only STORAGE_EMULATOR_HOST is
set, as a user would.
"""

import json
import subprocess
import sys
import textwrap
import urllib.parse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl import checkpoint_manifest, storage
from reasoning_rl.checkpoint_manifest import CHECKSUMS_FILE
from reasoning_rl.checkpointing import Checkpointer
from tests.multihost_runs import REPO, environment
from tests.support.cloud import emulator, remote  # noqa: F401 (fixtures: the emulator, a gs:// dir)


# ------------------------------------------------------------------------------ no re-reads


def _tree(scale):
  """64 KiB of random weights: what compression cannot shrink, so the data files are the bulk."""
  return {"w": jax.random.normal(jax.random.key(0), (16384,)) * scale, "rng": jax.random.key(3)}


def _abstract():
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _tree(1.0))


@pytest.fixture
def reads(emulator, monkeypatch):
  """{"bucket/object": bytes} downloaded through gcsfs, counted at its HTTP layer (what storage
  and Orbax's JSON items read; tensorstore reads the arrays with its own client)."""
  storage.configure_emulator()  # before gcsfs is imported (it picks its class then)
  import gcsfs

  seen: dict[str, int] = {}
  real_request = gcsfs.core.GCSFileSystem._request

  async def request(self, method, path, *args, **kwargs):
    result = await real_request(self, method, path, *args, **kwargs)
    url = self._format_path(path, args)
    if method == "GET" and "/download/storage/v1/b/" in url:
      bucket, _, rest = url.split("/download/storage/v1/b/", 1)[1].partition("/o/")
      name = f"{bucket}/{urllib.parse.unquote(rest.split('?', 1)[0])}"
      seen[name] = seen.get(name, 0) + len(result[3])
    return result

  monkeypatch.setattr(gcsfs.core.GCSFileSystem, "_request", request)
  return seen


def _data_files(step_dir: str) -> dict[str, int]:
  """{"bucket/object": bytes} of a step's array data (the checkpoint's bulk)."""
  return {str(f)[len("gs://"):]: storage.size(f) for f in storage.list_files(step_dir)
          if "/d/" in str(f)}


def test_gcs_manifests_are_written_and_checked_without_reading_the_step(remote, reads):
  directory = f"{remote}/checkpoints"
  with Checkpointer(directory, keep=3) as ckpt:
    for step in (1, 2):
      ckpt.save(step, _tree(float(step)), {"step": step}, force=True)
  step_dir = f"{directory}/2"
  data = _data_files(step_dir)
  assert data and sum(data.values()) > 60_000
  assert not set(reads) & set(data)  # saving hashed no array file ...
  assert sum(reads.values()) < sum(data.values()) / 8  # ... only small metadata
  names = {storage.relative_name(f, step_dir) for f in storage.list_files(step_dir)}
  manifest = json.loads(storage.path(f"{step_dir}/{CHECKSUMS_FILE}").read_text())
  assert set(manifest["files"]) == names - {CHECKSUMS_FILE}

  reads.clear()
  assert checkpoint_manifest.verify_checksums(step_dir)
  assert [name.rsplit("/", 1)[-1] for name in reads] == [CHECKSUMS_FILE]  # the manifest only
  reads.clear()
  with Checkpointer(directory, keep=3) as ckpt:
    step, state, meta = ckpt.restore_latest(_abstract())
  assert (step, meta) == (2, {"step": 2})
  np.testing.assert_array_equal(state["w"], _tree(2.0)["w"])
  assert not set(reads) & set(data)  # the arrays were read once, by tensorstore
  assert sum(reads.values()) < sum(data.values()) / 8  # JSON items, metadata, the manifest


# ------------------------------------------------------------------------------ a silent store

# A store that accepts connections and never answers (what the emulator became once its unread
# log pipe filled): a write must fail, not wait forever. Either gcsfs's own read timeout and
# retries give up first (here shortened, with no backoff, so the test takes seconds), or the
# deadline on the whole request (storage.timeout_s, here 1 s) does.
_SILENT_STORE = textwrap.dedent("""
    import os, socket, sys, threading, time
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(64)],
                     daemon=True).start()
    os.environ["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:%d" % listener.getsockname()[1]
    from reasoning_rl import deadlines, storage
    from reasoning_rl.errors import StorageTimeout
    if sys.argv[1] == "gcsfs":
      storage.GCS_READ_TIMEOUT_S = 0.5
      storage.configure_emulator()
      import asyncio, gcsfs.retry
      fast = asyncio.sleep
      gcsfs.retry.asyncio = type("NoBackoff", (), {"sleep": staticmethod(lambda _: fast(0))})
    else:
      deadlines.configure(timeout_s=1.0)
    start = time.monotonic()
    try:
      storage.atomic_write("gs://bucket/run/metrics.jsonl", "{}")
    except (OSError, StorageTimeout) as error:
      print("failed:", type(error).__name__, "after", len(held), "connections:", error)
      print("seconds:", time.monotonic() - start)
""")


@pytest.mark.parametrize("who, expected", [
    ("gcsfs", "failed: FSTimeoutError after"),
    ("deadline", "failed: StorageTimeout after 1 connections: gs://bucket/run/metrics.jsonl: "
                 "storage stalled: a POST request did not finish within 1 s"),
])
def test_a_store_that_stops_answering_fails_the_write_instead_of_hanging(who, expected):
  env = {**environment(devices=1), "PYTHONPATH": str(REPO)}
  env.pop("STORAGE_EMULATOR_HOST", None)
  child = subprocess.run([sys.executable, "-c", _SILENT_STORE, who], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
  assert expected in child.stdout, child.stdout + child.stderr[-3000:]
  seconds = float(child.stdout.split("seconds:")[1])
  assert seconds < 60 and (who == "gcsfs" or seconds >= 1.0), seconds
