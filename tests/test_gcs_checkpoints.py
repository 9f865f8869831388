"""Checkpoints on gs:// (issue 26): a run that saves every other step finishes, a SIGTERM during a
slow save ends in 143 with complete checkpoints and the rerun resumes, and neither a save's
manifest nor a restore's check downloads the step's files (GCS's own checksums are compared).

Against a real emulator (fake-gcs-server, tests/gcs_emulator.py); only STORAGE_EMULATOR_HOST is
set, as a user would.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl import checkpointing, storage
from reasoning_rl import metrics as metrics_lib
from reasoning_rl.checkpointing import CHECKSUMS_FILE, Checkpointer
from tests.multihost_runs import REPO, environment
from tests.test_storage import emulator, remote  # noqa: F401 (fixtures: the emulator, a gs:// dir)


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
  assert checkpointing.verify_checksums(step_dir)
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
# log pipe filled): a write must fail after gcsfs's retries, not wait forever. Read timeout and
# retry backoff are shortened so the test takes seconds; the timeouts themselves are the code's.
_SILENT_STORE = textwrap.dedent("""
    import os, socket, threading
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(64)],
                     daemon=True).start()
    os.environ["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:%d" % listener.getsockname()[1]
    from reasoning_rl import storage
    storage.GCS_READ_TIMEOUT_S = 0.5
    storage.configure_emulator()
    import asyncio, gcsfs.retry
    fast = asyncio.sleep
    gcsfs.retry.asyncio = type("NoBackoff", (), {"sleep": staticmethod(lambda _: fast(0))})
    try:
      storage.atomic_write("gs://bucket/run/metrics.jsonl", "{}")
    except OSError as error:
      print("failed:", type(error).__name__, "after", len(held), "connections")
""")


def test_a_store_that_stops_answering_fails_the_write_instead_of_hanging():
  env = {**environment(devices=1), "PYTHONPATH": str(REPO)}
  env.pop("STORAGE_EMULATOR_HOST", None)
  child = subprocess.run([sys.executable, "-c", _SILENT_STORE], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
  assert "failed: FSTimeoutError after" in child.stdout, child.stdout + child.stderr[-3000:]


# ------------------------------------------------------------------------------ whole runs

# launch/train.py with the checksum listing of step 1's save made slow: the test's SIGTERM lands
# while that save is still in flight (the marker file says when it started)
_SLOW_SAVE = textwrap.dedent("""
    import pathlib, runpy, sys, time
    from reasoning_rl import storage
    marker, delay = pathlib.Path(sys.argv[1]), float(sys.argv[2])
    real = storage.stored_checksums

    def slow(directory):
      if str(directory).rstrip("/").endswith("/checkpoints/1"):
        marker.write_text("saving")
        time.sleep(delay)
      return real(directory)

    storage.stored_checksums = slow
    sys.argv = sys.argv[3:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def _train_command(workdir, *prefix):
  return [sys.executable, *prefix, str(REPO / "launch" / "train.py"),
          "--config=configs/debug_cpu.py", f"--config.workdir={workdir}",
          "--config.total_steps=5", "--config.checkpoint.every_steps=1",
          "--config.checkpoint.keep=5", "--config.logging.progress_bar=False"]


def test_sigterm_during_a_slow_gcs_save_then_a_rerun_with_three_checkpoints_finishes(
    emulator, remote, tmp_path):
  """The issue's run hung at its second checkpoint; here the first process is stopped by SIGTERM
  while step 1's save is slow (exit 143, every checkpoint complete), and the rerun resumes and
  writes at least three more checkpoints (3, 4, 5) in one process, each after the previous one."""
  env = {**environment(devices=1), "STORAGE_EMULATOR_HOST": emulator.url,
         storage.CACHE_ENV: str(tmp_path / "cache")}
  marker = tmp_path / "slow_save_started"
  first = subprocess.Popen(_train_command(remote, "-c", _SLOW_SAVE, str(marker), "6"), cwd=REPO,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.monotonic() + 300
  while not marker.exists():
    assert first.poll() is None, first.stdout.read()
    assert time.monotonic() < deadline, "step 1's save never started"
    time.sleep(0.1)
  first.send_signal(signal.SIGTERM)
  output, _ = first.communicate(timeout=300)
  assert first.returncode == 143, output
  assert "preempted" in output
  directory = f"{remote}/checkpoints"
  with Checkpointer(directory) as ckpt:
    saved = ckpt.all_steps()
  assert saved and saved[0] == 1, saved
  for step in saved:  # the slow save was completed, checksums included, before the exit
    assert checkpointing.verify_checksums(f"{directory}/{step}"), step

  rerun = subprocess.run(_train_command(remote), cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stdout + rerun.stderr
  with Checkpointer(directory) as ckpt:
    assert ckpt.all_steps() == [1, 2, 3, 4, 5]
  for step in (3, 4, 5):
    manifest = json.loads(storage.path(f"{directory}/{step}/{CHECKSUMS_FILE}").read_text())
    assert manifest["version"] == 3 and checkpointing.verify_checksums(f"{directory}/{step}")
  rows = metrics_lib.read_metrics(f"{remote}/metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, 6))  # resumed: none lost, none repeated
