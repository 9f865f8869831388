"""The commands that run a config on Google Cloud TPUs, generated from the config and a few flags.

  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=tpu_vm --project=P \
      --zone=us-east5-a --workdir=gs://BUCKET/run --source=https://github.com/U/reasoning_rl.git \
      --spot --dry_run > run_r1zero.sh          # the recipe; without --dry_run it runs
  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=down --project=P --zone=Z
  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=xpk --cluster=C ... --dry_run
  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=jobset --image=IMAGE \
      --service_account=KSA > jobset.yaml

Every mode takes --num_slices=N (default: the config's target.num_slices, 1): N slices of the
accelerator type joined over the data-center network (TPU Multislice), one JAX process per host.

Modes:
- tpu_vm: a bash recipe that drives a queued resource to the end of the run: create it, wait
  until ACTIVE, copy launch/gcp/install_worker.sh to every worker and run it (idempotent: its own
  Python >= 3.11 environment with uv, the pinned jax[tpu]), start the trainer on every worker,
  follow worker 0's log until the trainers exit, then act on the exit code: 0 done; 2 / 3 / 4 / 130
  stop (bad config, guard, storage, Ctrl-C: a rerun would fail the same way); anything else
  (143 preempted, 5 lost peer, a worker gone) delete + recreate when the queued resource left
  ACTIVE (Spot TPU VMs cannot be restarted, only recreated), reinstall and resume from the workdir,
  at most --max_restarts times. The queued resource is deleted however the recipe ends (a trap);
  `--mode=down` deletes it on its own.
  Several slices: one multislice queued resource (--node-count / --node-prefix).
- xpk: one `xpk workload create` (GKE, for users of xpk) with --num-slices, --max-restarts and the
  grace period; the image is --image (--docker-image), or xpk builds it from --base_image and the
  repository root (--base-docker-image + --script-dir=.).
- jobset: a JobSet manifest (jobset.x-k8s.io/v1alpha2) for GKE without xpk: one Job per slice, one
  pod per TPU host; the slices restart as a whole on preemption, node disruption and lost peers,
  never on exit codes 2 / 3 / 4 (a podFailurePolicy fails the Job, a JobSet failurePolicy rule
  then fails the JobSet).
On every host the same `launch/train.py` command runs; on TPU JAX finds the other hosts itself.
TPU7x (Ironwood) runs on GKE only here: the Cloud TPU API behind queued resources does not serve it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib
import shlex
import subprocess
import sys

from absl import app
from absl import flags

# the repository root, so that the script runs from a checkout without an install
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from reasoning_rl.errors import ExitCode  # noqa: E402  (light: no jax)
from reasoning_rl.tpu_chips import slice_name  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
INSTALL_SCRIPT = HERE / "install_worker.sh"
JAX_TPU = "jax[tpu]==0.10.2"  # what install_worker.sh installs (its REASONING_RL_JAX default)
# Where install_worker.sh puts the project and its environment: ~/reasoning_rl on a TPU VM worker,
# /opt/reasoning_rl in the container image (Dockerfile).
WORKER_ROOT = "$HOME/reasoning_rl"
IMAGE_ROOT = "/opt/reasoning_rl"

# Exit codes of launch/train.py after which a rerun cannot help (bad config or input, a guard
# stopped the run, storage failure, Ctrl-C): the recipes stop instead of restarting.
FINAL_EXIT_CODES = tuple(int(code) for code in (ExitCode.BAD_INPUT, ExitCode.GUARD,
                                                 ExitCode.STORAGE, ExitCode.INTERRUPTED))
LOST_PEER_EXIT_CODE = int(ExitCode.LOST_PEER)
PREEMPTED_EXIT_CODE = int(ExitCode.PREEMPTED)

# accelerator type (TPU API name) -> (chips, chips per host VM, slice topology). A host here is a
# VM: one JAX process, one TPU VM worker, one GKE pod.
# v5p / v4: the name counts TensorCores (2 per chip), 4 chips per VM; cloud.google.com/tpu/docs/v5p
#   ("2x4x4 ... 64 cores, 32 chips, 8 machines") and /tpu/docs/v4.
# v5e / v6e: the name counts chips; slices of up to 8 chips are one VM, larger ones VMs of 4 chips
#   (cloud.google.com/tpu/docs/v6e, "Supported configurations": 4x4 = 16 chips on 4 VMs ...
#   16x16 = 256 chips on 64 VMs; the same shapes for v5e in /tpu/docs/v5e and in google/xpk's
#   system_characteristics.py, v5litepod-16: 4 VMs of ct5lp-hightpu-4t).
# TPU7x (Ironwood, "v7x"): the name counts TensorCores, 2 per chip (docs.cloud.google.com/tpu/docs/
#   tpu7x: "Each TPU7x chip contains two TensorCores"); 4 chips per VM, except the one-chip 1x1x1
#   (docs.cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood: "Each Ironwood (TPU7x)
#   VM contains four chips"). Names and topologies from google/xpk (AI-Hypercomputer/xpk at
#   367c838, src/xpk/core/system_characteristics.py): prefix 'tpu7x', tensorcores_per_chip=2,
#   machine tpu7x-standard-1t for 1x1x1 and tpu7x-standard-4t (compute_chips_per_vm: 4) for the
#   rest, whose default topologies include 2x2x1 ... 4x8x8 (tpu7x-8 ... tpu7x-512).
_2D = ((1, "1x1"), (4, "2x2"), (8, "2x4"), (16, "4x4"), (32, "4x8"), (64, "8x8"), (128, "8x16"),
       (256, "16x16"))
ACCELERATORS = {
    **{f"v5p-{2 * chips}": (chips, 4, topology) for chips, topology in (
        (4, "2x2x1"), (8, "2x2x2"), (16, "2x2x4"), (32, "2x4x4"), (64, "4x4x4"), (128, "4x4x8"))},
    **{f"v4-{2 * chips}": (chips, 4, topology) for chips, topology in (
        (4, "2x2x1"), (8, "2x2x2"), (16, "2x2x4"), (32, "2x4x4"), (64, "4x4x4"))},
    **{f"v5litepod-{chips}": (chips, chips if chips <= 8 else 4, topology)
       for chips, topology in _2D},
    **{f"v6e-{chips}": (chips, chips if chips <= 8 else 4, topology) for chips, topology in _2D},
    **{f"tpu7x-{2 * chips}": (chips, 1 if chips == 1 else 4, topology) for chips, topology in (
        (1, "1x1x1"), (4, "2x2x1"), (8, "2x2x2"), (16, "2x2x4"), (32, "2x4x4"), (64, "4x4x4"),
        (128, "4x4x8"), (256, "4x8x8"))},
}
# JAX devices per chip where it is not one (v4 / v5p run their two TensorCores as one device):
# a TPU7x chip is two chiplets that JAX sees as two devices (docs.cloud.google.com/tpu/docs/tpu7x,
# "Dual-chiplet architecture": the programming model gives access to two TPU devices per chip).
JAX_DEVICES_PER_CHIP = {"tpu7x": 2}
# TPU VM software versions (cloud.google.com/tpu/docs/runtimes: the versions for JAX / PyTorch).
# TPU7x has none here: the same page says "The Cloud TPU API is not supported on TPU7x and later
# TPU versions", and queued resources are that API, so --mode=tpu_vm refuses tpu7x (Google's own
# AI-Hypercomputer/accelerator-microbenchmarks README once created a tpu7x-8 queued resource with
# --runtime-version=v2-alpha-tpu7-ubuntu2404 and `gcloud alpha`; the docs no longer offer that).
RUNTIME_VERSION = {"v5p": "v2-alpha-tpuv5", "v4": "tpu-ubuntu2204-base",
                   "v5litepod": "v2-alpha-tpuv5-lite", "v6e": "v2-alpha-tpuv6e"}
# GKE node labels cloud.google.com/gke-tpu-accelerator (google/xpk system_characteristics.py, its
# gke_accelerator field: 'tpu7x' for TPU7x; cloud.google.com/kubernetes-engine/docs/concepts/tpus)
GKE_ACCELERATOR = {"v5p": "tpu-v5p-slice", "v4": "tpu-v4-podslice",
                   "v5litepod": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice", "tpu7x": "tpu7x"}


@dataclasses.dataclass(frozen=True)
class Slice:
  accelerator_type: str
  chips: int
  hosts: int
  topology: str

  @property
  def generation(self) -> str:
    return self.accelerator_type.split("-")[0]

  @property
  def devices(self) -> int:
    """JAX devices of the slice (what the config's target.num_devices counts)."""
    return self.chips * JAX_DEVICES_PER_CHIP.get(self.generation, 1)


def slice_for(accelerator_type: str) -> Slice:
  if accelerator_type not in ACCELERATORS:
    raise SystemExit(f"error: --accelerator_type={accelerator_type}: known types are "
                     f"{', '.join(ACCELERATORS)}")
  chips, per_host, topology = ACCELERATORS[accelerator_type]
  return Slice(accelerator_type, chips, max(1, chips // per_host), topology)


def accelerator_from_config(config) -> str:
  """The config's target slice as an accelerator type (`tpu_chips.slice_name`): v5p-64 for 32 v5p
  devices, v5litepod-16 for 16 v5e devices, tpu7x-16 for 16 v7x devices (8 chips); an unknown
  target as TPU-N, which the caller refuses naming the known types."""
  tpu, devices = config.target.tpu, config.target.num_devices
  return slice_name(tpu, devices) or f"{tpu}-{devices}"


def parse_num_slices(value: str) -> int | None:
  """--num_slices as a whole number >= 1, or None when it is not one."""
  text = str(value).strip()
  return int(text) if text.isdigit() and int(text) >= 1 else None


def train_command(config_path: str, workdir: str, overrides=(), python: str = "python3"
                  ) -> list[str]:
  return [python, "launch/train.py", f"--config={config_path}", f"--config.workdir={workdir}",
          *overrides]


def grace_seconds(config) -> int:
  """SIGTERM-to-kill seconds a host needs: the planner's grace (the longer of one decode call and
  the train step, plus the save; reasoning_rl/planning.py) and 30 s for start-up and exit; 60 s
  when the config names no target slice to plan for."""
  if not config.target.get("num_devices"):
    return 60
  from reasoning_rl import planning  # pylint: disable=import-outside-toplevel

  plan = planning.plan(config, planning.dry_run_model_config(config), target=dict(config.target))
  return int(math.ceil(plan.preemption.grace_s)) + 30


# ---------------------------------------------------------------------------------------------
# Cloud TPU VMs: a queued resource driven by a bash recipe


def worker_start_command(train: list[str]) -> str:
  """Starts the trainer in the background on one worker and returns once its pid is written, so
  that ssh returns: ~/reasoning_rl/train.log, train.pid, and exit_code (written when it ends).
  `train[0]` (the interpreter) stays unquoted: it names $HOME, expanded on the worker."""
  root = WORKER_ROOT
  run = (f"{train[0]} {' '.join(shlex.quote(a) for a in train[1:])} > {root}/train.log 2>&1 "
         f"< /dev/null & echo $! > {root}/train.pid; wait $!; echo $? > {root}/exit_code")
  return (f"cd {root}/src && rm -f {root}/exit_code {root}/train.pid && "
          f"nohup bash -c {shlex.quote(run)} > /dev/null 2>&1 < /dev/null & "
          f"until [ -s {root}/train.pid ]; do sleep 0.2; done")


def slices_line(s: Slice, num_slices: int = 1) -> str:
  """One line saying what runs where, e.g. "v5p-64: 32 chips on 8 hosts (2x4x4)"."""
  if num_slices == 1:
    return f"{s.accelerator_type}: {s.chips} chips on {s.hosts} hosts ({s.topology})"
  return (f"{num_slices} x {s.accelerator_type}: {num_slices * s.chips} chips on "
          f"{num_slices * s.hosts} hosts, {num_slices} slices of {s.chips} chips on {s.hosts} "
          f"hosts ({s.topology})")


def tpu_vm_script(s: Slice, *, name, project, zone, source, train, spot=False, max_restarts=5,
                  poll_s=30, settle_s=120, num_slices=1) -> str:
  """The tpu_vm recipe: a bash script (see the module docstring). Several slices are one
  multislice queued resource of `num_slices` nodes NAME-0 ... NAME-(N-1), reached together by
  `queued-resources ssh / scp --node=all`; the TPU runtime gives their VMs the MEGASCALE_*
  variables that join the slices (JAX reads them: jax/_src/clusters/cloud_tpu_cluster.py)."""
  where = f"--project={shlex.quote(project)} --zone={shlex.quote(zone)}"
  qr = "gcloud compute tpus queued-resources"
  script = shlex.quote(str(INSTALL_SCRIPT))
  if num_slices == 1:
    nodes = '--node-id="$NAME"'
    ssh_all = f'gcloud compute tpus tpu-vm ssh "$NAME" {where} --worker=all'
    ssh_first = f'gcloud compute tpus tpu-vm ssh "$NAME" {where} --worker=0'
    copy = f'gcloud compute tpus tpu-vm scp {script} "$NAME":install_worker.sh {where} --worker=all'
  else:
    # cloud.google.com/tpu/docs/multislice-introduction: a multislice queued resource takes
    # --node-count / --node-prefix instead of --node-id (gcloud reference of queued-resources
    # create); its nodes are PREFIX-0 ... PREFIX-(N-1) (the TPU API's MultisliceParams); `gcloud
    # compute tpus queued-resources ssh|scp QR --node=all --worker=all` reach every worker of every
    # node (their gcloud reference pages).
    nodes = f'--node-count={num_slices} --node-prefix="$NAME"'
    ssh_all = f'{qr} ssh "$NAME" {where} --node=all --worker=all'
    ssh_first = f'{qr} ssh "$NAME" {where} --node=0 --worker=0'
    copy = f'{qr} scp {script} "$NAME":install_worker.sh {where} --node=all --worker=all'
  train = [f"{WORKER_ROOT}/venv/bin/python", *train[1:]]
  start = worker_start_command(train)
  log, pid, code_file = (f"{WORKER_ROOT}/{f}" for f in ("train.log", "train.pid", "exit_code"))
  follow = f'tail -n +1 --pid="$(cat {pid})" -f {log}'
  read_code = (f"for i in $(seq 50); do [ -s {code_file} ] && break; sleep 0.2; done; "
               f"cat {code_file}")
  return f"""#!/usr/bin/env bash
# {slices_line(s, num_slices)}; generated by
# launch/gcp/commands.py. Deletes the queued resource however it ends (Ctrl-C included).
set -uo pipefail
NAME={shlex.quote(name)}
MAX_RESTARTS={max_restarts}
POLL_S="${{POLL_S:-{poll_s}}}"
SETTLE_S="${{SETTLE_S:-{settle_s}}}"

create() {{
  {qr} create "$NAME" {nodes} --accelerator-type={s.accelerator_type} \\
      --runtime-version={RUNTIME_VERSION[s.generation]} {where}{' --spot' if spot else ''}
}}
down() {{ {qr} delete "$NAME" {where} --force --quiet; }}
state() {{
  {qr} describe "$NAME" {where} --format='value(state.state)' 2> /dev/null || echo MISSING
}}
# 0 once ACTIVE; 1 when the queued resource failed or was suspended (preempted)
wait_active() {{
  while :; do
    case "$(state)" in
      ACTIVE) return 0 ;;
      FAILED | SUSPENDED | SUSPENDING | MISSING) return 1 ;;
      *) sleep "$POLL_S" ;;
    esac
  done
}}
recreate() {{ down || true; create && wait_active; }}
install() {{
  {copy} &&
  {ssh_all} \\
      --command={shlex.quote(f"bash install_worker.sh {shlex.quote(source)}")}
}}
start() {{ {ssh_all} --command={shlex.quote(start)}; }}
follow() {{ {ssh_first} --command={shlex.quote(follow)}; }}
exit_code() {{ {ssh_first} --command={shlex.quote(read_code)} 2> /dev/null || echo none; }}

trap 'down' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
case "$(state)" in MISSING) create || exit 1 ;; esac
restarts=0
while :; do
  if wait_active && install && start; then
    follow
    code="$(exit_code | tail -n 1)"
  else
    code=none
  fi
  case "$code" in
    0) echo "the run finished"; exit 0 ;;
    {' | '.join(map(str, FINAL_EXIT_CODES))})
      echo "the trainers stopped with exit code $code: not restarted (see train.log)"
      exit "$code" ;;
  esac
  restarts=$((restarts + 1))
  if [ "$restarts" -gt "$MAX_RESTARTS" ]; then
    echo "error: the trainers ended (exit code $code) $restarts times; gave up (--max_restarts)"
    exit 1
  fi
  # preempted hosts take a while to leave ACTIVE: recreate once they did, else restart in place
  for i in $(seq "$SETTLE_S"); do [ "$(state)" = ACTIVE ] || break; sleep 1; done
  echo "restart $restarts/$MAX_RESTARTS: trainers ended (exit code $code), queued resource $(state)"
  if [ "$(state)" != ACTIVE ]; then recreate || true; fi
done
"""


def down_command(*, name, project, zone) -> list[str]:
  return ["gcloud", "compute", "tpus", "queued-resources", "delete", name, f"--project={project}",
          f"--zone={zone}", "--force", "--quiet"]


# ---------------------------------------------------------------------------------------------
# GKE: xpk and JobSet


# xpk's own image build (`--base-docker-image=BASE --script-dir=DIR`) puts DIR's files (less what
# DIR/.dockerignore excludes) into /app of an image made FROM BASE, and /app is that image's
# working directory: google/xpk src/xpk/core/docker_image.py (xpk 1.16.0, AI-Hypercomputer/xpk at
# 367c838), the Dockerfile it writes ("WORKDIR /app", "COPY . .") or crane's "--workdir /app".
# The container then runs our command from that copy with the base image's environment.
XPK_SCRIPT_DIR = "/app"


def container_command(train: list[str], *, lost_peer_as_preempted: bool,
                      project_dir: str = f"{IMAGE_ROOT}/src") -> list[str]:
  """The trainer inside the image: the environment IMAGE_ROOT/venv (install_worker.sh in the
  Dockerfile) runs `train` from `project_dir`, the image's own copy of the project or the copy xpk
  added (XPK_SCRIPT_DIR). launch/train.py puts its own checkout first on sys.path; PYTHONPATH
  says the same to every Python process it starts, ahead of the environment's editable install.

  xpk's container script hands the trainer's exit code to the JobSet. Which codes restart the
  slice changed with xpk's versions: at 59c555a only 143 came back (others became a success
  unless --restart-on-user-code-failure); xpk 1.16.0's podFailurePolicy fails the workload on
  every code but 42 and 127-255 (commands/workload.py, get_restart_exit_codes). Either way 143
  restarts and 2 / 3 / 4 end it: `lost_peer_as_preempted` reports a lost peer (5) as 143, so
  that it restarts the slice on both."""
  run = " ".join(shlex.quote(a) for a in [f"{IMAGE_ROOT}/venv/bin/python", *train[1:]])
  enter = f"cd {project_dir} && export PYTHONPATH={project_dir} &&"
  if not lost_peer_as_preempted:
    return ["bash", "-c", f"{enter} exec {run}"]
  return ["bash", "-c", f"{enter} {run}; code=$?; "
          f"if [ $code = {LOST_PEER_EXIT_CODE} ]; then echo 'lost peer (exit 5): reported as "
          f"{PREEMPTED_EXIT_CODE} so that the slice restarts'; exit {PREEMPTED_EXIT_CODE}; fi; "
          "exit $code"]


def xpk_command(s: Slice, *, name, project, zone, cluster, image=None, base_image=None, train,
                max_restarts=5, grace_s=60, num_slices=1) -> list[str]:
  """`xpk workload create` for `num_slices` slices of `s`. With `image` xpk runs that image
  (--docker-image, our Dockerfile's); with `base_image` xpk builds one itself from it and the
  current directory, the repository root (--base-docker-image + --script-dir=.), and the
  trainer runs from xpk's copy (XPK_SCRIPT_DIR)."""
  if (image is None) == (base_image is None):
    raise ValueError("give exactly one of image and base_image")
  if image is not None:
    source = [f"--docker-image={image}"]
    command = container_command(train, lost_peer_as_preempted=True)
  else:
    source = [f"--base-docker-image={base_image}", "--script-dir=."]
    command = container_command(train, lost_peer_as_preempted=True, project_dir=XPK_SCRIPT_DIR)
  return ["xpk", "workload", "create", f"--workload={name}", f"--cluster={cluster}",
          f"--project={project}", f"--zone={zone}", f"--tpu-type={s.accelerator_type}",
          f"--num-slices={num_slices}", *source, f"--max-restarts={max_restarts}",
          f"--termination-grace-period-seconds={grace_s}", f"--command={shlex.join(command)}"]


# JobSet fills these pod annotations (kubernetes-sigs/jobset; the CRD's `coordinator` field:
# "an annotation will be added to all Jobs and pods with coordinator pod ...
# jobset.sigs.k8s.io/coordinator=<pod hostname>.<headless service>").
JOB_INDEX_ANNOTATION = "jobset.sigs.k8s.io/job-index"
COORDINATOR_ANNOTATION = "jobset.sigs.k8s.io/coordinator"


def multislice_environment(num_slices: int) -> list[dict]:
  """The variables that join the slices of a multi-slice JobSet, named and sourced as in google/
  xpk's Pathways workload template (src/xpk/templates/pathways_workload_create.yaml.j2): the slice
  count, the slice id from the Job's index in the replicated job, the coordinator from JobSet's
  coordinator pod (slice 0, pod 0). JAX reads them (jax/_src/clusters/cloud_tpu_cluster.py: process
  id = slice id x hosts per slice + TPU_WORKER_ID, coordinator = that host); xpk's own TPU
  manifests leave them to GKE, this manifest states them."""
  def annotation(key):
    return {"fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}}

  return [{"name": "MEGASCALE_NUM_SLICES", "value": str(num_slices)},
          {"name": "MEGASCALE_SLICE_ID", "valueFrom": annotation(JOB_INDEX_ANNOTATION)},
          {"name": "MEGASCALE_COORDINATOR_ADDRESS",
           "valueFrom": annotation(COORDINATOR_ANNOTATION)}]


def jobset_manifest(s: Slice, *, name, image, train, max_restarts=5, grace_s=60,
                    service_account=None, num_slices=1) -> dict:
  """`num_slices` Jobs (replicas of the replicated job "slice"), each of `hosts` pods (one per TPU
  VM). Any pod failure fails its Job (backoffLimit 0) and the JobSet recreates every Job
  (RestartJobSet, counted against maxRestarts): preemption (143), node disruption, a lost peer
  (5). Exit codes 2 / 3 / 4 match the podFailurePolicy's FailJob rule, whose Job failure reason
  `PodFailurePolicy` the JobSet's rule turns into FailJobSet. Each slice gets its own node pool
  (the exclusive-topology annotation: one Job per node pool)."""
  container = {
      "name": "trainer", "image": image, "workingDir": f"{IMAGE_ROOT}/src",
      "command": container_command(train, lost_peer_as_preempted=False),
      "resources": {"limits": {"google.com/tpu": s.chips // s.hosts}},
  }
  if num_slices > 1:
    container["env"] = multislice_environment(num_slices)
  pod = {
      "restartPolicy": "Never", "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
      "terminationGracePeriodSeconds": grace_s,
      "nodeSelector": {
          "cloud.google.com/gke-tpu-accelerator": GKE_ACCELERATOR[s.generation],
          "cloud.google.com/gke-tpu-topology": s.topology},
      "containers": [container]}
  if service_account:  # a Kubernetes service account bound to a Google one (Workload Identity)
    pod["serviceAccountName"] = service_account
  final = [c for c in FINAL_EXIT_CODES if c != ExitCode.INTERRUPTED]
  spec = {
      "failurePolicy": {"maxRestarts": max_restarts, "rules": [
          {"name": "stopOnConfigGuardOrStorage", "action": "FailJobSet",
           "onJobFailureReasons": ["PodFailurePolicy"]}]},
      "replicatedJobs": [{"name": "slice", "replicas": num_slices, "template": {"spec": {
          "parallelism": s.hosts, "completions": s.hosts, "backoffLimit": 0,
          "completionMode": "Indexed",
          "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
              "containerName": "trainer", "operator": "In", "values": final}}]},
          "template": {"spec": pod}}}}]}
  if num_slices > 1:  # the pod whose hostname becomes MEGASCALE_COORDINATOR_ADDRESS
    spec = {"coordinator": {"replicatedJob": "slice", "jobIndex": 0, "podIndex": 0}, **spec}
  return {
      "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
      "metadata": {"name": name, "annotations": {
          "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}},
      "spec": spec}


# ---------------------------------------------------------------------------------------------
# The program


def define_flags() -> None:
  """The command-line flags (defined when run as a program, not on import)."""
  global _CONFIG, _MODE, _ACCELERATOR, _PROJECT, _ZONE, _NAME, _WORKDIR, _SOURCE, _SPOT, \
      _CLUSTER, _IMAGE, _EXTRA, _DRY_RUN, _MAX_RESTARTS, _GRACE, _SERVICE_ACCOUNT, \
      _SHARED, _MODEL_SHARED, _NUM_SLICES, _BASE_IMAGE  # pylint: disable=global-statement
  _CONFIG = flags.DEFINE_string("config", None, "Training config file (its target slice is used).")
  _MODE = flags.DEFINE_enum("mode", "tpu_vm", ["tpu_vm", "down", "xpk", "jobset"],
                            "What to generate (down: delete the tpu_vm queued resource).")
  _ACCELERATOR = flags.DEFINE_string("accelerator_type", None,
                                     "e.g. v5p-64; default: from the config's target slice.")
  _PROJECT = flags.DEFINE_string("project", "PROJECT", "Google Cloud project.")
  _ZONE = flags.DEFINE_string("zone", "ZONE", "Zone of the TPU slice.")
  _NAME = flags.DEFINE_string("name", "reasoning-rl", "Queued resource / TPU / workload name.")
  _WORKDIR = flags.DEFINE_string(
      "workdir", None, "The run's workdir: gs://BUCKET/run, or a path mounted on every host.")
  _SOURCE = flags.DEFINE_string("source", None, "git URL (or archive, or a directory the workers "
                                "see) of the project, installed on every worker (tpu_vm mode).")
  _SHARED = flags.DEFINE_bool("workdir_is_shared", False, "The local --workdir is mounted at "
                               "the same path on every host (NFS, Filestore).")
  _MODEL_SHARED = flags.DEFINE_bool("model_is_shared", False, "The config's local model.path "
                                    "exists on every host (a mount, or copied by you).")
  _SPOT = flags.DEFINE_bool("spot", False, "Spot capacity (preemptible; the run resumes).")
  _CLUSTER = flags.DEFINE_string("cluster", "CLUSTER", "GKE cluster (xpk mode).")
  _IMAGE = flags.DEFINE_string("image", None, "Container image with the project (xpk / jobset;"
                               " see Dockerfile). Default: IMAGE, a placeholder.")
  _BASE_IMAGE = flags.DEFINE_string(
      "base_image", None, "xpk mode: let xpk build the image, from this base (the Dockerfile's "
      "image) and the repository root (--base-docker-image + --script-dir=.), instead of --image.")
  # a string, so that a wrong value gets this tool's one-line error rather than absl's usage text
  _NUM_SLICES = flags.DEFINE_string(
      "num_slices", None, "Slices of --accelerator_type joined over the data-center network "
      "(TPU Multislice), a whole number >= 1; default: the config's target.num_slices, else 1.")
  _EXTRA = flags.DEFINE_multi_string("override", [], "Extra --config.a.b=v for the trainer.")
  _DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands instead of running them.")
  _MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 5, "Restarts after preemption or a lost "
                                       "peer before giving up (all modes).")
  _GRACE = flags.DEFINE_integer("grace_s", None, "SIGTERM-to-kill seconds for GKE pods; default: "
                                "the planner's grace for the config's target + 30 s.")
  _SERVICE_ACCOUNT = flags.DEFINE_string(
      "service_account", None, "Kubernetes service account of the pods (jobset), bound to a "
      "Google service account with access to the workdir's bucket (Workload Identity).")


def load_config(path: str):
  spec = importlib.util.spec_from_file_location("_config_file", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def model_path(config, overrides) -> str:
  """The model.path the trainers will read: the last --override that sets it, else the config's."""
  given = [o.split("=", 1)[1] for o in overrides if o.startswith("--config.model.path=")]
  return given[-1] if given else config.model.get("path", "")


def image_build_line(image: str, *, base: bool = False) -> str:
  """How the image of the xpk / jobset modes is made: the Dockerfile at the repository root. As
  xpk's base (--base_image) the same image serves: xpk adds the repository to it."""
  line = (f"# the image, from the repository root: docker build -t {image} . && "
          f"docker push {image}")
  if base:
    line += ("\n# xpk then builds the workload's image from it and the repository root (run xpk "
             "there: --script-dir=.)")
  return line


def bad_input(message: str) -> int:
  print(f"error: {message}", file=sys.stderr)
  return ExitCode.BAD_INPUT


def main(argv) -> int:
  del argv
  import yaml  # pylint: disable=import-outside-toplevel

  if _MODE.value == "down":
    command = down_command(name=_NAME.value, project=_PROJECT.value, zone=_ZONE.value)
    print(shlex.join(command))
    return 0 if _DRY_RUN.value else subprocess.run(command, check=False).returncode
  if not _CONFIG.value:
    return bad_input("--config: give the training config file, e.g. configs/r1zero_tpu.py")
  config = load_config(_CONFIG.value)
  slices_given = _NUM_SLICES.value if _NUM_SLICES.value is not None else str(
      config.target.get("num_slices", 1))
  num_slices = parse_num_slices(slices_given)
  if num_slices is None:
    return bad_input(f"--num_slices={slices_given}: give a whole number of slices, 1 or more "
                     "(e.g. --num_slices=2)")
  accelerator = _ACCELERATOR.value or accelerator_from_config(config)
  if accelerator not in ACCELERATORS:
    return bad_input(f"--accelerator_type={accelerator}: unknown; known types are "
                     f"{', '.join(ACCELERATORS)}")
  s = slice_for(accelerator)
  if _MODE.value == "tpu_vm" and s.generation not in RUNTIME_VERSION:
    return bad_input(f"--accelerator_type={accelerator}: the Cloud TPU API (queued resources) does "
                     "not serve TPU7x (cloud.google.com/tpu/docs/runtimes); run it on GKE with "
                     "--mode=xpk or --mode=jobset")
  if _MODE.value in ("xpk", "jobset") and num_slices > 1 and s.hosts == 1:
    return bad_input(f"--num_slices={num_slices}: GKE runs Multislice on multi-host slices only "
                     f"and {accelerator} is one host (cloud.google.com/kubernetes-engine/docs/"
                     "how-to/tpu-multislice); pick an --accelerator_type of several hosts")
  image, base_image = _IMAGE.value, _BASE_IMAGE.value
  if base_image is not None and (_MODE.value != "xpk" or image is not None):
    return bad_input(f"--base_image={base_image}: only for --mode=xpk, instead of --image (xpk "
                     "builds the image from the base); give one of them")
  hosts = num_slices * s.hosts
  where = slices_line(s, num_slices).split(": ", 1)[0]
  workdir = _WORKDIR.value or config.workdir
  if not workdir:
    return bad_input("--workdir: give the run's workdir, gs://BUCKET/run (docs/storage.md) or a "
                     "directory mounted on every host")
  if hosts > 1 and "://" not in workdir and not _SHARED.value:
    return bad_input(f"--workdir={workdir}: a local path is not shared by the {hosts} hosts of "
                     f"{where}; give gs://BUCKET/run, or add --workdir_is_shared if "
                     "every host mounts it at this path (NFS, Filestore)")
  model = model_path(config, _EXTRA.value)
  if hosts > 1 and model and "://" not in model and not _MODEL_SHARED.value:
    name = pathlib.PurePath(model).name
    return bad_input(
        f"--config.model.path={model}: a local path the {hosts} hosts of {where} "
        f"do not have; upload it (gcloud storage cp -r {model} gs://BUCKET/models/{name}) and add "
        f"--override=--config.model.path=gs://BUCKET/models/{name}, or --model_is_shared if "
        "every host has it at this path")
  # after every check: bad input is one line, and these only say what differs from the plan
  if config.target.num_devices and s.devices != config.target.num_devices:
    print(f"warning: {_CONFIG.value} plans for {config.target.num_devices} devices per slice; "
          f"{s.accelerator_type} has {s.devices}", file=sys.stderr)
  if num_slices != config.target.get("num_slices", 1):
    print(f"warning: {_CONFIG.value} plans for {config.target.get('num_slices', 1)} slice(s); "
          f"launching {num_slices}", file=sys.stderr)
    if "num_slices" in config.target:  # the grace period is planned for what is launched
      config.target.num_slices = num_slices
  train = train_command(_CONFIG.value, workdir, _EXTRA.value)
  grace = _GRACE.value or grace_seconds(config)
  if _MODE.value == "jobset":
    image = image or "IMAGE"
    print(image_build_line(image))
    print(yaml.safe_dump(jobset_manifest(
        s, name=_NAME.value, image=image, train=train, max_restarts=_MAX_RESTARTS.value,
        grace_s=grace, service_account=_SERVICE_ACCOUNT.value, num_slices=num_slices),
        sort_keys=False), end="")
    return 0
  if _MODE.value == "xpk":
    if base_image is None:
      image = image or "IMAGE"
    command = xpk_command(s, name=_NAME.value, project=_PROJECT.value, zone=_ZONE.value,
                          cluster=_CLUSTER.value, image=image, base_image=base_image,
                          train=train, max_restarts=_MAX_RESTARTS.value, grace_s=grace,
                          num_slices=num_slices)
    print(f"# {slices_line(s, num_slices)}")
    print(shlex.join(command))
    print(image_build_line(base_image or image, base=base_image is not None))
    return 0 if _DRY_RUN.value else subprocess.run(command, check=False).returncode
  if not _SOURCE.value:
    return bad_input("--source: give the project's git URL (installed on every worker)")
  script = tpu_vm_script(s, name=_NAME.value, project=_PROJECT.value, zone=_ZONE.value,
                         source=_SOURCE.value, train=train, spot=_SPOT.value,
                         max_restarts=_MAX_RESTARTS.value, num_slices=num_slices)
  if _DRY_RUN.value:
    print(script, end="")
    return 0
  return subprocess.run(["bash", "-c", script], check=False).returncode


if __name__ == "__main__":
  define_flags()
  app.run(lambda argv: sys.exit(main(argv)))
