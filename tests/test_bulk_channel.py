"""The two channels of a multi-process run: small control messages through the coordination
service's store (with a size limit) and bulk values as files in the workdir (multihost.bulk).
Several processes are simulated by threads sharing a fake store and a temporary workdir."""

from __future__ import annotations

import json

import pytest

from reasoning_rl.errors import PhaseInterrupted
from reasoning_rl.loop.rollouts import RolloutCollector, ShardedCollector
from reasoning_rl.loop.state import LoopState, SampledBatch
from reasoning_rl.multihost import bulk
from reasoning_rl.multihost.cluster import Cluster
from reasoning_rl.multihost.exchange import Exchange, ValueTooLarge
from reasoning_rl.multihost.topology import make_topology
from reasoning_rl.rl.rollout_columns import RolloutColumns
from tests.support import rollouts
from tests.support.multihost import FakeStore, devices, run_processes


def group(position: int, rewards=(0.0, 1.0)) -> RolloutColumns:
  return rollouts.group(
      rewards, [[7, position], [8, 9, 10]], position=position, prompt=[1, 2, position],
      logprobs=[[-0.5, -0.25], [-1.0, -2.0, -0.125]],
      parts={"correct": list(rewards), "format": [1.0, 1.0]}, truncated=[False, True],
      responses=(f"answer {position}", "other"))


def test_a_value_over_the_limit_is_refused_naming_the_key():
  exchange = Exchange(FakeStore(), process_index=0, num_processes=1)
  exchange.max_value_bytes = 100
  exchange.gather("small", list(range(10)))  # fits
  with pytest.raises(ValueTooLarge, match=r"'reasoning_rl/2/rollouts/0': \d+ bytes compressed, "
                     r"over .* limit of 100 bytes; send bulk data through .*bulk"):
    exchange.gather("rollouts", [str(i) for i in range(1000)])
  assert Exchange(FakeStore(), process_index=0, num_processes=1).max_value_bytes == 1 << 20


def test_a_file_round_trips_and_a_damaged_one_is_refused(tmp_path):
  exchange = Exchange(FakeStore(), process_index=1, num_processes=1)
  channel = bulk.BulkChannel(exchange, tmp_path)
  descriptor = channel.put("rollouts", [group(3).to_json()])
  assert descriptor["file"] == "rollouts/1_p1.json.z"
  assert [RolloutColumns.from_json(g) for g in channel.get("rollouts", descriptor)] == [group(3)]
  (tmp_path / "exchange" / descriptor["file"]).write_bytes(b"torn")
  with pytest.raises(OSError, match=r"rollouts/1_p1.json.z: 4 bytes .* its writer announced"):
    channel.get("rollouts", descriptor)
  with pytest.raises(OSError, match="missing; every process must see the same workdir"):
    channel.get("rollouts", {**descriptor, "file": "rollouts/9_p0.json.z"})


def fake_collect(self, share, **kwargs):
  """Each replica 'samples' its share: groups whose rewards depend on the position."""
  del kwargs
  return rollouts.record(*[group(index, rewards=(float(index % 2), 1.0))
                           for index, _ in share]), 0.5, 0.25


def test_split_collection_reads_files_only_on_trainers_and_deletes_them(tmp_path, monkeypatch):
  """4 processes, 0-1 train, 2-3 sample: trainers receive every group in full, sampler-only
  processes only the summaries (and read no file); the store carries only small messages, and each
  replica's files are gone once a later gather proved them read."""
  monkeypatch.setenv(bulk.TRACE_ENV, str(tmp_path / "trace"))
  monkeypatch.setattr(RolloutCollector, "collect", fake_collect)
  examples = [(i, f"prompt {i}") for i in range(6)]
  listings = {}

  def body(exchange):
    me = exchange.process_index
    cluster = Cluster(make_topology(4, devices(4, 2), process_index=me, num_processes=4),
                      exchange)
    cluster.bulk = bulk.BulkChannel(exchange, tmp_path / "run")
    collector = ShardedCollector(None, None, None, None, num_samples=2, max_new_tokens=4,
                                 stop_strings=(), sampling=None, seed=0, cluster=cluster)
    first = collector.collect(examples)
    second = collector.collect(examples)
    exchange.gather("later", None)  # e.g. the next step's first gather
    listings[me] = sorted(p.name for p in (tmp_path / "run" / "exchange" / "rollouts").iterdir())
    exchange.gather("listed", None)
    cluster.bulk.sweep()
    return first, second

  results = run_processes(FakeStore(), 4, body)
  full = rollouts.record(*[group(i, rewards=(float(i % 2), 1.0)) for i in range(6)])
  for me in (0, 1):
    assert list(results[me]) == [(full, 0.5, 0.25)] * 2
  for me in (2, 3):
    assert list(results[me]) == [(full.summary(), 0.5, 0.25)] * 2
    assert results[me][0][0].has_signal().tolist() == full.has_signal().tolist()
    assert results[me][0][0].data_position.tolist() == list(range(6))
  # the first collection's files went at the second gather; the second's stay until a sweep
  assert all(names == ["2_p2.json.z", "2_p3.json.z"] for names in listings.values()), listings
  assert sorted(p.name for p in (tmp_path / "run" / "exchange" / "rollouts").iterdir()) == []
  trace = {me: [json.loads(line) for line in (tmp_path / "trace" / f"p{me}.jsonl").open()]
           for me in range(4)}
  reads = {me: sorted(r["name"] for r in trace[me] if r["channel"] == "file" and r["op"] == "read")
           for me in range(4)}
  assert reads == {0: ["rollouts"] * 4, 1: ["rollouts"] * 4, 2: [], 3: []}
  writes = {me: [r for r in trace[me] if r["channel"] == "file" and r["op"] == "write"]
            for me in range(4)}
  assert [len(writes[me]) for me in range(4)] == [0, 0, 2, 2]
  store = [r for me in range(4) for r in trace[me] if r["channel"] == "store"]
  largest_file = max(w["bytes"] for me in (2, 3) for w in writes[me])
  assert max(r["bytes"] for r in store) < largest_file  # descriptors and summaries only


def test_split_evaluation_records_reach_process_0_through_a_file(tmp_path, monkeypatch):
  monkeypatch.setenv(bulk.TRACE_ENV, str(tmp_path / "trace"))
  record = {"accuracy": 0.5, "examples": [{"uid": "a", "completion": "x" * 100}],
            "canaries": [{"uid": "c", "completions": []}]}

  def body(exchange):
    me = exchange.process_index
    cluster = Cluster(make_topology(4, devices(4, 2), process_index=me, num_processes=4),
                      exchange)
    cluster.bulk = bulk.BulkChannel(exchange, tmp_path / "run")
    result = cluster.evaluate(lambda: dict(record))
    try:
      cluster.evaluate(lambda: (_ for _ in ()).throw(PhaseInterrupted("stopped")))
    except PhaseInterrupted as error:
      return result, str(error)
    return result, None

  results = run_processes(FakeStore(), 4, body)
  assert results[0] == (record, "stopped")
  assert all(r == ({"accuracy": 0.5}, "stopped") for r in results[1:]), results
  reads = [(me, json.loads(line)["name"]) for me in range(4)
           if (tmp_path / "trace" / f"p{me}.jsonl").exists()
           for line in (tmp_path / "trace" / f"p{me}.jsonl").open() if '"op": "read"' in line
           and '"file"' in line]
  assert reads == [(0, "eval")]


def test_sampler_only_processes_resume_from_summarized_queued_batches():
  batch = SampledBatch(rollouts=rollouts.record(group(4), group(5, rewards=(1.0, 1.0))),
                       outcome={"x": 0.5},
                       groups_sampled=2, scoring={"ok": 2, "timeout": 0, "error": 0},
                       sample_s=1.0, verify_s=0.5, policy_version=3)
  meta = {"data_position": 6, "policy_version": 3, "guards": {}, "queue": [batch.to_json()],
          "pending_eval": None}
  small = LoopState.summary_meta(meta)
  assert small["data_position"] == 6 and small["guards"] == {}
  queued = SampledBatch.from_json(small["queue"][0])
  assert queued == batch.summary()
  assert queued.rollouts.group_rewards().tolist() == [[0.0, 1.0], [1.0, 1.0]]
  assert {k: v.tolist() for k, v in queued.rollouts.parts.items()} == {
      "correct": [0.0, 1.0, 1.0, 1.0]}
  assert queued.rollouts.completion_ids is None and queued.rollouts.responses is None


def test_files_on_gcs_round_trip_and_are_cleared(tmp_path, monkeypatch):
  """A gs:// workdir (the emulator): put / get, the sweep after a later gather, the start-up
  clear."""
  from reasoning_rl import storage
  from tests import gcs_emulator

  server = gcs_emulator.start(tmp_path)
  try:
    server.create_bucket("rrl-bulk")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    exchange = Exchange(FakeStore(), process_index=0, num_processes=1)
    channel = bulk.BulkChannel(exchange, "gs://rrl-bulk/run")
    first = channel.put("rollouts", [group(1).to_json()])
    exchange.gather("rollouts", first)
    assert [RolloutColumns.from_json(g) for g in channel.get("rollouts", first)] == [group(1)]
    second = channel.put("rollouts", [group(2).to_json()])  # call 1 not yet proven read by all
    exchange.gather("rollouts", second)
    channel.sweep()  # gather 2 proves the file of call 1 read
    names = [storage.relative_name(f, channel.directory) for f in storage.list_files(
        channel.directory)]
    assert names == ["rollouts/2_p0.json.z"]
    channel.clear()
    assert storage.list_files(channel.directory) == []
  finally:
    server.stop()
