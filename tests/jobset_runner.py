"""A local stand-in for what GKE and the JobSet controller do with the manifest of
`launch/gcp/commands.py --mode=jobset`: check it against the JobSet CRD's own schema, start one
local process per pod with the variables a TPU pod gets, and decide what the controller would do
when the pods end (the Job's podFailurePolicy, then the JobSet's failurePolicy rules, with the
Job failure messages Kubernetes writes and the restarts counted toward maxRestarts or not).

A pod's variables: what GKE injects into a TPU pod of an Indexed Job (TPU_WORKER_ID, and
TPU_WORKER_HOSTNAMES: the hosts of its own Job, i.e. its slice), JOB_COMPLETION_INDEX, its
hostname, and the container's own `env` with `valueFrom.fieldRef` read from the annotations
JobSet puts on the pod (jobset.sigs.k8s.io/job-index: the slice; jobset.sigs.k8s.io/coordinator:
the coordinator pod's address, here "localhost" since every pod runs on this machine).

The CRD is vendored from kubernetes-sigs/jobset v0.12.0 (config/components/crd/bases/
jobset.x-k8s.io_jobsets.yaml at b16bcb1, gzipped) in tests/data/.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import os
import pathlib
import re
import subprocess

import yaml

DATA = pathlib.Path(__file__).resolve().parent / "data"
CRD = DATA / "jobset_v0.12.0_crd.yaml.gz"


@functools.cache
def jobset_schema(version: str = "v1alpha2") -> dict:
  loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser: 800 kB of YAML
  crd = yaml.load(gzip.decompress(CRD.read_bytes()), Loader=loader)  # noqa: S506
  entry = next(v for v in crd["spec"]["versions"] if v["name"] == version)
  return entry["schema"]["openAPIV3Schema"]


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
  """Fields the schema does not declare. The API server prunes those silently (structural
  schemas), so a misspelt field would be lost without an error; jsonschema alone accepts them."""
  found = []
  if isinstance(value, dict) and "properties" in schema and not (
      schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("additionalProperties")):
    for key, item in value.items():
      if key not in schema["properties"]:
        found.append(f"{path}.{key}")
      else:
        found += unknown_fields(item, schema["properties"][key], f"{path}.{key}")
  elif isinstance(value, list) and "items" in schema:
    for index, item in enumerate(value):
      found += unknown_fields(item, schema["items"], f"{path}[{index}]")
  return found


def validate(manifest: dict) -> None:
  """Raises jsonschema.ValidationError (types, enums, required fields) or ValueError (unknown
  fields) where the API server would refuse or drop part of the manifest."""
  import jsonschema  # pylint: disable=import-outside-toplevel

  schema = jobset_schema(manifest["apiVersion"].split("/")[1])
  jsonschema.validate(manifest, schema)
  unknown = unknown_fields(manifest, schema)
  if unknown:
    raise ValueError(f"fields the JobSet CRD does not declare: {unknown}")


@dataclasses.dataclass(frozen=True)
class PodEnd:
  """How a pod ended: its container's exit code and its conditions (DisruptionTarget: the pod was
  preempted, evicted, or its node shut down or lost; GKE sets it)."""

  exit_code: int
  disrupted: bool = False
  container: str = "trainer"
  name: str = "default/pod"


def pod_failure_message(job: dict, pod: PodEnd) -> tuple[str, str | None]:
  """Kubernetes' podFailurePolicy for one failed pod (pkg/controller/job/pod_failure_policy.go):
  rules in order, an onExitCodes rule matching the container's nonzero code (containerName, In /
  NotIn), an onPodConditions rule matching a condition's type and status. Returns (action, the
  Job's failure message for FailJob), ("Count", None) when no rule matches."""
  conditions = [("DisruptionTarget", "True")] if pod.disrupted else []
  for index, rule in enumerate(job.get("podFailurePolicy", {}).get("rules", [])):
    codes = rule.get("onExitCodes")
    if codes:
      named = codes.get("containerName") in (None, pod.container)
      matched = named and pod.exit_code != 0 and (
          (pod.exit_code in codes["values"]) == (codes["operator"] == "In"))
      if matched:
        message = (f"Container {pod.container} for pod {pod.name} failed with exit code "
                   f"{pod.exit_code} matching {rule['action']} rule at index {index}")
        return rule["action"], message if rule["action"] == "FailJob" else None
    elif rule.get("onPodConditions"):
      for pattern in rule["onPodConditions"]:
        if (pattern["type"], pattern.get("status", "True")) in conditions:
          message = (f"Pod {pod.name} has condition {pattern['type']} matching {rule['action']} "
                     f"rule at index {index}")
          return rule["action"], message if rule["action"] == "FailJob" else None
  return "Count", None


def job_failure(manifest: dict, pods: list[PodEnd]) -> tuple[str, str] | None:
  """(reason, message) of the Job's failure, from its first failed pod (backoffLimit 0: one
  counted failure fails it), or None when every pod succeeded."""
  job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
  for pod in pods:
    if pod.exit_code == 0 and not pod.disrupted:
      continue
    action, message = pod_failure_message(job, pod)
    if action == "FailJob":
      return "PodFailurePolicy", message
    if action == "Count" and job.get("backoffLimit", 6) == 0:
      return "BackoffLimitExceeded", "Job has reached the specified backoff limit"
  return None


class Controller:
  """The JobSet controller's failure policy over the attempts of one JobSet: the first rule of
  spec.failurePolicy.rules whose onJobFailureReasons (empty: any) hold the Job's reason and whose
  onJobFailureMessagePatterns (regular expressions, searched; empty: any) match its message
  applies, else RestartJobSet; RestartJobSet fails the JobSet once the restarts counted toward
  maxRestarts reached it, RestartJobSetAndIgnoreMaxRestarts never counts."""

  def __init__(self, manifest: dict):
    self.manifest = manifest
    self.restarts = 0
    self.counted = 0

  def decide(self, ends) -> str:
    """"Completed", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts" or "FailJobSet" for an
    attempt whose pods ended as `ends` (PodEnd, or bare exit codes), in the order the Job
    controller sees them."""
    pods = [e if isinstance(e, PodEnd) else PodEnd(int(e)) for e in ends]
    failure = job_failure(self.manifest, pods)
    if failure is None:
      return "Completed"
    reason, message = failure
    policy = self.manifest["spec"].get("failurePolicy", {})
    action = "RestartJobSet"
    for rule in policy.get("rules", []):
      reasons = rule.get("onJobFailureReasons") or [reason]
      patterns = rule.get("onJobFailureMessagePatterns") or []
      if reason in reasons and (not patterns or any(re.search(p, message) for p in patterns)):
        action = rule["action"]
        break
    if action == "RestartJobSet":
      if self.counted >= policy.get("maxRestarts", 0):
        return "FailJobSet"
      self.counted += 1
    if action.startswith("RestartJobSet"):
      self.restarts += 1
    return action


def controller_decision(manifest: dict, ends) -> str:
  """One attempt's decision by a fresh controller (no restart counted yet)."""
  return Controller(manifest).decide(ends)


JOB_INDEX = "jobset.sigs.k8s.io/job-index"
COORDINATOR = "jobset.sigs.k8s.io/coordinator"


def pod_annotations(manifest: dict, job_index: int) -> dict:
  """The JobSet annotations of a pod of Job `job_index` that the container's env may read."""
  annotations = {JOB_INDEX: str(job_index)}
  if "coordinator" in manifest["spec"]:
    annotations[COORDINATOR] = "localhost"  # <jobset>-<rjob>-<job>-<pod>.<jobset> on GKE
  return annotations


def container_environment(container: dict, annotations: dict) -> dict:
  """The container's `env`: plain values, and fieldRefs to metadata.annotations['KEY']."""
  env = {}
  for item in container.get("env", []):
    if "value" in item:
      env[item["name"]] = item["value"]
      continue
    path = item["valueFrom"]["fieldRef"]["fieldPath"]
    prefix = "metadata.annotations['"
    if not (path.startswith(prefix) and path.endswith("']")):
      raise ValueError(f"{item['name']}: the stand-in reads only pod annotations, not {path}")
    env[item["name"]] = annotations[path[len(prefix):-2]]
  return env


def pod_environment(manifest: dict, job_index: int, index: int, port: int) -> dict:
  """What GKE / JobSet set in pod `index` of Job `job_index` (the slice) of the replicated job:
  its completion index, the TPU worker id, the hostnames of its slice's workers (all this machine
  here), its hostname, and the container's env."""
  name = manifest["metadata"]["name"]
  rjob = manifest["spec"]["replicatedJobs"][0]
  job = rjob["template"]["spec"]
  container = job["template"]["spec"]["containers"][0]
  return {"JOB_COMPLETION_INDEX": str(index), "TPU_WORKER_ID": str(index),
          "TPU_WORKER_HOSTNAMES": ",".join(["localhost"] * job["parallelism"]),
          "HOSTNAME": f"{name}-{rjob['name']}-{job_index}-{index}",
          "JAX_COORDINATOR_PORT": str(port),
          **container_environment(container, pod_annotations(manifest, job_index))}


def pods(manifest: dict) -> list[tuple[int, int]]:
  """(job index, completion index) of every pod, slice by slice."""
  rjob = manifest["spec"]["replicatedJobs"][0]
  hosts = rjob["template"]["spec"]["parallelism"]
  return [(job_index, index) for job_index in range(rjob["replicas"]) for index in range(hosts)]


def start_pods(manifest: dict, image_root: pathlib.Path, image_path: str, env: dict, port: int,
               log_dir: pathlib.Path, attempt: int = 0) -> list[subprocess.Popen]:
  """One process per pod running the container's command as its first process (the one the
  kubelet signals), with `image_path` (the image's install root, e.g. /opt/reasoning_rl) mapped
  to `image_root` on this machine in the command, the working directory and the variables. Every
  process a pod starts carries POD_MARK=<attempt>-<pod> (`end_pod` finds them by it)."""
  job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
  container = job["template"]["spec"]["containers"][0]
  local = lambda text: text.replace(image_path, str(image_root))  # noqa: E731
  command = [local(part) for part in container["command"]]
  workdir = local(container["workingDir"])
  started = []
  for number, (job_index, index) in enumerate(pods(manifest)):
    log = open(log_dir / f"pod{attempt}-{number}.log", "wb")  # noqa: SIM115
    variables = {k: local(v) for k, v in pod_environment(manifest, job_index, index, port).items()}
    started.append(subprocess.Popen(
        command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, **env, **variables, "POD_MARK": f"{attempt}-{number}"}))
  return started


def end_pod(attempt: int, number: int) -> None:
  """A container's end: every process of the pod still there is killed."""
  from tests.xpk_container import kill_marked  # pylint: disable=import-outside-toplevel

  kill_marked("POD_MARK", f"{attempt}-{number}")


# Who a pod is to Google APIs. GKE's Workload Identity page, "Restrictions": pods on the host
# network (hostNetwork: true) do not use Workload Identity Federation for GKE; their requests go to
# the Compute Engine metadata server, i.e. they act as the node's service account with the node
# pool's OAuth scopes. The default scopes (gke-default) hold devstorage.read_only.
WRITE_SCOPES = {"storage-full", "storage-rw", "cloud-platform",
                "https://www.googleapis.com/auth/devstorage.full_control",
                "https://www.googleapis.com/auth/devstorage.read_write",
                "https://www.googleapis.com/auth/cloud-platform"}
WRITE_ROLES = {"roles/storage.objectUser", "roles/storage.objectAdmin", "roles/storage.admin"}


def pod_identity(manifest: dict, node_pool: dict) -> tuple[str, list[str]]:
  """(service account, scopes) the trainer's storage requests carry on a node of `node_pool`
  (tests/fake_gcloud.py's record of `gcloud container node-pools create`)."""
  pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  if not pod.get("hostNetwork"):
    raise NotImplementedError("Workload Identity (pods off the host network) is not modelled")
  return node_pool["service_account"], node_pool["scopes"]


def can_write(identity: tuple[str, list[str]], bindings: list[dict]) -> bool:
  """Whether Cloud Storage lets `identity` write a bucket with these IAM `bindings`: a scope that
  allows writes and a role that does, for serviceAccount:<account>."""
  account, scopes = identity
  return bool(WRITE_SCOPES & set(scopes)) and any(
      b["member"] == f"serviceAccount:{account}" and b["role"] in WRITE_ROLES for b in bindings)
