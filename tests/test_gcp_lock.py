"""launch/gcp/workdir_lock.py against the GCS emulator (tests/gcs_emulator.py, fake-gcs-server,
which honours Cloud Storage's generation preconditions) and on a local directory: one holder at
a time, racing drivers get exactly one lock, a heartbeat keeps it, a stale one is taken over, a
holder that lost it learns so, and the command line says who holds it in one line."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import subprocess
import sys
import time

import pytest

from tests import gcs_emulator
from tests.conftest import REPO

SCRIPT = REPO / "launch" / "gcp" / "workdir_lock.py"
spec = importlib.util.spec_from_file_location("gcp_workdir_lock", SCRIPT)
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  with gcs_emulator.serving(tmp_path_factory.mktemp("gcs"), "runs") as server:
    yield server


@pytest.fixture(params=["gcs", "local"])
def workdir(request, tmp_path):
  if request.param == "gcs":
    request.getfixturevalue("emulator")
    return f"gs://runs/{tmp_path.name}"
  return str(tmp_path / "run")


def test_one_holder_and_its_heartbeat(workdir):
  store = lock.store_for(workdir)
  assert lock.acquire(store, "a", stale_s=600) == "acquired"
  with pytest.raises(lock.Held, match=r"driven by a \(heartbeat \d+ s ago, stale after 600 s\)"):
    lock.acquire(store, "b", stale_s=600)
  generation = store.read()[1]
  assert lock.refresh(store, "a") and store.read()[1] != generation  # a new write each beat
  assert lock.acquire(store, "a", stale_s=600) == "already ours"  # a restarted driver
  assert not lock.release(store, "b") and lock.holder(store) == "a"
  assert lock.release(store, "a") and lock.holder(store) is None
  assert lock.acquire(store, "b", stale_s=600) == "acquired"  # released: free at once


def test_a_write_on_a_changed_lock_fails(workdir):
  store = lock.store_for(workdir)
  assert store.create({"owner": "a"})
  assert not store.create({"owner": "b"})  # only where there is none
  _, generation, _ = store.read()
  assert store.replace({"owner": "a"}, generation)
  assert not store.replace({"owner": "b"}, generation)  # read before a's write
  assert store.read()[0]["owner"] == "a"


def test_a_stale_lock_is_taken_over_and_its_holder_learns_it(workdir):
  store = lock.store_for(workdir)
  lock.acquire(store, "a", stale_s=600)
  time.sleep(1.5)
  assert lock.acquire(store, "b", stale_s=1.0).startswith("taken over from a")
  assert not lock.refresh(store, "a")  # a's next heartbeat finds it gone
  assert store.read()[0]["owner"] == "b"


def test_racing_drivers_get_one_lock(workdir):
  """Eight drivers start at once: exactly one acquires, the others are told who holds it."""
  store_of = lambda: lock.store_for(workdir)  # noqa: E731  (a client each, as separate machines)

  def contend(name):
    try:
      return lock.acquire(store_of(), name, stale_s=600)
    except lock.Held as held:
      return f"held: {held}"

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    results = list(pool.map(contend, [f"d{i}" for i in range(8)]))
  assert sorted(r == "acquired" for r in results) == [False] * 7 + [True], results
  owner = lock.store_for(workdir).read()[0]["owner"]
  assert all(f"driven by {owner}" in r for r in results if r != "acquired")


def run(*args, env=None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                        timeout=120, env={**os.environ, **(env or {})})


def test_command_line(emulator, tmp_path):
  workdir = f"gs://runs/{tmp_path.name}"
  env = emulator.env
  first = run("acquire", workdir, "--owner=laptop:1:rl", env=env)
  assert first.returncode == 0 and "acquired" in first.stdout
  refused = run("acquire", workdir, "--owner=vm:2:rl", env=env)
  assert refused.returncode == 2 and refused.stderr.count("\n") == 1
  assert refused.stderr.startswith(f"error: --workdir={workdir}: driven by laptop:1:rl")
  # a heartbeat whose driver is gone releases the lock
  gone = subprocess.Popen(["true"])
  gone.wait()
  beat = run("heartbeat", workdir, "--owner=laptop:1:rl", "--every_s=0.2",
             f"--while_pid={gone.pid}", env=env)
  assert beat.returncode == 0 and lock.holder(lock.store_for(workdir)) is None
  unreachable = run("acquire", "gs://runs/x", "--owner=a", "--deadline_s=2",
                    env={"STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"})
  assert unreachable.returncode == 4 and unreachable.stderr.count("\n") == 1
  assert unreachable.stderr.startswith("error: workdir lock gs://runs/x/launcher/driver.lock: ")
