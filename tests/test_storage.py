"""gs:// paths against a real GCS emulator (fake-gcs-server), started by these tests.

Only `STORAGE_EMULATOR_HOST` is set, as a user would; everything else (tensorstore inside Orbax,
gcsfs behind etils.epath) must find the emulator by itself.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl import metrics as metrics_lib
from reasoning_rl import storage
from reasoning_rl.checkpoint_manifest import CHECKSUMS_FILE
from reasoning_rl.checkpointing import Checkpointer
from reasoning_rl.errors import ConfigError
from reasoning_rl.workdir import check_workdir_writable
from tests.multihost_runs import REPO, environment, metrics_rows
from tests.support.cloud import BUCKET, emulator, remote  # noqa: F401 (fixtures)


# ------------------------------------------------------------------------------ primitives


def test_paths_are_local_or_epath():
  assert isinstance(storage.path("/tmp/x"), pathlib.Path)
  assert not storage.is_remote("/tmp/gs:/x") and storage.is_remote("gs://b/x")


def test_atomic_write_read_list_and_move(remote):
  storage.atomic_write(f"{remote}/a/one.txt", "first")
  storage.atomic_write(f"{remote}/a/one.txt", "second")
  storage.atomic_write(f"{remote}/a/b/two.bin", b"\x00\x01")
  assert storage.path(f"{remote}/a/one.txt").read_text() == "second"
  names = [storage.relative_name(f, remote) for f in storage.list_files(remote)]
  assert names == ["a/b/two.bin", "a/one.txt"]
  storage.move(f"{remote}/a", f"{remote}/moved")
  assert [storage.relative_name(f, remote) for f in storage.list_files(remote)] == [
      "moved/b/two.bin", "moved/one.txt"]


def test_append_composes_without_rewriting(remote):
  target = f"{remote}/log.txt"
  for part in (b"alpha\n", b"beta\n", b"", b"gamma\n"):
    storage.append_remote(target, part)
  assert storage.path(target).read_bytes() == b"alpha\nbeta\ngamma\n"
  assert [storage.relative_name(f, remote) for f in storage.list_files(remote)] == ["log.txt"]


def test_stored_checksums_are_gcs_own_and_equal_the_bytes_hashed(remote, tmp_path):
  """The listing's MD5 / CRC32C (no object read) are what hashing the bytes gives, on gs:// and
  for the same file on a local disk: a manifest stays checkable after a copy either way."""
  data = os.urandom(3000)
  storage.atomic_write(f"{remote}/x.bin", data)
  (tmp_path / "x.bin").write_bytes(data)
  stored = storage.stored_checksums(remote)
  both = ("md5", "crc32c")
  assert stored == storage.file_checksums(remote, kinds=both) == storage.file_checksums(
      tmp_path, kinds=both)
  assert stored["x.bin"]["bytes"] == 3000 and set(stored["x.bin"]) == {"bytes", "md5", "crc32c"}
  assert storage.stored_checksums(tmp_path) is None  # a filesystem keeps none
  with pytest.raises(FileNotFoundError, match="y.bin"):
    storage.file_checksums(remote, ["y.bin"])


def test_gcs_clients_give_up_on_a_silent_connection(emulator):
  """gcsfs sets no request timeout of its own: a store that stops answering hung the run."""
  import fsspec

  storage.path(f"gs://{BUCKET}/x")
  for client in (fsspec.filesystem("gs"), fsspec.filesystem("gcs", finalize_on_close=True)):
    timeout = client.requests_timeout
    assert (timeout.sock_read, timeout.sock_connect, timeout.total) == (
        storage.GCS_READ_TIMEOUT_S, storage.GCS_CONNECT_TIMEOUT_S, None)


def test_staged_files_append_on_sync_and_rewrite_when_replaced(remote, monkeypatch):
  local = storage.staged(remote, "logs/run.log")
  local.write_text("one\n")
  storage.sync_staged(force=True)
  assert storage.path(f"{remote}/logs/run.log").read_text() == "one\n"
  with open(local, "a") as handle:
    handle.write("two\n")
  monkeypatch.setattr(storage, "SYNC_INTERVAL_S", 3600.0)
  storage.sync_staged()  # within the interval: not copied yet
  assert storage.path(f"{remote}/logs/run.log").read_text() == "one\n"
  storage.sync_staged(force=True)
  assert storage.path(f"{remote}/logs/run.log").read_text() == "one\ntwo\n"
  storage.replace_staged(remote, "logs/run.log", b"fresh\n")
  with open(local, "a") as handle:
    handle.write("more\n")
  storage.sync_staged(force=True)
  assert storage.path(f"{remote}/logs/run.log").read_text() == "fresh\nmore\n"


def test_local_copy_downloads_once_and_refreshes_changed_files(remote, tmp_path, monkeypatch):
  monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
  storage.atomic_write(f"{remote}/model/config.json", "{}")
  storage.atomic_write(f"{remote}/model/weights.bin", b"1234")
  local = storage.local_copy(f"{remote}/model")
  assert sorted(p.name for p in local.iterdir()) == ["config.json", "weights.bin"]
  stamp = (local / "weights.bin").stat().st_mtime_ns
  assert storage.local_copy(f"{remote}/model") == local
  assert (local / "weights.bin").stat().st_mtime_ns == stamp  # cached, not fetched again
  storage.atomic_write(f"{remote}/model/weights.bin", b"5678")
  storage.local_copy(f"{remote}/model")
  assert (local / "weights.bin").read_bytes() == b"5678"
  with pytest.raises(FileNotFoundError):
    storage.local_copy(f"{remote}/absent")


def test_missing_bucket_is_one_config_error(emulator):
  with pytest.raises(ConfigError, match="config.workdir=gs://no-such-bucket-x/run: cannot be written"):
    check_workdir_writable("gs://no-such-bucket-x/run", field="config.workdir")


# ------------------------------------------------------------------------------ run files


def test_metrics_on_gcs_resume_keeps_exactly_the_checkpointed_rows(remote):
  with metrics_lib.MetricsWriter(remote, tensorboard=True) as writer:
    for step in range(1, 6):
      writer.write(step, {"loss": float(step)})
    writer.write_rollouts(5, [])
  rows = metrics_lib.read_metrics(f"{remote}/metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
  with metrics_lib.MetricsWriter(remote, resume_step=3, tensorboard=False) as writer:
    assert writer.last_step == 3
    writer.write(4, {"loss": 40.0})
  rows = metrics_lib.read_metrics(f"{remote}/metrics.jsonl")
  assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
  assert not storage.path(f"{remote}/rollouts/step_00000005.jsonl").exists()
  events = [f for f in storage.list_files(f"{remote}/tensorboard")]
  assert len(events) == 1 and storage.size(events[0]) > 0


def _tree(scale):
  return {"w": jnp.arange(256, dtype=jnp.float32) * scale, "rng": jax.random.key(3)}


def test_checkpoints_on_gcs_restore_and_a_damaged_newest_is_moved_aside(remote):
  directory = f"{remote}/checkpoints"
  with Checkpointer(directory, keep=5) as ckpt:
    for step in (1, 2):
      ckpt.save(step, _tree(float(step)), {"step": step}, force=True)
  manifest = json.loads(storage.path(f"{directory}/2/{CHECKSUMS_FILE}").read_text())
  assert all({"md5", "crc32c"} <= set(e) for e in manifest["files"].values())
  data_files = [f for f in storage.list_files(f"{directory}/2/state") if "/d/" in str(f)]
  damaged = max(data_files, key=storage.size)
  data = bytearray(damaged.read_bytes())
  data[len(data) // 2] ^= 0xFF
  damaged.write_bytes(bytes(data))  # same size, other bytes
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _tree(1.0))
  with Checkpointer(directory, keep=5) as ckpt:
    step, state, meta = ckpt.restore_latest(abstract)
    assert ckpt.all_steps() == [1]
  assert (step, meta) == (1, {"step": 1})
  np.testing.assert_array_equal(state["w"], _tree(1.0)["w"])
  names = {storage.relative_name(f, directory).split("/")[0]
           for f in storage.list_files(directory)}
  assert names == {"1", "corrupt-2"}


# ------------------------------------------------------------------------------ a whole run


_OVERRIDES = ("--config.total_steps=6", "--config.checkpoint.every_steps=3",
              "--config.checkpoint.async_save=False")


def _train(workdir, env, **kwargs):
  return subprocess.Popen(
      [sys.executable, str(REPO / "launch" / "train.py"), "--config=configs/debug_cpu.py",
       f"--config.workdir={workdir}", *_OVERRIDES], cwd=REPO, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def test_debug_run_on_gcs_killed_and_resumed_equals_a_local_run(emulator, remote, tmp_path):
  env = {**environment(devices=1), "STORAGE_EMULATOR_HOST": emulator.url,
         storage.CACHE_ENV: str(tmp_path / "cache")}
  local = subprocess.run(
      [sys.executable, str(REPO / "launch" / "train.py"), "--config=configs/debug_cpu.py",
       f"--config.workdir={tmp_path / 'local'}", *_OVERRIDES], cwd=REPO, env=env,
      capture_output=True, text=True, timeout=600)
  assert local.returncode == 0, local.stdout + local.stderr

  first = _train(remote, env)
  checkpoint = storage.path(f"{remote}/checkpoints/3/{CHECKSUMS_FILE}")
  deadline = time.monotonic() + 300
  while not checkpoint.exists():
    assert first.poll() is None, first.stdout.read()
    assert time.monotonic() < deadline, "no checkpoint of step 3 within 300 s"
    time.sleep(0.2)
  first.send_signal(signal.SIGKILL)
  first.wait(timeout=60)

  second = _train(remote, env)
  output, _ = second.communicate(timeout=600)
  assert second.returncode == 0, output
  rows = metrics_lib.read_metrics(f"{remote}/metrics.jsonl")
  expected = metrics_rows(tmp_path / "local")
  assert [r["step"] for r in rows] == list(range(1, 7))  # none lost, none repeated
  for got, want in zip(rows, expected):
    for key in ("loss", "reward/mean", "kl", "entropy"):
      if key in want and isinstance(want[key], float):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
  names = {storage.relative_name(f, remote) for f in storage.list_files(remote)}
  assert {"run_config.json", "report.md", "STOPPED.md"} & names == {"run_config.json", "report.md"}
  assert {f"rollouts/step_{s:08d}.jsonl" for s in range(1, 7)} <= names
  assert {"eval/step_00000000.json", "eval/step_00000006.json", "model/config.json",
          "logs/train.log", "checkpoints/6/CHECKSUMS.json"} <= names
  assert "step 6" in storage.path(f"{remote}/logs/train.log").read_text() or \
      storage.size(f"{remote}/logs/train.log") > 0

  # the finished run loads straight from gs:// (Orbax reads the weights, model/ is cached locally)
  from reasoning_rl.run_checkpoint import load_model
  model, tokenizer = load_model(remote)
  local_model, _ = load_model(tmp_path / "local")
  from flax import nnx
  for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                    nnx.to_flat_state(nnx.state(local_model, nnx.Param))):
    np.testing.assert_allclose(np.asarray(got.value), np.asarray(want.value), rtol=1e-5,
                               atol=1e-6, err_msg=str(path))
  assert tokenizer.encode("1+2", add_special_tokens=False)


def test_a_fresh_read_finds_an_object_a_cached_listing_predates(remote):
  """Another process writes an object after this one listed its directory: a read through the
  path consults the cached listing and reports the object missing (a resume's checksum manifest
  was, once, in the suite), `read_bytes_fresh` fetches it."""
  import fsspec

  storage.atomic_write(f"{remote}/step/a.txt", "a")
  assert [p.name for p in storage.path(f"{remote}/step").iterdir()] == ["a.txt"]  # now cached
  other_process = fsspec.filesystem("gs", skip_instance_cache=True)
  other_process.pipe_file(f"{remote[len('gs://'):]}/step/b.txt", b"written elsewhere")
  with pytest.raises(FileNotFoundError):
    storage.path(f"{remote}/step/b.txt").read_bytes()
  assert storage.read_bytes_fresh(f"{remote}/step/b.txt") == b"written elsewhere"
  assert storage.read_bytes_fresh(f"{remote}/step/a.txt") == b"a"
