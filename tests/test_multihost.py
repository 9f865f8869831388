"""Multi-process runs: roles, the host exchange, and real 4-process training runs on this machine
(2 CPU devices per process, gloo collectives, the coordination service on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import types

import pytest

from reasoning_rl.errors import ConfigError, ExitCode
from reasoning_rl.multihost import bulk, runtime
from reasoning_rl.multihost.exchange import Exchange
from reasoning_rl.multihost.topology import check_sync_shapes, make_topology
from tests import multihost_runs as runs
from tests.support.multihost import FakeStore, assert_same_training, devices, run_processes


# ------------------------------------------------------------------------------------ topology


def test_split_topology_gives_whole_processes_to_each_role():
  topology = make_topology(4, devices(4, 2), process_index=2, num_processes=4)
  assert topology.trainer_processes == (0, 1)
  assert topology.replica_processes == (2, 3)
  assert [d.process_index for d in topology.trainer_devices] == [0, 0, 1, 1]
  assert topology.is_sampler and not topology.is_trainer and topology.replica_index == 0
  assert make_topology(4, devices(4, 2), process_index=1, num_processes=4).replica_index is None
  check_sync_shapes(topology)  # 2-device replicas divide 4 trainer devices


def test_colocated_topology_has_one_replica_per_process():
  topology = make_topology(0, devices(4, 2), process_index=3, num_processes=4)
  assert len(topology.trainer_devices) == 8
  assert topology.replica_processes == (0, 1, 2, 3)
  assert topology.is_trainer and topology.replica_index == 3
  assert all(d.process_index == 3 for d in topology.local_replica_devices)


def test_split_inside_a_process_is_refused_naming_the_field():
  with pytest.raises(ConfigError, match=r"config.mesh.num_trainer_devices=3.*multiple of the 2"):
    make_topology(3, devices(4, 2), process_index=0, num_processes=4)


def test_a_trainer_slice_on_one_process_is_refused():
  with pytest.raises(ConfigError, match="lies on one process of 4.*use 4 or more"):
    make_topology(2, devices(4, 2), process_index=0, num_processes=4)


def test_replicas_must_divide_the_trainer_mesh():
  topology = make_topology(8, devices(4, 4), process_index=0, num_processes=4)
  check_sync_shapes(topology)  # 8 trainer devices, replicas of 4
  # whole processes of equal size always divide; an uneven trainer slice is built by hand
  uneven = dataclasses.replace(topology, trainer_devices=topology.trainer_devices[:3])
  with pytest.raises(ConfigError, match="does not divide the 3 trainer devices"):
    check_sync_shapes(uneven)


@pytest.mark.parametrize("flags, message", [
    (runtime.ProcessFlags(coordinator_address="127.0.0.1:1234"), "--num_processes, --process_id"),
    (runtime.ProcessFlags("127.0.0.1", 2, 0), "use HOST:PORT"),
    (runtime.ProcessFlags("127.0.0.1:9", 2, 2), r"--process_id=2: must be in 0..1"),
    (runtime.ProcessFlags(transfer_address="127.0.0.1:5"), "--transfer_address"),
    (runtime.ProcessFlags("127.0.0.1:9", 2, 0, heartbeat_timeout_s=1),
     r"--heartbeat_timeout_s=1: must be in 2..3600 seconds \(default 30\)"),
])
def test_process_flags_are_checked_in_one_line(flags, message):
  with pytest.raises(ConfigError, match=message):
    flags.check()


def test_transfer_address_defaults_to_a_port_per_process():
  flags = runtime.ProcessFlags("127.0.0.1:9000", 4, 3)
  assert flags.derived_transfer_address() == "127.0.0.1:9004"
  assert runtime.ProcessFlags("h:1", 2, 1, "10.0.0.2:7").derived_transfer_address() == "10.0.0.2:7"


# ------------------------------------------------------------------------------------ exchange


def test_exchange_broadcast_and_gather_give_every_process_the_same_values(monkeypatch):
  import numpy as np

  monkeypatch.setattr("reasoning_rl.multihost.exchange._CHUNK_BYTES", 64)  # force chunking
  store = FakeStore()

  def body(exchange):
    me = exchange.process_index
    seen = [exchange.broadcast("row", {"step": 1, "loss": np.float32(0.5), "big": "x" * 500}
                               if me == 0 else None)]
    seen.append(exchange.gather("part", [me, me * 10]))
    seen.append(exchange.any("stop", me == 2))
    seen.append(exchange.broadcast("eval", me * 100, source=1))
    return seen

  results = run_processes(store, 3, body)
  expected = [{"step": 1, "loss": 0.5, "big": "x" * 500}, [[0, 0], [1, 10], [2, 20]], True, 100]
  assert results == [expected] * 3
  # every key of calls before the last gather is deleted again; only the latest calls remain
  assert all(int(key.split("/")[1]) >= 3 for key in store.values), sorted(store.values)


def test_a_stop_inside_one_replicas_sampling_interrupts_every_process(monkeypatch):
  """Split 4 processes: replica 1 (process 3) is interrupted while sampling; the trainer-only
  processes and the other replica learn it from the rollouts exchange and raise too, so all
  four abandon the step together. The evaluation broadcast does the same."""
  from reasoning_rl.errors import PhaseInterrupted
  from reasoning_rl.loop.rollouts import RolloutCollector, ShardedCollector
  from reasoning_rl.multihost.cluster import Cluster
  from reasoning_rl.rl.rollout_columns import RolloutColumns

  def collect(self, share, **kwargs):
    if self.cluster.topology.process_index == 3:
      raise PhaseInterrupted("sampling stopped on request after 2 decode calls")
    return RolloutColumns.empty(2), 0.1, 0.0

  monkeypatch.setattr(RolloutCollector, "collect", collect)

  def body(exchange):
    me = exchange.process_index
    cluster = Cluster(make_topology(4, devices(4, 2), process_index=me, num_processes=4),
                      exchange)
    collector = ShardedCollector(None, None, None, None, num_samples=2, max_new_tokens=4,
                                 stop_strings=(), sampling=None, seed=0, cluster=cluster)
    seen = []
    for attempt in (lambda: collector.collect([(0, "a"), (1, "b")]),
                    lambda: cluster.evaluate(lambda: (_ for _ in ()).throw(
                        PhaseInterrupted("sampling stopped on request after 1 decode calls")))):
      try:
        attempt()
        seen.append(None)
      except PhaseInterrupted as error:
        seen.append(str(error))
    return seen

  results = run_processes(FakeStore(), 4, body)
  assert results == [["process 3: sampling stopped on request after 2 decode calls",
                      "sampling stopped on request after 1 decode calls"]] * 4


class ServiceGone(FakeStore):
  def blocking_key_value_get_bytes(self, key, timeout_ms):
    raise RuntimeError(self.error)


@pytest.mark.parametrize("error, ends_run", [
    ("UNAVAILABLE: Socket closed\nAdditional GRPC error information", True),
    ("INVALID_ARGUMENT: key too long", False)])
def test_a_vanished_coordination_service_ends_the_run_like_a_lost_peer(monkeypatch, error,
                                                                         ends_run):
  """Process 0 going away under a wait must exit with the lost-process line, not abort."""
  stops = []

  def stop(reason, live=()):
    stops.append(reason)
    raise SystemExit(ExitCode.LOST_PEER)

  monkeypatch.setattr(runtime, "stop_lost_run", stop)
  store = ServiceGone()
  store.error = error
  exchange = Exchange(store, process_index=1, num_processes=2)
  with pytest.raises(SystemExit if ends_run else RuntimeError):
    exchange.gather("part", 1)
  assert stops == (["the coordination service (process 0) is unreachable: "
                    "UNAVAILABLE: Socket closed"] if ends_run else [])


class FakeService:
  """The coordination service as a process of a 4-process run sees it."""

  def __init__(self, live):
    self.live, self.set_keys, self.waited, self.live_calls = live, [], [], 0

  def get_live_nodes(self, everyone):
    assert everyone == [0, 1, 2, 3]
    self.live_calls += 1
    return self.live

  def key_value_set(self, key, value):
    self.set_keys.append(key)

  def blocking_key_value_get(self, key, timeout_ms):
    assert 0 < timeout_ms <= runtime._STOP_WAIT_S * 1000
    self.waited.append(key)
    return "1"


@pytest.fixture
def process_of_four(monkeypatch):
  """Runs runtime's stop logic as process `index` of 4 against a FakeService; os._exit raises."""
  import jax

  def setup(index, live):
    service = FakeService(live)
    monkeypatch.setattr(runtime, "_client", lambda: service)
    monkeypatch.setattr(runtime, "_stopping", threading.Lock())
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(jax, "process_index", lambda: index)
    monkeypatch.setattr(runtime.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(runtime, "time", types.SimpleNamespace(
        monotonic=time.monotonic, sleep=lambda seconds: service.waited.append(seconds)))
    return service

  return setup


def test_an_error_a_lost_peer_caused_names_the_peer_and_exits_5(process_of_four, capsys):
  service = process_of_four(1, live=[0, 1, 2])
  with pytest.raises(SystemExit) as stopped:
    runtime.stop_if_a_peer_was_lost()
  assert stopped.value.code == ExitCode.LOST_PEER
  assert "error: process 1: process 3 of 4 stopped sending heartbeats" in capsys.readouterr().err
  assert service.set_keys == ["reasoning_rl/stopping/1"]  # announced, so process 0 may leave
  assert service.waited == []
  assert service.live_calls == 1


def test_an_error_with_every_peer_alive_is_left_to_the_caller(process_of_four):
  service = process_of_four(1, live=[0, 1, 2, 3])
  runtime.stop_if_a_peer_was_lost()  # returns: the caller re-raises the error itself
  assert service.set_keys == [] and service.waited == []


def test_process_0_keeps_the_service_until_the_live_processes_stopped(process_of_four):
  """Process 0 waits for the processes its detection saw live, without asking the service
  again: `get_live_nodes` is a collective that the others, once stopped, never join (a real
  run's process 0 then waited a whole heartbeat timeout more: 57 s instead of 27 s)."""
  service = process_of_four(0, live=[0, 2, 3])
  with pytest.raises(SystemExit):
    runtime.stop_if_a_peer_was_lost()
  # then it keeps the service up a moment longer: the last announcer may not have had the reply
  # to its write yet, and a service gone before that aborts it instead of letting it exit 5
  assert service.waited == ["reasoning_rl/stopping/2", "reasoning_rl/stopping/3",
                            runtime._LEAVE_GRACE_S]
  assert service.set_keys == []
  assert service.live_calls == 1

# -------------------------------------------------------------------- real multi-process runs

# synchronous rollouts even on split devices (where they overlap by default): these runs must
# equal the one-process run step for step
STEPS = ["--config.total_steps=2", "--config.eval.num_examples=4",
         "--config.async_rollouts.enabled=False"]


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory):
  """debug_cpu for 2 steps in one process with 8 devices."""
  workdir = tmp_path_factory.mktemp("single") / "run"
  result = runs.run_single(workdir, STEPS, devices=8)
  assert result.returncode == 0, result.stderr[-3000:]
  return runs.metrics_rows(workdir)


@pytest.mark.parametrize("trainer_devices", [4, 0], ids=["split", "colocated"])
def test_four_processes_train_like_one(tmp_path, single_process_reference, trainer_devices,
                                      monkeypatch):
  """Split: processes 0-1 train, 2-3 sample (weights move across processes each step, rollouts
  through files); colocated: every process trains and samples. Step 1 and 2 equal the
  one-process run."""
  workdir = tmp_path / "run"
  monkeypatch.setenv(bulk.TRACE_ENV, str(tmp_path / "trace"))
  processes = runs.start_processes(
      workdir, STEPS + [f"--config.mesh.num_trainer_devices={trainer_devices}"])
  assert runs.wait_all(processes) == [0, 0, 0, 0], _logs(tmp_path)
  assert_same_training(runs.metrics_rows(workdir), single_process_reference)
  if trainer_devices:
    assert_channels_split_by_role(tmp_path / "trace", workdir)


def assert_channels_split_by_role(trace_dir, workdir):
  """Rollouts reach the trainers (0-1) as files the replicas (2-3) wrote; sampler-only processes
  read none, the evaluation records go to process 0 alone, the store carries small messages only
  and the workdir keeps only the files of the latest exchange of each writer."""
  trace = {p: [json.loads(line) for line in (trace_dir / f"p{p}.jsonl").open()] for p in range(4)}

  def ops(process, channel, op):
    return [r for r in trace[process] if r["channel"] == channel and r["op"] == op]

  reads = [sorted({r["name"] for r in ops(p, "file", "read")}) for p in range(4)]
  assert reads == [["eval", "rollouts"], ["rollouts"], [], []]
  # each trainer reads both replicas' files of each of the 2 steps; process 2 also evaluates
  evaluations = len(list((workdir / "eval").glob("step_*.json")))
  assert [len(ops(p, "file", "read")) for p in range(4)] == [2 * 2 + evaluations, 2 * 2, 0, 0]
  assert [len(ops(p, "file", "write")) for p in range(4)] == [0, 0, 2 + evaluations, 2]
  # control messages only: the metrics row is the largest (debug_cpu's rollouts are tiny, yet a
  # replica's summaries in the store are a fraction of its file)
  assert max(r["bytes"] for p in range(4) for r in ops(p, "store", "write")) < 1024
  for p in (2, 3):
    in_store = sum(r["bytes"] for r in ops(p, "store", "write") if r["name"] == "rollouts")
    in_files = sum(r["bytes"] for r in ops(p, "file", "write") if r["name"] == "rollouts")
    assert in_store < in_files / 2, (p, in_store, in_files)
  assert len(list((workdir / "exchange").rglob("*.json.z"))) <= 2


def test_a_lora_run_split_over_four_processes_trains_like_one(tmp_path):
  """LoRA with the trainer on processes 0-1 and samplers on 2-3: only the adapters cross to the
  sampler processes (each built its own base), and steps 1-2 equal the one-process LoRA run."""
  lora = STEPS + ["--config.lora.rank=4", "--config.lora.alpha=8", "--config.beta=0.04"]
  reference = tmp_path / "single"
  result = runs.run_single(reference, lora, devices=8)
  assert result.returncode == 0, result.stderr[-3000:]
  workdir = tmp_path / "run"
  processes = runs.start_processes(workdir, lora + ["--config.mesh.num_trainer_devices=4"])
  assert runs.wait_all(processes) == [0, 0, 0, 0], _logs(tmp_path)
  rows = runs.metrics_rows(workdir)
  assert_same_training(rows, runs.metrics_rows(reference))
  assert [r["sync/bytes"] for r in rows] == [r["sync/bytes"] for r in runs.metrics_rows(reference)]


def test_a_lost_process_then_a_preemption_each_end_the_run_and_reruns_finish_it(tmp_path):
  """The two ways a cloud run of 4 processes (split: 0-1 train, 2-3 sample) ends early, each
  followed by a rerun in the same workdir (one chain: 12 processes instead of 16):
  1. process 3, a sampler, is SIGKILLed once row 4 is written: the others notice its lost
     heartbeats within the 10 s timeout and exit 5 naming it; the rerun resumes from step 3's
     checkpoint.
  2. TPU preemption of the rerun: every process gets SIGTERM, at different moments, once it
     wrote a row of step 4 or later; all stop after the same step, exit 143 and save one
     checkpoint of it, beside the periodic one of step 3.
  The last rerun finishes the run from that checkpoint."""
  import signal

  workdir = tmp_path / "run"
  # a short heartbeat timeout (the default is 30 s): the loss is found within it, not the default
  overrides = ["--config.total_steps=7", "--config.checkpoint.every_steps=3",
               "--config.eval.num_examples=4", "--config.mesh.num_trainer_devices=4",
               "--heartbeat_timeout_s=10"]
  processes = start_and_wait_for_step(workdir, overrides, 4)
  killed = time.monotonic()
  processes[3].kill()
  codes = runs.wait_all(processes, timeout_s=120)
  assert time.monotonic() - killed < 28  # (30 s and more with the default)
  assert codes[:3] == [ExitCode.LOST_PEER] * 3, _logs(tmp_path)
  assert _logs(tmp_path).count("process 3 of 4 stopped sending heartbeats") == 3

  processes = start_and_wait_for_step(workdir, overrides, 4)
  for process in processes:
    process.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # not all at once
  assert runs.wait_all(processes, timeout_s=120) == [143] * 4, _logs(tmp_path)
  stopped_at = runs.metrics_rows(workdir)[-1]["step"]
  assert 4 <= stopped_at < 7
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                if p.name.isdigit()) == sorted({3, stopped_at})

  processes = runs.start_processes(workdir, overrides)
  assert runs.wait_all(processes) == [0, 0, 0, 0], _logs(tmp_path)
  rows = runs.metrics_rows(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
  # split devices overlap sampling with training by default: one version behind after step 1
  # (each rerun starts again from a checkpoint that kept its queued batch)
  assert [r["policy_lag"] for r in rows] == [0, 1, 1, 1, 1, 1, 1]


def start_and_wait_for_step(workdir, overrides, step: int, timeout_s: float = 400):
  """Starts the 4 processes of a run; returns once they wrote the metrics row of `step` or a
  later one (a row a run before them left in the workdir does not count)."""
  started = time.time()
  processes = runs.start_processes(workdir, overrides)
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and not any(
      r["step"] >= step and r["time/unix"] >= started for r in runs.metrics_rows(workdir)):
    time.sleep(0.2)
  return processes


def _logs(directory) -> str:
  return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(directory.glob("*.log")))


def test_r1zero_tpu_config_is_a_v5p_64_split_by_hosts():
  """configs/r1zero_tpu.py: 32 chips on 8 hosts of 4; hosts 0-3 train, 4-7 each run a replica; the
  dry-run plan fits both slices (the planner plans the target slice, not this machine)."""
  import contextlib
  import importlib.util
  import io

  from reasoning_rl import planning

  spec = importlib.util.spec_from_file_location("r1zero_tpu", runs.REPO / "configs" / "r1zero_tpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  assert (config.target.tpu, config.target.num_devices) == ("v5p", 32)
  topology = make_topology(config.mesh.num_trainer_devices, devices(8, 4), process_index=5,
                           num_processes=8)
  assert topology.trainer_processes == (0, 1, 2, 3)
  assert topology.replica_processes == (4, 5, 6, 7) and topology.replica_index == 1
  check_sync_shapes(topology)
  buffer = io.StringIO()
  with contextlib.redirect_stdout(buffer):
    planning.print_dry_run(config)
  text = buffer.getvalue()
  assert "Target: 32 x TPU v5p" in text
  assert "trainer slice: 16 devices" in text and "sampler slice: 16 devices" in text
  assert "Verdict: fits" in text
