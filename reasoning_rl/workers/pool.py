"""Host-side verifier queue: a pool of worker processes scoring completions as they finish.

Guarantee: every submitted item gets exactly one `PoolResult`, whatever happens to the workers.

* Workers are started with the `forkserver` (default) or `spawn` method, never `fork`: the trainer
  holds JAX's threads, and forking a threaded process can deadlock the child.
* Each worker holds at most one item. The dispatcher thread therefore always knows which item a
  worker has, and when:
  - the item runs past `item_timeout_s` (counted from when a worker takes it), the worker is SIGKILLed and replaced, and the item gets
    status `timeout` with the `fallback` value (e.g. reward 0);
  - the worker dies (killed by anything, crashed in C code), it is replaced and the item is issued
    again, up to `max_attempts` times in all; after that it gets status `error` with `fallback`.
  A reply is accepted only for an item still outstanding, so late or repeated replies cannot
  produce a second result.
* Backpressure: at most `max_queue` items wait for a worker. `submit` then blocks (optionally
  with a timeout) or, with `block=False`, returns False and the item is not taken; items already
  on a worker do not count.
* If the dispatcher thread itself dies (a bug), `get` raises `VerifierError` naming the cause
  instead of waiting for results that can no longer come.
* Metrics: items/s, p50/p95 latency (submit to result), timeouts, errors, worker restarts and
  re-issued items (`metrics()`).
"""

import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import queue
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable, Hashable, Iterator

import numpy as np

from reasoning_rl.errors import ConfigError, VerifierError
from reasoning_rl.verifiers.request_loop import answer_requests

_IDLE_TICK_S = 0.1
_READY = "__ready__"
_STARTUP_TIMEOUT_S = 120.0
_logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolResult:
  """The one result of one item.

  Attributes:
    item_id: as given to `submit`.
    value: `fn(item)`, or the pool's `fallback` when status is not "ok".
    status: "ok", "timeout" (ran past item_timeout_s), "error" (`fn` raised, the item could not
      be sent, or it killed `max_attempts` workers) or "cancelled" (the pool closed first).
    latency_s: seconds from submit to result.
    attempts: how many workers were given the item.
    error: the exception or reason, "" when ok.
  """
  item_id: Hashable
  value: Any
  status: str
  latency_s: float
  attempts: int
  error: str = ""


def _worker_main(fn: Callable[[Any], Any], conn: multiprocessing.connection.Connection) -> None:
  """Scores items received on `conn` until the pipe closes."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop

  def answer(request):
    item_id, item = request
    try:
      return item_id, "ok", fn(item), ""
    except Exception as error:  # pylint: disable=broad-except
      return (item_id, "error", None,
              f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=5)}")

  def unsendable(request, error):
    return request[0], "error", None, f"result of {type(error).__name__}: {error}"

  answer_requests(conn, _READY, answer, unsendable)


@dataclasses.dataclass
class _Task:
  item_id: Hashable
  item: Any
  submitted_at: float
  attempts: int = 0


class _Slot:
  """One worker process, its pipe, and the task it holds (if any)."""

  def __init__(self, context, fn):
    parent_end, child_end = context.Pipe()
    self.process = context.Process(target=_worker_main, args=(fn, child_end), daemon=True)
    self.process.start()
    child_end.close()
    self.conn = parent_end
    self.ready = False
    self.task: _Task | None = None
    self.started_at = time.monotonic()  # of the start-up until ready, then of the current task

  def kill(self) -> None:
    if self.process.is_alive():
      self.process.kill()
    self.process.join()
    self.conn.close()


class VerifierPool:
  """A process pool that applies a picklable `fn(item) -> value` to submitted items.

  Usage:
    with VerifierPool(reward_fn, num_workers=4, max_queue=1024, item_timeout_s=10.0,
                      fallback=0.0) as pool:
      for item_id, completion in stream:
        pool.submit(item_id, completion)
      for result in pool.results():
        ...
  """

  def __init__(self, fn: Callable[[Any], Any], num_workers: int = 2, max_queue: int = 1024,
               item_timeout_s: float = 30.0, *, fallback: Any = 0.0, max_attempts: int = 2,
               start_method: str = "forkserver"):
    for name, value in (("num_workers", num_workers), ("max_queue", max_queue),
                        ("max_attempts", max_attempts)):
      if type(value) is not int or value < 1:
        raise ConfigError(f"VerifierPool: `{name}` must be an int >= 1, got {value!r}")
    if not isinstance(item_timeout_s, (int, float)) or item_timeout_s <= 0:
      raise ConfigError(f"VerifierPool: `item_timeout_s` must be > 0, got {item_timeout_s!r}")
    if start_method not in ("forkserver", "spawn"):
      raise ConfigError(f"VerifierPool: `start_method` must be 'forkserver' or 'spawn' (never "
                        f"'fork': the trainer's threads would deadlock it), got {start_method!r}")
    if not callable(fn):
      raise ConfigError("VerifierPool: `fn` must be a picklable callable fn(item) -> value")
    self._fn, self._fallback = fn, fallback
    self._item_timeout_s, self._max_attempts = float(item_timeout_s), max_attempts
    self._context = multiprocessing.get_context(start_method)
    self._inbox: queue.Queue = queue.Queue(maxsize=max_queue)
    self._retries: collections.deque[_Task] = collections.deque()
    self._results: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    self._outstanding: dict[Hashable, float] = {}
    self._latencies: list[float] = []
    self._counts = collections.Counter()
    self._first_submit: float | None = None
    self._last_result: float | None = None
    self._closed = threading.Event()
    self._wake_read, self._wake_write = socket.socketpair()
    self._wake_read.setblocking(False)
    self._dispatcher_failure = ""  # why the dispatcher thread ended early, if it did
    self._slots = [_Slot(self._context, fn) for _ in range(num_workers)]
    self._dispatcher = threading.Thread(target=self._dispatch, name="verifier-pool", daemon=True)
    self._dispatcher.start()

  # ---- public API --------------------------------------------------------------------------

  def submit(self, item_id: Hashable, item: Any, *, block: bool = True,
             timeout: float | None = None) -> bool:
    """Queues `item`; returns False if the queue stayed full (only with block=False/timeout).

    Raises:
      ValueError: `item_id` is still outstanding.
      VerifierError: the pool is closed.
    """
    if self._closed.is_set():
      raise VerifierError("VerifierPool.submit: the pool is closed")
    now = time.monotonic()
    with self._lock:
      if item_id in self._outstanding:
        raise ValueError(f"VerifierPool.submit: item_id {item_id!r} is already outstanding")
      self._outstanding[item_id] = now
      if self._first_submit is None:
        self._first_submit = now
    try:
      self._inbox.put(_Task(item_id, item, now), block=block, timeout=timeout)
    except queue.Full:
      with self._lock:
        del self._outstanding[item_id]
      return False
    self._wake()
    return True

  def get(self, timeout: float | None = None) -> PoolResult | None:
    """The next finished result, or None if none arrives within `timeout`.

    Raises:
      VerifierError: the dispatcher thread has died, so nothing outstanding will ever finish.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      wait = _IDLE_TICK_S if deadline is None else min(_IDLE_TICK_S,
                                                       max(deadline - time.monotonic(), 0.0))
      try:
        return self._results.get(timeout=wait)
      except queue.Empty:
        pass
      if not self._dispatcher.is_alive() and not self._closed.is_set():
        cause = self._dispatcher_failure or "no cause recorded"
        raise VerifierError(f"VerifierPool: its dispatcher thread has died ({cause}), so no "
                            "outstanding item will be scored; the log has its traceback")
      if deadline is not None and time.monotonic() >= deadline:
        return None

  def results(self) -> Iterator[PoolResult]:
    """Yields results as they finish until nothing submitted so far is outstanding."""
    while True:
      try:
        yield self._results.get_nowait()
        continue
      except queue.Empty:
        pass
      with self._lock:
        if not self._outstanding:
          return
      result = self.get(timeout=_IDLE_TICK_S)
      if result is not None:
        yield result

  def drain(self) -> list[PoolResult]:
    """Waits for every outstanding item and returns the results not yet taken."""
    return list(self.results())

  @property
  def outstanding(self) -> int:
    with self._lock:
      return len(self._outstanding)

  @property
  def queued(self) -> int:
    """Items waiting for a worker (what `max_queue` bounds, plus items to re-issue)."""
    return self._inbox.qsize() + len(self._retries)

  def worker_pids(self) -> list[int]:
    return [slot.process.pid for slot in self._slots]

  def metrics(self) -> dict[str, float]:
    """Throughput, latency percentiles and failure counters, as plain numbers."""
    with self._lock:
      latencies = np.asarray(self._latencies, dtype=np.float64)
      completed = len(latencies)
      span = (self._last_result - self._first_submit) if completed else 0.0
      counts = dict(self._counts)
    return {
        "completed": completed,
        "items_per_s": completed / span if span > 0 else 0.0,
        "latency_p50_s": float(np.percentile(latencies, 50)) if completed else 0.0,
        "latency_p95_s": float(np.percentile(latencies, 95)) if completed else 0.0,
        "timeouts": counts.get("timeout", 0),
        "errors": counts.get("error", 0),
        "cancelled": counts.get("cancelled", 0),
        "worker_restarts": counts.get("restart", 0),
        "reissued": counts.get("reissue", 0),
    }

  def close(self) -> None:
    """Stops the workers; items not finished yet get status "cancelled"."""
    if self._closed.is_set():
      return
    self._closed.set()
    self._wake()
    self._dispatcher.join()
    for slot in self._slots:
      slot.kill()
    leftovers = [slot.task for slot in self._slots if slot.task] + list(self._retries)
    while True:
      try:
        leftovers.append(self._inbox.get_nowait())
      except queue.Empty:
        break
    for task in leftovers:
      self._emit(task, "cancelled", self._fallback, "the pool was closed")
    self._wake_read.close()
    self._wake_write.close()

  def __enter__(self) -> "VerifierPool":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  # ---- dispatcher (its own thread; sole owner of the slots) ---------------------------------

  def _wake(self) -> None:
    try:
      self._wake_write.send(b"\0")
    except (BlockingIOError, OSError):  # already woken, or closing
      pass

  def _emit(self, task: _Task, status: str, value: Any, error: str) -> None:
    now = time.monotonic()
    with self._lock:
      if self._outstanding.pop(task.item_id, None) is None:
        return  # already answered: never a second result
      self._latencies.append(now - task.submitted_at)
      self._last_result = now
      if status != "ok":
        self._counts[status] += 1
    self._results.put(PoolResult(task.item_id, value, status, now - task.submitted_at,
                                 task.attempts, error))

  def _next_task(self) -> _Task | None:
    if self._retries:
      return self._retries.popleft()
    try:
      return self._inbox.get_nowait()
    except queue.Empty:
      return None

  def _assign(self, slot: _Slot, task: _Task) -> None:
    task.attempts += 1
    slot.task, slot.started_at = task, time.monotonic()
    try:
      slot.conn.send((task.item_id, task.item))
    except (BrokenPipeError, EOFError, ConnectionResetError):
      self._replace(slot, "the worker died before taking the item")
    except Exception as error:  # the item itself cannot be pickled
      slot.task = None
      self._emit(task, "error", self._fallback, f"cannot send the item: {error}")

  def _replace(self, slot: _Slot, reason: str, timed_out: bool = False) -> None:
    """Kills and restarts `slot`'s worker; its task times out or goes back for another attempt."""
    task = slot.task
    slot.kill()
    index = self._slots.index(slot)
    self._slots[index] = _Slot(self._context, self._fn)
    with self._lock:
      self._counts["restart"] += 1
    if task is None:
      return
    if timed_out:
      self._emit(task, "timeout", self._fallback, reason)
    elif task.attempts >= self._max_attempts:
      self._emit(task, "error", self._fallback, f"{reason} (after {task.attempts} attempts)")
    else:
      with self._lock:
        self._counts["reissue"] += 1
      self._retries.append(task)

  def _dispatch(self) -> None:
    try:
      self._dispatch_until_closed()
    except BaseException as error:  # a bug here: record it for `get`, which raises in the caller
      self._dispatcher_failure = f"{type(error).__name__}: {error}"
      _logger.exception("verifier pool: the dispatcher thread died")

  def _dispatch_until_closed(self) -> None:
    while not self._closed.is_set():
      for slot in list(self._slots):
        if slot.ready and slot.task is None:
          task = self._next_task()
          if task is not None:
            self._assign(slot, task)
      now = time.monotonic()
      busy = [slot for slot in self._slots if slot.task is not None]
      wait_s = min([slot.started_at + self._item_timeout_s - now for slot in busy]
                   + [_IDLE_TICK_S])
      watched = {self._wake_read: None}
      for slot in self._slots:
        watched[slot.process.sentinel] = slot
        watched[slot.conn] = slot
      ready = multiprocessing.connection.wait(list(watched), timeout=max(wait_s, 0.0))
      if self._wake_read in ready:
        try:
          while self._wake_read.recv(4096):
            pass
        except (BlockingIOError, OSError):
          pass
      for handle in ready:  # replies first: a worker may answer and then die
        slot = watched.get(handle)
        if slot is not None and handle is slot.conn:
          self._receive(slot)
      for handle in ready:
        slot = watched.get(handle)
        if slot is not None and handle is slot.process.sentinel and slot in self._slots:
          self._replace(slot, f"the worker died (exit code {slot.process.exitcode})")
      now = time.monotonic()
      for slot in list(self._slots):
        if slot.task is not None and now - slot.started_at > self._item_timeout_s:
          self._replace(slot, f"no result within {self._item_timeout_s:g} s", timed_out=True)
        elif not slot.ready and now - slot.started_at > _STARTUP_TIMEOUT_S:
          self._replace(slot, "the worker did not start")

  def _receive(self, slot: _Slot) -> None:
    try:
      message = slot.conn.recv()
    except (EOFError, OSError):
      return  # the sentinel reports the death
    if message == _READY:
      slot.ready = True
      return
    item_id, status, value, error = message
    task = slot.task
    if task is None or item_id != task.item_id:
      return  # not the item this worker holds: ignore rather than risk a duplicate
    slot.task = None
    self._emit(task, status, value if status == "ok" else self._fallback, error)
