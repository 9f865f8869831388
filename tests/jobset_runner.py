"""A local stand-in for what GKE and the JobSet controller do with the manifest of
`launch/gcp/commands.py --mode=jobset`: check it against the JobSet CRD's own schema, start one
local process per pod with the variables a TPU pod gets, and decide what the controller would do
when the pods end (the Job's podFailurePolicy, then the JobSet's failurePolicy rules).

A pod's variables: what GKE injects into a TPU pod of an Indexed Job (TPU_WORKER_ID, and
TPU_WORKER_HOSTNAMES: the hosts of its own Job, i.e. its slice), JOB_COMPLETION_INDEX, its
hostname, and the container's own `env` with `valueFrom.fieldRef` read from the annotations
JobSet puts on the pod (jobset.sigs.k8s.io/job-index: the slice; jobset.sigs.k8s.io/coordinator:
the coordinator pod's address, here "localhost" since every pod runs on this machine).

The CRD is vendored from kubernetes-sigs/jobset v0.12.0 (config/components/crd/bases/
jobset.x-k8s.io_jobsets.yaml at b16bcb1, gzipped) in tests/data/.
"""

from __future__ import annotations

import functools
import gzip
import os
import pathlib
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


def controller_decision(manifest: dict, exit_codes: list[int]) -> str:
  """What happens when the slice's pods end with `exit_codes`: "Completed", "RestartJobSet" or
  "FailJobSet". Kubernetes' podFailurePolicy: the first rule whose onExitCodes match a failed
  pod's container code applies (FailJob fails the Job with reason PodFailurePolicy); otherwise
  the failure counts against backoffLimit (0 here: the Job fails, reason BackoffLimitExceeded).
  JobSet: the first failurePolicy rule whose onJobFailureReasons hold the reason applies, else
  RestartJobSet (until maxRestarts)."""
  job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
  failed = [code for code in exit_codes if code != 0]
  if not failed:
    return "Completed"
  reason = "BackoffLimitExceeded"
  for code in failed:
    for rule in job.get("podFailurePolicy", {}).get("rules", []):
      codes = rule.get("onExitCodes")
      if codes and (code in codes["values"]) == (codes["operator"] == "In"):
        if rule["action"] == "FailJob":
          reason = "PodFailurePolicy"
        break
  for rule in manifest["spec"].get("failurePolicy", {}).get("rules", []):
    if reason in rule.get("onJobFailureReasons", [reason]):
      return rule["action"]
  return "RestartJobSet"


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
               log_dir: pathlib.Path) -> list[subprocess.Popen]:
  """One process per pod running the container's command, with `image_path` (the image's
  install root, e.g. /opt/reasoning_rl) mapped to `image_root` on this machine."""
  job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
  container = job["template"]["spec"]["containers"][0]
  command = [part.replace(image_path, str(image_root)) for part in container["command"]]
  workdir = container["workingDir"].replace(image_path, str(image_root))
  started = []
  for number, (job_index, index) in enumerate(pods(manifest)):
    log = open(log_dir / f"pod{number}.log", "wb")  # noqa: SIM115
    started.append(subprocess.Popen(
        command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, **env, **pod_environment(manifest, job_index, index, port)}))
  return started
