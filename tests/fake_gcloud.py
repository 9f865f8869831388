"""A local stand-in for the `gcloud` commands of the tpu_vm recipe (launch/gcp/commands.py), so
that tests run the generated recipe unchanged: each TPU host is a directory (its home) and its
commands run as local processes with the variables a TPU host would have.

  gcloud compute tpus queued-resources create NAME (--node-id=NAME | --node-count=N
      --node-prefix=P) ...
  gcloud compute tpus queued-resources describe|delete NAME ...
  gcloud compute tpus queued-resources scp SRC NAME:DEST ... --node=all|K --worker=all|I
  gcloud compute tpus queued-resources ssh NAME ... --node=all|K --worker=all|I --command=CMD
  gcloud compute tpus tpu-vm scp SRC NODE:DEST ... --worker=all|I
  gcloud compute tpus tpu-vm ssh NODE ... --worker=all|I --command=CMD
  gcloud container node-pools create NAME --cluster=C ... [--service-account=SA --scopes=S]
  gcloud storage buckets add-iam-policy-binding gs://BUCKET --member=M --role=R

A queued resource holds one node (a slice) per --node-id, or N nodes P-0 ... P-(N-1) for a
multislice request (the TPU API's MultisliceParams naming). Every worker of node K gets
TPU_WORKER_ID (its index in the slice) and TPU_WORKER_HOSTNAMES (its slice's hosts); on several
slices also MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID = K and MEGASCALE_COORDINATOR_ADDRESS (node
0's worker 0), which a multislice TPU VM finds in its metadata (jax/_src/clusters/
cloud_tpu_cluster.py reads them from there or from the environment).

State lives under $FAKE_GCLOUD_STATE: NAME/state (what `describe` prints; a test writes SUSPENDED
there to simulate a preemption), NAME/nodes (the node names, one a line),
NAME/hosts/<incarnation>/<node>/worker<I> (each worker's home: a recreated queued resource gets
fresh disks, as on Cloud TPU; its file tpu-env holds the TPU_WORKER_* / MEGASCALE_* values the
host was given, as a VM's metadata does), calls.log (one line per call). $FAKE_GCLOUD_HOSTS
workers per slice (default 2); $FAKE_GCLOUD_WORKER_ENV a JSON object of extra variables for the
workers' commands (JAX_PLATFORMS=cpu, XLA_FLAGS, UV_CACHE_DIR ...).

Behaviour copied from the real service where the recipe depends on it: a queued resource is
PROVISIONING until described once, then ACTIVE, when each worker runs the startup script it was
created with (`--metadata-from-file=startup-script=FILE`), as at a VM's boot; `ssh` / `scp` fail
with exit code 255 unless the resource is ACTIVE, and an `ssh` whose resource leaves ACTIVE while
it runs is cut (exit 255); a command an ssh started goes on when the ssh itself is killed (a
dropped connection); `delete` gives every process of the hosts (found by their HOME) up to
$FAKE_GCLOUD_GRACE_S (default 60) after SIGTERM, as a host's shutdown would, then kills them.

GKE and Cloud Storage, for --mode=jobset_setup: `container node-pools create NAME ...` and
`storage buckets add-iam-policy-binding gs://B ...` record what they were given under
$FAKE_GCLOUD_STATE/nodepools/ and iam/.
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
import threading
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


def node_names(name: str) -> list[str]:
  return (node(name) / "nodes").read_text().split()


def homes(name: str) -> list[tuple[int, int, pathlib.Path]]:
  """(slice index, worker index, home) of every worker of the current incarnation."""
  current = node(name) / "hosts" / (node(name) / "incarnation").read_text().strip()
  found = []
  for slice_index, node_name in enumerate(node_names(name)):
    workers = sorted((current / node_name).glob("worker*"),
                     key=lambda p: int(p.name.removeprefix("worker")))
    found += [(slice_index, int(w.name.removeprefix("worker")), w) for w in workers]
  return found


def host_processes(name: str) -> list[int]:
  """Every process running on the queued resource's hosts: those whose HOME is a worker's home
  (every command a worker runs gets it, and its children inherit it), found in /proc."""
  wanted = {f"HOME={home}".encode() for _, _, home in homes(name)}
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as environ:
        if wanted & set(environ.read().split(b"\0")):
          found.append(int(entry))
    except OSError:
      continue
  return found


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
  if option(args, "node-count"):
    prefix = option(args, "node-prefix", name)
    nodes = [f"{prefix}-{k}" for k in range(int(option(args, "node-count")))]
  else:
    nodes = [option(args, "node-id", name)]
  node(name).mkdir(parents=True, exist_ok=True)
  hosts = node(name) / "hosts"
  incarnation = len(list(hosts.glob("*"))) if hosts.exists() else 0
  for node_name in nodes:
    for worker in range(int(os.environ.get("FAKE_GCLOUD_HOSTS", "2"))):
      (hosts / str(incarnation) / node_name / f"worker{worker}").mkdir(parents=True)
  (node(name) / "nodes").write_text("\n".join(nodes) + "\n")
  (node(name) / "incarnation").write_text(str(incarnation))
  (node(name) / "port").write_text(str(free_port()))
  (node(name) / "accelerator").write_text(option(args, "accelerator-type", ""))
  metadata = option(args, "metadata-from-file", "")
  if metadata.startswith("startup-script="):
    shutil.copy(metadata.split("=", 1)[1], node(name) / "startup-script")
  for slice_index, worker, home in homes(name):
    # the VM's "tpu-env" metadata, in its "KEY: 'value'" lines (jax/_src/clusters/
    # cloud_tpu_cluster.py reads it); the tests read what each host was told from there
    lines = [f"{key}: '{value}'" for key, value in tpu_variables(name, slice_index, worker).items()]
    (home / "tpu-env").write_text("\n".join(lines) + "\n")
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
    boot(name)
  return 0


def delete(name: str) -> int:
  if state_of(name) is None:
    print(f"ERROR: (gcloud) NOT_FOUND: queued resource {name}", file=sys.stderr)
    return 1
  (node(name) / "state").write_text("DELETING")
  pids = host_processes(name)  # a host's shutdown: SIGTERM to every process, then SIGKILL
  for pid in pids:
    try:
      os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
      pass
  deadline = time.monotonic() + float(os.environ.get("FAKE_GCLOUD_GRACE_S", "60"))
  while any(alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.2)
  for pid in host_processes(name):
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  (node(name) / "state").unlink()
  return 0


def boot(name: str) -> None:
  """What a worker does when it comes up: run the queued resource's startup script, if it has
  one (`--metadata-from-file=startup-script=FILE`), in the background, as a TPU VM's boot does."""
  script = node(name) / "startup-script"
  if not script.exists():
    return
  for k, worker, home in homes(name):
    with open(home / "startup-script.log", "ab") as log:
      subprocess.Popen(["bash", str(script)], cwd=home, env=worker_env(name, k, worker, home),
                       stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                       start_new_session=True)


def tpu_variables(name: str, slice_index: int, worker: int) -> dict:
  """What a TPU VM of slice `slice_index` knows of its place: its index in the slice and the
  slice's hosts (TPU_WORKER_*), and on several slices how the slices join (MEGASCALE_*)."""
  nodes = node_names(name)
  slice_hosts = sum(1 for k, _, _ in homes(name) if k == slice_index)
  variables = {"TPU_WORKER_ID": str(worker),
               "TPU_WORKER_HOSTNAMES": ",".join(["localhost"] * slice_hosts)}
  if len(nodes) > 1:
    variables.update(MEGASCALE_NUM_SLICES=str(len(nodes)), MEGASCALE_SLICE_ID=str(slice_index),
                     MEGASCALE_COORDINATOR_ADDRESS="localhost")
  return variables


def worker_env(name: str, slice_index: int, worker: int, home: pathlib.Path) -> dict:
  env = {**os.environ, **json.loads(os.environ.get("FAKE_GCLOUD_WORKER_ENV", "{}"))}
  env.update(tpu_variables(name, slice_index, worker), HOME=str(home),
             JAX_COORDINATOR_PORT=(node(name) / "port").read_text().strip(),
             HOSTNAME=f"{node_names(name)[slice_index]}-w-{worker}", PYTHONUNBUFFERED="1")
  return env


def owner(node_name: str) -> str | None:
  """The queued resource that holds node `node_name` (tpu-vm commands name nodes)."""
  for path in STATE.glob("*/nodes"):
    if node_name in path.read_text().split():
      return path.parent.name
  return None


def selected(name: str, args: list[str], node_name: str | None = None
             ) -> list[tuple[int, int, pathlib.Path]]:
  """The workers --node / --worker pick (a tpu-vm command: the workers of `node_name`)."""
  nodes = node_names(name)
  which_node = (str(nodes.index(node_name)) if node_name is not None
                else option(args, "node", "0"))
  which_worker = option(args, "worker", "0")
  return [(k, w, home) for k, w, home in homes(name)
          if which_node in ("all", str(k)) and which_worker in ("all", str(w))]


def unreachable(name: str | None, target: str) -> bool:
  if name is not None and state_of(name) == "ACTIVE":
    return False
  print(f"ssh: connect to host {target}: Connection refused", file=sys.stderr)
  return True


def scp(args: list[str], *, by_node: bool) -> int:
  source, target = positional(args)
  target_name, _, destination = target.partition(":")
  name = owner(target_name) if by_node else target_name
  if unreachable(name, target_name):
    return 255
  for _, _, home in selected(name, args, target_name if by_node else None):
    shutil.copy(source, home / destination)
  return 0


def ssh(target: str, args: list[str], *, by_node: bool) -> int:
  name = owner(target) if by_node else target
  if unreachable(name, target):
    return 255
  command = option(args, "command")
  processes = [subprocess.Popen(["bash", "-c", command], cwd=home,
                                env=worker_env(name, k, worker, home), start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for k, worker, home in selected(name, args, target if by_node else None)]
  # as ssh: the session ends when its command has exited and everything that holds the
  # session's output (a background process that kept it) has closed it
  copies = [threading.Thread(target=copy, args=(stream, out), daemon=True)
            for p in processes for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]
  for thread in copies:
    thread.start()
  while any(p.poll() is None for p in processes) or any(t.is_alive() for t in copies):
    if state_of(name) != "ACTIVE":  # the host went away under the connection
      for p in processes:
        if p.poll() is None:
          os.killpg(p.pid, signal.SIGKILL)
      print(f"Connection to {target} closed by remote host.", file=sys.stderr)
      return 255
    time.sleep(0.2)
  return max((p.returncode for p in processes), key=abs)


def copy(stream, out) -> None:
  """A worker's output, line by line, to this ssh's own."""
  for line in iter(stream.readline, b""):
    out.buffer.write(line)
    out.flush()


def node_pool_create(name: str, args: list[str]) -> int:
  """GKE: records the node pool's service account and scopes (default: the Compute Engine default
  account with GKE's default scopes, whose storage scope is read-only), for
  tests/jobset_runner.py's identity of the pods on it."""
  pools = STATE / "nodepools"
  pools.mkdir(exist_ok=True)
  if (pools / f"{name}.json").exists():
    print(f"ERROR: (gcloud.container.node-pools.create) node pool {name} exists", file=sys.stderr)
    return 1
  record = {"cluster": option(args, "cluster"), "machine_type": option(args, "machine-type"),
            "tpu_topology": option(args, "tpu-topology"), "num_nodes": option(args, "num-nodes"),
            "service_account": option(args, "service-account", "default"),
            "scopes": option(args, "scopes", "gke-default").split(","),
            "spot": "--spot" in args}
  (pools / f"{name}.json").write_text(json.dumps(record))
  return 0


def bucket_iam_binding(bucket: str, args: list[str]) -> int:
  """Cloud Storage: records a (member, role) binding on the bucket."""
  iam = STATE / "iam"
  iam.mkdir(exist_ok=True)
  path = iam / f"{bucket.removeprefix('gs://')}.json"
  bindings = json.loads(path.read_text()) if path.exists() else []
  bindings.append({"member": option(args, "member"), "role": option(args, "role")})
  path.write_text(json.dumps(bindings))
  return 0


def main(args: list[str]) -> int:
  STATE.mkdir(parents=True, exist_ok=True)
  with open(STATE / "calls.log", "a") as log:
    log.write(json.dumps(args) + "\n")
  words = positional(args)
  if words[:3] == ["container", "node-pools", "create"]:
    return node_pool_create(words[3], args)
  if words[:3] == ["storage", "buckets", "add-iam-policy-binding"]:
    return bucket_iam_binding(words[3], args)
  if words[:3] == ["compute", "tpus", "queued-resources"]:
    verb = words[3]
    if verb == "ssh":
      return ssh(words[4], args, by_node=False)
    if verb == "scp":
      return scp(args[4:], by_node=False)
    name = words[4]
    return {"create": lambda: create(name, args), "describe": lambda: describe(name),
            "delete": lambda: delete(name)}[verb]()
  if words[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
    return ssh(words[4], args, by_node=True)
  if words[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    return scp(args[4:], by_node=True)
  print(f"fake gcloud: unsupported command {args}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
