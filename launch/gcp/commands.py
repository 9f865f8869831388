"""The commands that run a config on Google Cloud TPUs, generated from the config and a few flags.

  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=tpu_vm \
      --project=P --zone=us-east5-a --workdir=gs://BUCKET/run --source=https://github.com/U/reasoning_rl.git --dry_run
  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=xpk --cluster=C ... --dry_run
  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=jobset --image=IMAGE ... > jobset.yaml

Modes:
- tpu_vm: a queued resource for the slice (`gcloud compute tpus queued-resources create`), wait
  until it is ACTIVE, install the project on every worker (`tpu-vm ssh --worker=all`), start the
  trainer on every worker (nohup + a log per worker, so ssh returns), tail worker 0's log, delete.
- xpk: one `xpk workload create` (GKE, for users of xpk).
- jobset: a JobSet manifest (jobset.x-k8s.io/v1alpha2) for GKE without xpk: one pod per TPU host,
  restarted as a whole on failure or preemption.
On every host the same `launch/train.py` command runs; JAX finds the other hosts itself.
Preemption: every host gets SIGTERM, the trainer saves one checkpoint and exits 143 everywhere;
the queued resource (or the JobSet's restart) runs the same command again and it resumes from
the workdir (docs/cloud_tpu.md). Without --dry_run the tpu_vm / xpk commands are executed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import shlex
import subprocess
import sys

from absl import app
from absl import flags

# accelerator type -> (chips, chips per host, slice topology); facts of Google's TPU docs
ACCELERATORS = {
    **{f"v5p-{2 * chips}": (chips, 4, topology) for chips, topology in (
        (4, "2x2x1"), (8, "2x2x2"), (16, "2x2x4"), (32, "2x4x4"), (64, "4x4x4"), (128, "4x4x8"))},
    **{f"v4-{2 * chips}": (chips, 4, topology) for chips, topology in (
        (4, "2x2x1"), (8, "2x2x2"), (16, "2x2x4"), (32, "2x4x4"), (64, "4x4x4"))},
}
RUNTIME_VERSION = {"v5p": "v2-alpha-tpuv5", "v4": "tpu-ubuntu2204-base"}
GKE_ACCELERATOR = {"v5p": "tpu-v5p-slice", "v4": "tpu-v4-podslice"}

@dataclasses.dataclass(frozen=True)
class Slice:
  accelerator_type: str
  chips: int
  hosts: int
  topology: str

  @property
  def generation(self) -> str:
    return self.accelerator_type.split("-")[0]


def slice_for(accelerator_type: str) -> Slice:
  if accelerator_type not in ACCELERATORS:
    raise SystemExit(f"error: --accelerator_type={accelerator_type}: known types are "
                     f"{', '.join(ACCELERATORS)}")
  chips, per_host, topology = ACCELERATORS[accelerator_type]
  return Slice(accelerator_type, chips, max(1, chips // per_host), topology)


def accelerator_from_config(config) -> str:
  """The config's target slice as an accelerator type (v5p / v4 count TensorCores: 2 per chip)."""
  return f"{config.target.tpu}-{2 * config.target.num_devices}"


def train_command(config_path: str, workdir: str, overrides=()) -> list[str]:
  return ["python3", "launch/train.py", f"--config={config_path}", f"--config.workdir={workdir}",
          *overrides]


def tpu_vm_commands(s: Slice, *, name, project, zone, source, train, spot=False) -> list[list[str]]:
  """Create (queued), wait, install on every worker, start everywhere, tail, delete."""
  where = [f"--project={project}", f"--zone={zone}"]
  create = ["gcloud", "compute", "tpus", "queued-resources", "create", name, f"--node-id={name}",
            f"--accelerator-type={s.accelerator_type}",
            f"--runtime-version={RUNTIME_VERSION[s.generation]}", *where] + (["--spot"] if spot else [])
  wait = ["bash", "-c", "until gcloud compute tpus queued-resources describe "
          f"{shlex.quote(name)} {' '.join(where)} --format='value(state.state)' | grep -qx ACTIVE; "
          "do sleep 30; done"]
  install = (f"git clone --depth=1 {shlex.quote(source)} reasoning_rl && cd reasoning_rl && "
             "python3 -m pip install -q -e . 'jax[tpu]'")
  start = ("cd reasoning_rl && nohup " + " ".join(shlex.quote(a) for a in train) +
           " > train.log 2>&1 &")

  def ssh(command, worker="all"):
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", name, *where, f"--worker={worker}",
            f"--command={command}"]

  return [create, wait, ssh(install), ssh(start), ssh("tail -f reasoning_rl/train.log", "0"),
          ["gcloud", "compute", "tpus", "queued-resources", "delete", name, *where, "--force",
           "--quiet"]]


def xpk_command(s: Slice, *, name, project, zone, cluster, image, train) -> list[str]:
  return ["xpk", "workload", "create", f"--workload={name}", f"--cluster={cluster}",
          f"--project={project}", f"--zone={zone}", f"--tpu-type={s.accelerator_type}",
          "--num-slices=1", f"--docker-image={image}",
          f"--command={' '.join(shlex.quote(a) for a in train)}"]


def jobset_manifest(s: Slice, *, name, image, train) -> dict:
  """One Job of `hosts` pods (one per TPU VM), all restarted together on failure / preemption."""
  container = {
      "name": "trainer", "image": image, "command": train,
      "resources": {"limits": {"google.com/tpu": s.chips // s.hosts}},
  }
  return {
      "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
      "metadata": {"name": name, "annotations": {
          "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}},
      "spec": {
          "failurePolicy": {"maxRestarts": 10},  # each restart resumes from the workdir
          "replicatedJobs": [{"name": "slice", "replicas": 1, "template": {"spec": {
              "parallelism": s.hosts, "completions": s.hosts, "backoffLimit": 0,
              "template": {"spec": {
                  "restartPolicy": "Never", "hostNetwork": True,
                  "dnsPolicy": "ClusterFirstWithHostNet",
                  "nodeSelector": {
                      "cloud.google.com/gke-tpu-accelerator": GKE_ACCELERATOR[s.generation],
                      "cloud.google.com/gke-tpu-topology": s.topology},
                  "containers": [container]}}}}}]}}


def define_flags() -> None:
  """The command-line flags (defined when run as a program, not on import)."""
  global _CONFIG, _MODE, _ACCELERATOR, _PROJECT, _ZONE, _NAME, _WORKDIR, _SOURCE, _SPOT, \
      _CLUSTER, _IMAGE, _EXTRA, _DRY_RUN  # pylint: disable=global-statement
  _CONFIG = flags.DEFINE_string("config", None, "Training config file (its target slice is used).")
  _MODE = flags.DEFINE_enum("mode", "tpu_vm", ["tpu_vm", "xpk", "jobset"], "What to generate.")
  _ACCELERATOR = flags.DEFINE_string("accelerator_type", None,
                                     "e.g. v5p-64; default: from the config's target slice.")
  _PROJECT = flags.DEFINE_string("project", "PROJECT", "Google Cloud project.")
  _ZONE = flags.DEFINE_string("zone", "ZONE", "Zone of the TPU slice.")
  _NAME = flags.DEFINE_string("name", "reasoning-rl", "Queued resource / TPU / workload name.")
  _WORKDIR = flags.DEFINE_string(
      "workdir", None, "The run's workdir: gs://BUCKET/run, or a path mounted on every host.")
  _SOURCE = flags.DEFINE_string("source", None, "git URL (or pip-installable archive URL) of the "
                                "project, installed on every worker (tpu_vm mode).")
  _SPOT = flags.DEFINE_bool("spot", False, "Spot capacity (preemptible; the run resumes).")
  _CLUSTER = flags.DEFINE_string("cluster", "CLUSTER", "GKE cluster (xpk mode).")
  _IMAGE = flags.DEFINE_string("image", "IMAGE", "Container image with the project (xpk / jobset).")
  _EXTRA = flags.DEFINE_multi_string("override", [], "Extra --config.a.b=v for the trainer.")
  _DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands instead of running them.")


def load_config(path: str):
  spec = importlib.util.spec_from_file_location("_config_file", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def main(argv) -> int:
  del argv
  import yaml  # pylint: disable=import-outside-toplevel

  config = load_config(_CONFIG.value)
  s = slice_for(_ACCELERATOR.value or accelerator_from_config(config))
  if config.target.num_devices and s.chips != config.target.num_devices:
    print(f"warning: {_CONFIG.value} plans for {config.target.num_devices} chips; "
          f"{s.accelerator_type} has {s.chips}", file=sys.stderr)
  workdir = _WORKDIR.value or config.workdir
  if not workdir:
    print("error: --workdir: give the run's workdir, gs://BUCKET/run (docs/storage.md) or a "
          "directory mounted on every host", file=sys.stderr)
    return 2
  train = train_command(_CONFIG.value, workdir, _EXTRA.value)
  if _MODE.value == "jobset":
    print(yaml.safe_dump(jobset_manifest(s, name=_NAME.value, image=_IMAGE.value, train=train),
                         sort_keys=False), end="")
    return 0
  if _MODE.value == "xpk":
    commands = [xpk_command(s, name=_NAME.value, project=_PROJECT.value, zone=_ZONE.value,
                            cluster=_CLUSTER.value, image=_IMAGE.value, train=train)]
  else:
    if not _SOURCE.value:
      raise SystemExit("error: --source: give the project's git URL (installed on every worker)")
    commands = tpu_vm_commands(s, name=_NAME.value, project=_PROJECT.value, zone=_ZONE.value,
                               source=_SOURCE.value, train=train, spot=_SPOT.value)
  print(f"# {s.accelerator_type}: {s.chips} chips on {s.hosts} hosts ({s.topology})")
  for command in commands:
    print(shlex.join(command))
    if not _DRY_RUN.value:
      subprocess.run(command, check=True)
  return 0


if __name__ == "__main__":
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  define_flags()
  flags.mark_flags_as_required(["config"])
  app.run(lambda argv: sys.exit(main(argv)))
