"""A local stand-in for the container an xpk workload runs: what xpk's container script does with
the workload's `--command`, and what the end of a container does to whatever is left in it.

xpk (google/xpk src/xpk/core/docker_container.py, 1.16.0) runs the command as one background
child of a bash script, the container's first process, remembers that child's pid, and on SIGTERM
sends SIGTERM to that pid only; it checks every 5 s whether the child is still there, then takes
its exit code as the container's. When the first process of a container exits, every other
process in the container is killed. `script(command)` is that behaviour written here; with xpk
installed, tests/test_gcp_xpk.py runs the script xpk itself generates instead.

`Container` runs a script as a process in a session of its own (the container), `terminate()`
does what the kubelet does at a preemption (SIGTERM to the first process only) and `wait()` kills
what the first process left behind once it exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid

POLL_S = 5  # how often xpk's script looks at its child


def script(command: str, poll_s: float = POLL_S) -> str:
  """The container's first process: `command` in the background, SIGTERM passed to it alone."""
  return f"""on_term() {{ kill -TERM "$child" 2> /dev/null; }}
trap on_term TERM
({command}) &
child=$!
while kill -0 "$child" 2> /dev/null; do sleep {poll_s}; done
wait "$child"
code=$?
echo "container: the command exited $code"
exit $code
"""


class Container:
  """One running container: `script` run by bash as the first process of a new session. Every
  process started in it inherits the variable CONTAINER_MARK (the stand-in for the container's
  own pid namespace), so that its end finds them all, orphans included."""

  def __init__(self, container_script: str, *, env: dict, cwd, log_path):
    self.mark = uuid.uuid4().hex
    self.log = open(log_path, "ab")  # noqa: SIM115
    self.first = subprocess.Popen(["bash", "-c", container_script], cwd=cwd,
                                  env={**env, "CONTAINER_MARK": self.mark},
                                  stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)

  def terminate(self) -> None:
    """The kubelet's SIGTERM: to the container's first process, no one else."""
    self.first.send_signal(signal.SIGTERM)

  def wait(self, timeout_s: float) -> int:
    """The first process's exit code; then every process left in the container is killed, as
    the container's end does."""
    try:
      return self.first.wait(timeout=timeout_s)
    finally:
      self.left = kill_marked("CONTAINER_MARK", self.mark)
      self.log.close()


def kill_marked(key: str, value: str) -> list[int]:
  """SIGKILL to every process whose environment has key=value; returns their pids."""
  pids = marked(key, value)
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  return pids


def marked(key: str, value: str) -> list[int]:
  """The live processes whose environment has key=value (from /proc)."""
  wanted = f"{key}={value}".encode()
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as environ:
        if wanted in environ.read().split(b"\0"):
          found.append(int(entry))
    except OSError:
      continue
  return found
