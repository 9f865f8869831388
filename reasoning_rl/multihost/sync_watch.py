"""A deadline for one weight sync: past it, every process stops with one line instead of hanging.

A cross-process transfer that stalls (a peer stuck in a driver call, a socket that never
delivers) leaves its partners blocked in `device_put` or `block_until_ready`, calls Python cannot
interrupt; the peer watcher (`runtime.watch_peers`) does not help, since a stuck process still
sends heartbeats. So each sync runs under a watchdog thread: when the deadline passes before every
process has reported its part done, the thread ends the process the way a lost peer does
(`runtime.stop_lost_run`: one line, exit code 5), naming the sync, the policy version and the
processes it was waiting for. Every process runs the same watchdog, so all of them stop, and a
rerun resumes from the last checkpoint.

Completion is agreed through the coordination service: a process that finished its transfers
(and, on a sampler process, holds the new weights) publishes `reasoning_rl/sync/N/done/P`, then
waits for everyone else's key. A process therefore leaves sync N only when every process finished
it, and a stalled one stops the run within the deadline rather than at the next exchange.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

from reasoning_rl.multihost import runtime

# Tests only: "PROCESS:VERSION" makes that process sleep inside the sync of that policy version,
# before its transfers (a stalled peer, as a hung transfer would leave it).
STALL_ENV = "REASONING_RL_TEST_STALL_SYNC"
_PREFIX = "reasoning_rl/sync"


def _processes(indices: Sequence[int]) -> str:
  return f"process{'es' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


class SyncWatch:
  """The deadline of sync `number` (policy `version`) on this process.

  Args:
    client: the coordination service's client (key-value store).
    peers: the processes this process's own transfers wait on (named if they stall it).
    deadline_text: how the deadline was derived, for the stop line.
    stop: ends the process with a reason (`runtime.stop_lost_run`; tests replace it).
  """

  def __init__(self, *, client, number: int, version: int, deadline_s: float, deadline_text: str,
               process_index: int, num_processes: int, peers: Sequence[int],
               stop: Callable[..., None] = runtime.stop_lost_run):
    self._client = client
    self.number, self.version = number, version
    self.deadline_s, self._deadline_text = deadline_s, deadline_text
    self._me, self._others = process_index, [p for p in range(num_processes) if p != process_index]
    self._peers = list(peers)
    self._stop = stop
    self._finished = threading.Event()
    self._own_part_done = False
    self._end = time.monotonic() + deadline_s
    self._thread = threading.Thread(target=self._watch, daemon=True,
                                    name=f"reasoning_rl-sync-{number}-deadline")
    self._thread.start()

  def _key(self, number: int, process: int) -> str:
    return f"{_PREFIX}/{number}/done/{process}"

  def _watch(self) -> None:
    if not self._finished.wait(self.deadline_s):
      self.expire()

  def stall_if_asked(self) -> None:
    """The test hook of STALL_ENV: sleep (the watchdog ends the process meanwhile)."""
    process, _, version = os.environ.get(STALL_ENV, "").partition(":")
    if process and int(process) == self._me and int(version) == self.version:
      time.sleep(24 * 3600)

  def confirm(self) -> None:
    """This process's part is done: say so, then wait (within the deadline) for every other
    process's part. Returns when all are done; never returns if the deadline passes first."""
    self._own_part_done = True
    self._client.key_value_set(self._key(self.number, self._me), "1")
    for process in self._others:
      remaining_ms = int((self._end - time.monotonic()) * 1000)
      try:
        if remaining_ms <= 0:
          raise TimeoutError
        self._client.blocking_key_value_get(self._key(self.number, process), remaining_ms)
      except Exception:  # pylint: disable=broad-except
        # timed out (or the service went away): the watchdog's stop. `runtime.stop_lost_run`
        # never returns (it exits, or waits while the watchdog's own call exits).
        self.expire()
        return
    self._finished.set()
    if self.number > 1:  # every process has read sync N-1's keys before publishing sync N's
      try:
        self._client.key_value_delete(self._key(self.number - 1, self._me))
      except Exception:  # pylint: disable=broad-except
        pass  # a leftover key of a few bytes; the next run gets a fresh service

  def cancel(self) -> None:
    """Stops watching (the sync raised; the caller's error handling takes over)."""
    self._finished.set()

  def reason(self) -> str:
    """Why the run stops: the sync, the policy version, and whom this process was waiting for."""
    head = (f"weight sync {self.number} (policy version {self.version}) did not finish within "
            f"its deadline of {self._deadline_text}")
    if not self._own_part_done:
      return (f"{head}: this process's transfers with {_processes(self._peers)} had not "
              "completed")
    try:
      done = {int(key.rsplit("/", 1)[1])
              for key, _ in self._client.key_value_dir_get(f"{_PREFIX}/{self.number}/done/")}
    except Exception:  # pylint: disable=broad-except
      done = set()
    missing = [p for p in self._others if p not in done] or self._others
    return f"{head}: waiting for {_processes(missing)}, which had not finished their part"

  def expire(self) -> None:
    """Ends the process (`stop`), unless the sync finished meanwhile."""
    if not self._finished.is_set():
      self._stop(self.reason(), self._others)
