"""GKE: the `xpk workload create` command, the JobSet manifest, and the node pools a JobSet needs
(launch/gcp/commands.py --mode=xpk | jobset | jobset_setup; docs/cloud_tpu.md).

Every container runs launch/train.py under launch/gcp/supervise.py, started with `exec` so that it
is the process the platform signals (xpk's one child, the container's first process): SIGTERM
reaches the trainer, which saves and exits 143.

Exit codes (supervise.py maps the trainer's): 0 done; 2 / 3 / 4 / 6 final (bad input, guard,
storage, a crash repeated at the same step); 143 / 5 a disruption (preemption, maintenance, a
lost host); anything else a crash, retried once.
"""

from __future__ import annotations

import shlex

from reasoning_rl.errors import ExitCode
from reasoning_rl.tpu_chips import SliceShape

IMAGE_ROOT = "/opt/reasoning_rl"  # the Dockerfile's install: IMAGE_ROOT/src, IMAGE_ROOT/venv
IMAGE_PYTHON = f"{IMAGE_ROOT}/venv/bin/python"
SUPERVISOR = "launch/gcp/supervise.py"
# xpk's own image build (`--base-docker-image=BASE --script-dir=DIR`) puts DIR's files (less what
# DIR/.dockerignore excludes) into /app of an image made FROM BASE, and /app is that image's
# working directory: google/xpk src/xpk/core/docker_image.py (xpk 1.16.0, AI-Hypercomputer/xpk at
# 367c838), the Dockerfile it writes ("WORKDIR /app", "COPY . .") or crane's "--workdir /app".
# The container then runs our command from that copy with the base image's environment.
XPK_SCRIPT_DIR = "/app"

FINAL_ON_GKE = [int(c) for c in (ExitCode.BAD_INPUT, ExitCode.GUARD, ExitCode.STORAGE,
                                 ExitCode.CRASH_REPEATED)]
DISRUPTED = [int(ExitCode.PREEMPTED), int(ExitCode.LOST_PEER)]

# GKE node labels cloud.google.com/gke-tpu-accelerator (google/xpk system_characteristics.py, its
# gke_accelerator field: 'tpu7x' for TPU7x; cloud.google.com/kubernetes-engine/docs/concepts/tpus)
GKE_ACCELERATOR = {"v5p": "tpu-v5p-slice", "v4": "tpu-v4-podslice",
                   "v5litepod": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice", "tpu7x": "tpu7x"}
# GKE machine types by chips per VM (cloud.google.com/kubernetes-engine/docs/concepts/tpus; the
# same names in google/xpk's system_characteristics.py)
MACHINE_TYPE = {"v5p": "ct5p-hightpu-{}t", "v4": "ct4p-hightpu-{}t",
                "v5litepod": "ct5lp-hightpu-{}t", "v6e": "ct6e-standard-{}t",
                "tpu7x": "tpu7x-standard-{}t"}
# xpk lays out these types on VMs of 4 chips (its system characteristics: v6e-8 = 2 x
# ct6e-standard-4t), where Cloud TPU and our plan use one VM of 8
XPK_OTHER_LAYOUT = {"v5litepod-8", "v6e-8"}


def supervised(train: list[str], *, python: str, flags=()) -> list[str]:
  """`train` ([python, launch/train.py, args...]) under the supervisor."""
  return [python, SUPERVISOR, *flags, "--", *train[1:]]


def xpk_shell_command(train: list[str], *, project_dir: str = f"{IMAGE_ROOT}/src",
                      allow_code_change: bool = False) -> str:
  """xpk's `--command`: a line of shell that xpk runs in a subshell as its one background child.
  `exec` makes the supervisor that child (the pid xpk signals). xpk restarts a workload only on
  143 (and 42, 127-255 at 1.16.0): the supervisor reports a lost peer and a first crash as 143,
  a repeated crash as 6, which fails it."""
  flags = ["--lost_peer_as_preempted", "--crash_as_preempted"]
  flags += ["--allow_code_change"] if allow_code_change else []
  run = shlex.join(supervised(train, python=IMAGE_PYTHON, flags=flags))
  return f"cd {project_dir} && export PYTHONPATH={project_dir} && exec {run}"


def xpk_command(s: SliceShape, *, name, project, zone, cluster, image=None, base_image=None,
                train, max_restarts=5, grace_s=60, num_slices=1,
                allow_code_change=False) -> list[str]:
  """`xpk workload create` for `num_slices` slices of `s`. With `image` xpk runs that image
  (--docker-image, our Dockerfile's); with `base_image` xpk builds one itself from it and the
  current directory, the repository root (--base-docker-image + --script-dir=.), and the
  trainer runs from xpk's copy (XPK_SCRIPT_DIR). One container per VM (the project runs one
  process per VM; xpk's TPU7x default at some versions is two)."""
  if (image is None) == (base_image is None):
    raise ValueError("give exactly one of image and base_image")
  if image is not None:
    source = [f"--docker-image={image}"]
    command = xpk_shell_command(train, allow_code_change=allow_code_change)
  else:
    source = [f"--base-docker-image={base_image}", "--script-dir=."]
    command = xpk_shell_command(train, project_dir=XPK_SCRIPT_DIR,
                                allow_code_change=allow_code_change)
  return ["xpk", "workload", "create", f"--workload={name}", f"--cluster={cluster}",
          f"--project={project}", f"--zone={zone}", f"--tpu-type={s.accelerator_type}",
          f"--num-slices={num_slices}", *source, f"--max-restarts={max_restarts}",
          f"--termination-grace-period-seconds={grace_s}", "--no-use-parallel-containers",
          f"--command={command}"]


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


def failure_rules(max_restarts: int) -> tuple[dict, dict]:
  """(the Job's podFailurePolicy, the JobSet's failurePolicy). A Job fails on its first failed
  pod (backoffLimit 0); why it failed decides what the JobSet does:

  pod rule 0  DisruptionTarget condition (preemption, eviction, maintenance, node lost)  \\
  pod rule 1  exit 143 / 5 (preempted and saved; a lost peer)                           / restart
              without counting toward maxRestarts (RestartJobSetAndIgnoreMaxRestarts)
  pod rule 2  exit 2 / 3 / 4 / 6: the JobSet fails (a rerun would end the same way)
  any other failure (a crash): the default RestartJobSet, counted toward maxRestarts.

  Kubernetes reports a FailJob rule as reason PodFailurePolicy with the message "... matching
  FailJob rule at index N" (pkg/controller/job/pod_failure_policy.go); JobSet >= v0.10.0 matches
  that message (onJobFailureMessagePatterns) to tell the rules apart."""
  pods = {"rules": [
      {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
      {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                            "values": DISRUPTED}},
      {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                            "values": FINAL_ON_GKE}}]}
  jobset = {"maxRestarts": max_restarts, "rules": [
      {"name": "disruptionsDoNotCount", "action": "RestartJobSetAndIgnoreMaxRestarts",
       "onJobFailureReasons": ["PodFailurePolicy"],
       "onJobFailureMessagePatterns": ["matching FailJob rule at index [01]$"]},
      {"name": "stopOnBadInputGuardStorageOrRepeatedCrash", "action": "FailJobSet",
       "onJobFailureReasons": ["PodFailurePolicy"],
       "onJobFailureMessagePatterns": ["matching FailJob rule at index 2$"]}]}
  return pods, jobset


def jobset_manifest(s: SliceShape, *, name, image, train, max_restarts=5, grace_s=60,
                    num_slices=1, allow_code_change=False) -> dict:
  """`num_slices` Jobs (replicas of the replicated job "slice"), each of `hosts` pods (one per TPU
  VM), restarted as `failure_rules` says. Pods use the host network (as GKE's and JobSet's TPU
  Multislice examples and xpk do), so they run as their node's service account (Workload Identity
  does not apply to hostNetwork pods): `jobset_setup` makes node pools whose service account may
  write the workdir's bucket. Each slice gets its own node pool (the exclusive-topology
  annotation: one Job per node pool)."""
  flags = ["--allow_code_change"] if allow_code_change else []
  container = {
      "name": "trainer", "image": image, "workingDir": f"{IMAGE_ROOT}/src",
      "command": supervised(train, python=IMAGE_PYTHON, flags=flags),
      "env": [{"name": "PYTHONPATH", "value": f"{IMAGE_ROOT}/src"}],
      "resources": {"limits": {"google.com/tpu": s.chips // s.hosts}},
  }
  if num_slices > 1:
    container["env"] += multislice_environment(num_slices)
  pod = {
      "restartPolicy": "Never", "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
      "terminationGracePeriodSeconds": grace_s,
      "nodeSelector": {
          "cloud.google.com/gke-tpu-accelerator": GKE_ACCELERATOR[s.generation],
          "cloud.google.com/gke-tpu-topology": s.topology},
      "containers": [container]}
  pod_failure_policy, failure_policy = failure_rules(max_restarts)
  spec = {
      "failurePolicy": failure_policy,
      "replicatedJobs": [{"name": "slice", "replicas": num_slices, "template": {"spec": {
          "parallelism": s.hosts, "completions": s.hosts, "backoffLimit": 0,
          "completionMode": "Indexed", "podFailurePolicy": pod_failure_policy,
          "template": {"spec": pod}}}}]}
  if num_slices > 1:  # the pod whose hostname becomes MEGASCALE_COORDINATOR_ADDRESS
    spec = {"coordinator": {"replicatedJob": "slice", "jobIndex": 0, "podIndex": 0}, **spec}
  return {
      "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
      "metadata": {"name": name, "annotations": {
          "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}},
      "spec": spec}


STORAGE_SCOPES = "storage-full,gke-default"  # what xpk gives its TPU node pools


def bucket_of(workdir: str) -> str | None:
  return workdir.split("/")[2] if workdir.startswith("gs://") else None


def jobset_setup_script(s: SliceShape, *, name, project, zone, cluster, service_account,
                        workdir, num_slices=1, spot=False) -> str:
  """A bash script making what the JobSet needs besides the cluster: one TPU node pool per slice
  (GKE's TPU node pools: machine type by chips per VM, --tpu-topology on multi-host slices,
  TPU7x's workload policy aside) whose nodes run as `service_account` with the storage-full
  scope, and that account's write access to the workdir's bucket. Pods on the host network use
  the node's identity: this is their access to the bucket."""
  machine = MACHINE_TYPE[s.generation].format(s.chips // s.hosts)
  where = f"--project={shlex.quote(project)} --location={shlex.quote(zone)}"
  topology = f" --tpu-topology={s.topology}" if s.hosts > 1 else ""
  lines = ["#!/usr/bin/env bash",
           f"# node pools and bucket access for the JobSet {name} "
           "(launch/gcp/commands.py --mode=jobset_setup)",
           "set -euo pipefail"]
  for index in range(num_slices):
    lines.append(
        f"gcloud container node-pools create {shlex.quote(f'{name}-slice-{index}')} "
        f"--cluster={shlex.quote(cluster)} {where} --node-locations={shlex.quote(zone)} "
        f"--machine-type={machine}{topology} --num-nodes={s.hosts} "
        f"--service-account={shlex.quote(service_account)} --scopes={STORAGE_SCOPES}"
        + (" --spot" if spot else ""))
  bucket = bucket_of(workdir)
  if bucket:
    lines.append(
        f"gcloud storage buckets add-iam-policy-binding gs://{bucket} "
        f"--member=serviceAccount:{shlex.quote(service_account)} --role=roles/storage.objectUser")
  return "\n".join(lines) + "\n"
