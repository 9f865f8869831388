"""The verifier queue: exactly one result per item through worker deaths, hangs and backpressure."""

import collections
import os
import signal
import threading
import time

import pytest

from reasoning_rl.errors import ConfigError, VerifierError
from reasoning_rl.workers.pool import VerifierPool

HANG = "<hang>"
CRASH = "<crash>"


def score_answer(item: tuple[str, str]) -> float:
  """A cheap stand-in for a math verifier: 1.0 when the answers match after trimming."""
  response, truth = item
  if response == HANG:
    time.sleep(3600)
  if response == CRASH:
    os.kill(os.getpid(), signal.SIGKILL)
  if response == "raise":
    raise ValueError("bad item")
  return 1.0 if response.strip() == truth.strip() else 0.0


def _items(count: int) -> dict[int, tuple[str, str]]:
  # Every third answer is wrong, so the expected reward of each item is known exactly.
  return {i: (f" {i * 7} " if i % 3 else f"{i * 7 + 1}", str(i * 7)) for i in range(count)}


def test_ten_thousand_items_survive_a_killed_and_a_hung_worker():
  items = _items(10_000)
  hung_id = 6_000
  items[hung_id] = (HANG, "0")
  results = collections.Counter()
  values, statuses = {}, {}

  def collect(pool):
    for result in iter(lambda: pool.get(timeout=20.0), None):
      results[result.item_id] += 1
      values[result.item_id], statuses[result.item_id] = result.value, result.status
      if len(results) == len(items):
        return

  with VerifierPool(score_answer, num_workers=2, max_queue=256, item_timeout_s=2.0,
                    fallback=0.0) as pool:
    collector = threading.Thread(target=collect, args=(pool,))
    collector.start()
    killed_pid = None
    for item_id, item in items.items():
      pool.submit(item_id, item)
      if item_id == 3_000:
        killed_pid = pool.worker_pids()[0]
        os.kill(killed_pid, signal.SIGKILL)
    collector.join(timeout=60.0)
    assert not collector.is_alive()
    metrics = pool.metrics()
    assert killed_pid not in pool.worker_pids()
    assert pool.outstanding == 0

  assert set(results) == set(items) and set(results.values()) == {1}  # none lost or duplicated
  assert statuses[hung_id] == "timeout" and values[hung_id] == 0.0
  expected = {i: (1.0 if i % 3 else 0.0) for i in items if i != hung_id}
  assert {i: values[i] for i in expected} == expected
  assert all(statuses[i] == "ok" for i in expected)
  assert metrics["completed"] == 10_000
  assert metrics["timeouts"] == 1 and metrics["errors"] == 0
  assert metrics["worker_restarts"] == 2  # the SIGKILLed worker and the hung one
  assert metrics["reissued"] <= 1  # the killed worker's item, if it held one
  assert metrics["items_per_s"] > 0 and 0 < metrics["latency_p50_s"] <= metrics["latency_p95_s"]


def test_errors_crashes_and_unpicklable_items_each_get_one_result():
  with VerifierPool(score_answer, num_workers=2, max_queue=8, item_timeout_s=5.0, fallback=-1.0,
                    max_attempts=2) as pool:
    pool.submit("ok", ("4", "4"))
    pool.submit("raises", ("raise", "x"))
    pool.submit("crashes", (CRASH, "x"))  # kills every worker that takes it
    pool.submit("unpicklable", (lambda: None, "x"))
    results = {r.item_id: r for r in pool.drain()}
    metrics = pool.metrics()
  assert sorted(results) == ["crashes", "ok", "raises", "unpicklable"]
  assert (results["ok"].status, results["ok"].value) == ("ok", 1.0)
  assert (results["raises"].status, results["raises"].value) == ("error", -1.0)
  assert "ValueError: bad item" in results["raises"].error
  assert (results["crashes"].status, results["crashes"].attempts) == ("error", 2)
  assert results["unpicklable"].status == "error"
  assert metrics["worker_restarts"] == 2 and metrics["reissued"] == 1 and metrics["errors"] == 3


def test_backpressure_and_exactly_once_bookkeeping():
  with VerifierPool(score_answer, num_workers=1, max_queue=2, item_timeout_s=1.0,
                    fallback=0.0) as pool:
    pool.submit("hang", (HANG, ""))  # occupies the only worker
    while pool.queued:
      time.sleep(0.01)
    assert pool.submit("a", ("1", "1"), block=False)
    assert pool.submit("b", ("1", "2"), block=False)
    assert not pool.submit("c", ("1", "1"), block=False)  # queue full: refused, not taken
    with pytest.raises(ValueError, match="already outstanding"):
      pool.submit("a", ("1", "1"))
    results = {r.item_id: (r.status, r.value) for r in pool.drain()}
  assert results == {"hang": ("timeout", 0.0), "a": ("ok", 1.0), "b": ("ok", 0.0)}
  with pytest.raises(VerifierError, match="closed"):
    pool.submit("late", ("1", "1"))


def test_close_cancels_what_is_left():
  pool = VerifierPool(score_answer, num_workers=1, max_queue=4, item_timeout_s=30.0)
  pool.submit("hang", (HANG, ""))
  pool.submit("queued", ("1", "1"))
  time.sleep(0.2)
  pool.close()
  results = {r.item_id: r.status for r in iter(lambda: pool.get(timeout=0.1), None)}
  assert results == {"hang": "cancelled", "queued": "cancelled"}


def test_bad_configuration_is_refused():
  with pytest.raises(ConfigError, match="num_workers"):
    VerifierPool(score_answer, num_workers=0)
  with pytest.raises(ConfigError, match="item_timeout_s"):
    VerifierPool(score_answer, item_timeout_s=0)
  with pytest.raises(ConfigError, match="fork"):
    VerifierPool(score_answer, start_method="fork")


def math_item(item: tuple[str, str]) -> bool:
  from reasoning_rl.verifiers.math_answers import is_correct  # pylint: disable=import-outside-toplevel
  return is_correct(*item)


def test_real_math_verifier_through_the_pool():
  pytest.importorskip("reasoning_rl.verifiers.math_answers")
  cases = {"frac": (r"<answer>\frac{1}{2}</answer>", "0.5"), "wrong": ("<answer>3</answer>", "4"),
           "boxed": (r"so \boxed{12}", "12")}
  with VerifierPool(math_item, num_workers=2, item_timeout_s=30.0) as pool:
    for key, item in cases.items():
      pool.submit(key, item)
    results = {r.item_id: (r.status, r.value) for r in pool.drain()}
  assert results == {"frac": ("ok", True), "wrong": ("ok", False), "boxed": ("ok", True)}


def _dispatcher_bug():
  raise RuntimeError("bookkeeping bug")


def test_a_dispatcher_that_dies_makes_get_raise_with_its_cause(caplog):
  with VerifierPool(score_answer, num_workers=1, item_timeout_s=30.0) as pool:
    pool._next_task = _dispatcher_bug  # pylint: disable=protected-access  # runs on its thread
    pool.submit(0, ("1", "1"))
    start = time.monotonic()
    with pytest.raises(VerifierError, match="dispatcher thread has died.*RuntimeError: bookkeep"):
      pool.get(timeout=60.0)  # None (a plain wait) before get checked on the dispatcher
    with pytest.raises(VerifierError, match="dispatcher thread has died"):
      pool.get()  # and without a timeout it raises rather than waits forever
    assert time.monotonic() - start < 30.0
  assert "the dispatcher thread died" in caplog.text
  assert pool.get(timeout=0.0).status == "cancelled"  # closing still answers the item once
