"""Several processes on one machine with simulated devices, and the check that they train as one
process does. (From test_multihost.py.)"""

import dataclasses
import threading

import pytest

from reasoning_rl.multihost.exchange import Exchange
from tests.support.runs import LOSS_ABS


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  process_index: int


def devices(num_processes: int, per_process: int) -> list[FakeDevice]:
  # deliberately not in process-major order: the topology must sort them
  return [FakeDevice(1000 * p + d, p) for d in range(per_process) for p in range(num_processes)]


class FakeStore:
  """The coordination service's key-value store, shared by the threads of a test."""

  def __init__(self):
    self.values, self.condition = {}, threading.Condition()

  def key_value_set_bytes(self, key, value):
    with self.condition:
      assert key not in self.values, f"{key} written twice"
      self.values[key] = bytes(value)
      self.condition.notify_all()

  def key_value_set(self, key, value):
    self.key_value_set_bytes(key, value.encode())

  def blocking_key_value_get_bytes(self, key, timeout_ms):
    with self.condition:
      assert self.condition.wait_for(lambda: key in self.values, timeout_ms / 1000)
      return self.values[key]

  def blocking_key_value_get(self, key, timeout_ms):
    return self.blocking_key_value_get_bytes(key, timeout_ms).decode()

  def key_value_delete(self, key):
    with self.condition:
      del self.values[key]


def run_processes(store, count, body):
  results = [None] * count

  def one(index):
    results[index] = body(Exchange(store, process_index=index, num_processes=count))

  threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(30)
  return results


def assert_same_training(rows, reference):
  assert [r["step"] for r in rows] == [1, 2]  # metrics.jsonl written once: one row per step
  for row, ref in zip(rows, reference):
    assert row["reward/mean"] == ref["reward/mean"]
    assert row["data_position"] == ref["data_position"]
    assert row["policy_version"] == ref["policy_version"]
    assert row["entropy"] == pytest.approx(ref["entropy"], rel=1e-5)
    assert row["loss"] == pytest.approx(ref["loss"], abs=LOSS_ABS)  # sharded over processes
