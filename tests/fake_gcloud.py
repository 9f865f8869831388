"""A local stand-in for the `gcloud` commands of the tpu_vm recipe (launch/gcp/commands.py), so
that tests run the generated recipe unchanged: each TPU host is a directory (its home) and its
commands run as local processes with the variables a TPU host would have.

  gcloud compute tpus queued-resources create|describe|delete NAME ...
  gcloud compute tpus tpu-vm scp SRC NAME:DEST ... --worker=all
  gcloud compute tpus tpu-vm ssh NAME ... --worker=all|I --command=CMD

State lives under $FAKE_GCLOUD_STATE: NAME/state (what `describe` prints; a test writes SUSPENDED
there to simulate a preemption), NAME/hosts/<incarnation>/worker<I> (each worker's home: a
recreated queued resource gets fresh disks, as on Cloud TPU), calls.log (one line per call).
$FAKE_GCLOUD_HOSTS workers per slice (default 2); $FAKE_GCLOUD_WORKER_ENV a JSON object of extra
variables for the workers' commands (JAX_PLATFORMS=cpu, XLA_FLAGS, UV_CACHE_DIR ...).

Behaviour copied from the real service where the recipe depends on it: a queued resource is
PROVISIONING until described once, then ACTIVE; `ssh` / `scp` fail with exit code 255 unless the
resource is ACTIVE, and an `ssh` whose resource leaves ACTIVE while it runs is cut (exit 255);
`delete` gives running trainers up to $FAKE_GCLOUD_GRACE_S (default 60) after SIGTERM, as a
host's shutdown would, then kills them.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

STATE = pathlib.Path(os.environ["FAKE_GCLOUD_STATE"])


def option(args: list[str], name: str, default: str | None = None) -> str | None:
  for arg in args:
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
  return default


def positional(args: list[str]) -> list[str]:
  return [a for a in args if not a.startswith("--")]


def node(name: str) -> pathlib.Path:
  return STATE / name


def state_of(name: str) -> str | None:
  path = node(name) / "state"
  return path.read_text().strip() if path.exists() else None


def free_port(block: int = 8) -> int:
  """A coordinator port with `block` free ports after it (the weight-transfer sockets take port
  + 1 + process id), below the kernel's ephemeral range (docs/multihost.md says why)."""
  low = 32768
  try:
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])  # noqa: SIM115
  except (OSError, ValueError):
    pass
  rng = random.Random()
  for _ in range(200):
    base = rng.randrange(10_000, low - block)
    if all(_bindable(base + i) for i in range(block)):
      return base
  raise RuntimeError("no free port block below the ephemeral range")


def _bindable(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", port))
    except OSError:
      return False
  return True


def homes(name: str) -> list[pathlib.Path]:
  current = (node(name) / "incarnation").read_text().strip()
  return sorted((node(name) / "hosts" / current).glob("worker*"),
                key=lambda p: int(p.name.removeprefix("worker")))


def trainer_pids(name: str) -> list[int]:
  pids = []
  for home in homes(name):
    pid_file = home / "reasoning_rl" / "train.pid"
    if pid_file.exists() and pid_file.read_text().strip():
      pids.append(int(pid_file.read_text()))
  return pids


def alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def create(name: str, args: list[str]) -> int:
  if state_of(name) is not None:
    print(f"ERROR: (gcloud) queued resource {name} already exists", file=sys.stderr)
    return 1
  node(name).mkdir(parents=True, exist_ok=True)
  hosts = node(name) / "hosts"
  incarnation = len(list(hosts.glob("*"))) if hosts.exists() else 0
  for worker in range(int(os.environ.get("FAKE_GCLOUD_HOSTS", "2"))):
    (node(name) / "hosts" / str(incarnation) / f"worker{worker}").mkdir(parents=True)
  (node(name) / "incarnation").write_text(str(incarnation))
  (node(name) / "port").write_text(str(free_port()))
  (node(name) / "accelerator").write_text(option(args, "accelerator-type", ""))
  (node(name) / "state").write_text("PROVISIONING")
  return 0


def describe(name: str) -> int:
  state = state_of(name)
  if state is None:
    print(f"ERROR: (gcloud) NOT_FOUND: queued resource {name}", file=sys.stderr)
    return 1
  print(state)
  if state == "PROVISIONING":
    (node(name) / "state").write_text("ACTIVE")
  return 0


def delete(name: str) -> int:
  if state_of(name) is None:
    print(f"ERROR: (gcloud) NOT_FOUND: queued resource {name}", file=sys.stderr)
    return 1
  (node(name) / "state").write_text("DELETING")
  pids = [p for p in trainer_pids(name) if alive(p)]
  for pid in pids:
    os.kill(pid, signal.SIGTERM)
  deadline = time.monotonic() + float(os.environ.get("FAKE_GCLOUD_GRACE_S", "60"))
  while any(alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.2)
  for pid in pids:
    if alive(pid):
      os.kill(pid, signal.SIGKILL)
  (node(name) / "state").unlink()
  return 0


def worker_env(name: str, worker: int, home: pathlib.Path) -> dict:
  count = len(homes(name))
  env = {**os.environ, **json.loads(os.environ.get("FAKE_GCLOUD_WORKER_ENV", "{}"))}
  env.update(HOME=str(home), TPU_WORKER_ID=str(worker),
             TPU_WORKER_HOSTNAMES=",".join(["localhost"] * count),
             JAX_COORDINATOR_PORT=(node(name) / "port").read_text().strip(),
             HOSTNAME=f"{name}-w-{worker}", PYTHONUNBUFFERED="1")
  return env


def selected(name: str, args: list[str]) -> list[tuple[int, pathlib.Path]]:
  which = option(args, "worker", "0")
  workers = list(enumerate(homes(name)))
  return workers if which == "all" else [workers[int(which)]]


def unreachable(name: str) -> bool:
  if state_of(name) == "ACTIVE":
    return False
  print(f"ssh: connect to host {name}: Connection refused", file=sys.stderr)
  return True


def scp(args: list[str]) -> int:
  source, target = positional(args)
  name, _, destination = target.partition(":")
  if unreachable(name):
    return 255
  for _, home in selected(name, args):
    shutil.copy(source, home / destination)
  return 0


def ssh(name: str, args: list[str]) -> int:
  if unreachable(name):
    return 255
  command = option(args, "command")
  processes = [subprocess.Popen(["bash", "-c", command], cwd=home,
                                env=worker_env(name, worker, home), start_new_session=True)
               for worker, home in selected(name, args)]
  while any(p.poll() is None for p in processes):
    if state_of(name) != "ACTIVE":  # the host went away under the connection
      for p in processes:
        if p.poll() is None:
          os.killpg(p.pid, signal.SIGKILL)
      print(f"Connection to {name} closed by remote host.", file=sys.stderr)
      return 255
    time.sleep(0.2)
  return max((p.returncode for p in processes), key=abs)


def main(args: list[str]) -> int:
  STATE.mkdir(parents=True, exist_ok=True)
  with open(STATE / "calls.log", "a") as log:
    log.write(json.dumps(args) + "\n")
  words = positional(args)
  if words[:3] == ["compute", "tpus", "queued-resources"]:
    verb, name = words[3], words[4]
    return {"create": lambda: create(name, args), "describe": lambda: describe(name),
            "delete": lambda: delete(name)}[verb]()
  if words[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
    return ssh(words[4], args)
  if words[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    return scp(args[4:])
  print(f"fake gcloud: unsupported command {args}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
