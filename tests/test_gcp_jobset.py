"""The JobSet manifest of launch/gcp/commands.py: accepted by the JobSet CRD's schema (v0.12.0,
vendored); restarted, not counted or failed by the controller's rules (tests/jobset_runner.py:
Kubernetes' podFailurePolicy messages, JobSet's rules and restart counts); its pods, started as
local processes with the variables GKE and JobSet inject, train debug_cpu as one run, save at
the step they reached when one pod is preempted and resume; and the node pools of
--mode=jobset_setup give those host-network pods write access to the bucket."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
import time

import jsonschema
import pytest

from launch.gcp import gke
from tests import jobset_runner
from tests.conftest import REPO
from tests.jobset_runner import PodEnd
from tests.multihost_runs import free_port_block, metrics_rows, wait_all, xla_flags
from tests.support.cloud import gcp, run_tool


def manifest(accelerator="v5p-64", workdir="gs://b/run", overrides=(), num_slices=1,
             max_restarts=5) -> dict:
  return gke.jobset_manifest(
      gcp.slice_for(accelerator), name="rl", image="img", max_restarts=max_restarts,
      grace_s=162, train=gcp.train_command("configs/debug_cpu.py", workdir, overrides),
      num_slices=num_slices)


@pytest.mark.parametrize("accelerator, num_slices", [
    ("v5p-64", 1), ("v6e-16", 1), ("v5litepod-8", 1), ("tpu7x-16", 1), ("v5p-16", 2),
    ("tpu7x-64", 4)])
def test_manifest_is_valid_against_the_jobset_crd(accelerator, num_slices):
  jobset_runner.validate(manifest(accelerator, num_slices=num_slices))


def test_multislice_manifest_replicates_the_slice_and_names_its_coordinator():
  jobset = manifest("v5p-16", num_slices=3)
  rjob = jobset["spec"]["replicatedJobs"][0]
  assert (rjob["replicas"], rjob["template"]["spec"]["parallelism"]) == (3, 2)
  assert jobset["spec"]["coordinator"] == {"replicatedJob": "slice", "jobIndex": 0, "podIndex": 0}
  env = rjob["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
  assert env == [
      {"name": "PYTHONPATH", "value": "/opt/reasoning_rl/src"},
      {"name": "MEGASCALE_NUM_SLICES", "value": "3"},
      {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {
          "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}},
      {"name": "MEGASCALE_COORDINATOR_ADDRESS", "valueFrom": {"fieldRef": {
          "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/coordinator']"}}}]
  one = manifest("v5p-16")
  assert "coordinator" not in one["spec"]
  assert [e["name"] for e in one["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
      "spec"]["containers"][0]["env"]] == ["PYTHONPATH"]


def test_validation_catches_a_wrong_value_and_a_misspelt_field():
  wrong_action = copy.deepcopy(manifest())
  wrong_action["spec"]["failurePolicy"]["rules"][0]["action"] = "FailJobs"
  with pytest.raises(jsonschema.ValidationError, match="FailJobs"):
    jobset_runner.validate(wrong_action)
  misspelt = copy.deepcopy(manifest())
  pod = misspelt["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  pod["terminationGracePeriod"] = pod.pop("terminationGracePeriodSeconds")
  with pytest.raises(ValueError, match=r"template\.spec\.terminationGracePeriod'"):
    jobset_runner.validate(misspelt)


IGNORE = "RestartJobSetAndIgnoreMaxRestarts"


@pytest.mark.parametrize("ends, decision", [
    ([0] * 8, "Completed"),
    ([143] * 8, IGNORE),  # preempted: every host saved and exited 143
    ([PodEnd(137, disrupted=True)] + [143] * 7, IGNORE),  # killed after its grace, disrupted
    ([PodEnd(0, disrupted=True)] + [0] * 7, IGNORE),  # evicted while ending
    ([5, 5, 5, 5, 5, 5, 5, 5], IGNORE),  # a host vanished: the others lost their peer
    ([1, 5, 5, 5, 5, 5, 5, 5], "RestartJobSet"),  # a crash on host 0 (counted)
    ([139] * 8, "RestartJobSet"),
    ([2] * 8, "FailJobSet"),  # bad config: a rerun fails the same way
    ([3] * 8, "FailJobSet"),  # a guard stopped the run
    ([4, 143, 143, 143, 143, 143, 143, 143], "FailJobSet"),  # storage failure on one host
    ([6, 5, 5, 5, 5, 5, 5, 5], "FailJobSet"),  # a crash repeated at the same step
])
def test_controller_restarts_and_counts_by_cause(ends, decision):
  assert jobset_runner.controller_decision(manifest(), ends) == decision


def test_preemptions_never_use_up_the_restarts():
  """maxRestarts=1: ten preemptions and lost hosts restart every time; the first crash restarts
  (counted), the second fails the JobSet."""
  controller = jobset_runner.Controller(manifest(max_restarts=1))
  for _ in range(5):
    assert controller.decide([PodEnd(143, disrupted=True)] + [143] * 7) == IGNORE
    assert controller.decide([5] * 8) == IGNORE
  assert controller.decide([1] + [5] * 7) == "RestartJobSet"
  assert controller.decide([1] + [5] * 7) == "FailJobSet"
  assert (controller.restarts, controller.counted) == (11, 1)


def test_the_kubernetes_messages_select_the_rules():
  """The JobSet rules tell the pod rules apart by the message Kubernetes writes for a FailJob
  rule; a wrong pattern would send a preemption to FailJobSet."""
  job = manifest()["spec"]["replicatedJobs"][0]["template"]["spec"]
  assert jobset_runner.pod_failure_message(job, PodEnd(143, disrupted=True, name="ns/p-0")) == (
      "FailJob", "Pod ns/p-0 has condition DisruptionTarget matching FailJob rule at index 0")
  assert jobset_runner.pod_failure_message(job, PodEnd(4, name="ns/p-1")) == (
      "FailJob", "Container trainer for pod ns/p-1 failed with exit code 4 matching FailJob rule "
      "at index 2")
  assert jobset_runner.pod_failure_message(job, PodEnd(1)) == ("Count", None)


def test_multislice_pods_get_the_processes_of_one_run():
  """2 slices of 2 hosts: each pod's environment (GKE's TPU_WORKER_*, the manifest's MEGASCALE_*
  read from the JobSet annotations) maps onto its own process of one 4-process run, numbered
  slice by slice, all with slice 0's first pod as coordinator (as JAX's cloud_tpu_cluster.py)."""
  from reasoning_rl.multihost.tpu_env import flags_from_tpu_environment

  jobset = manifest("v5p-16", num_slices=2)
  found = []
  for job_index, index in jobset_runner.pods(jobset):
    env = jobset_runner.pod_environment(jobset, job_index, index, port=9000)
    assert (env["MEGASCALE_SLICE_ID"], env["TPU_WORKER_ID"], env["TPU_WORKER_HOSTNAMES"]) == (
        str(job_index), str(index), "localhost,localhost")
    flags = flags_from_tpu_environment(env)
    found.append((flags.process_id, flags.num_processes, flags.coordinator_address))
  assert found == [(0, 4, "localhost:9000"), (1, 4, "localhost:9000"), (2, 4, "localhost:9000"),
                   (3, 4, "localhost:9000")]


def image_layout(tmp_path):
  """The image's /opt/reasoning_rl on this machine: the project and an environment."""
  image = tmp_path / "image"
  (image / "venv" / "bin").mkdir(parents=True)
  (image / "src").symlink_to(REPO)
  python = image / "venv" / "bin" / "python"
  python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
  python.chmod(0o755)
  return image


def checkpoint_steps(workdir) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_a_preempted_pod_saves_and_the_jobset_resumes_without_counting(tmp_path):
  """2 pods of a v5p-16 slice (2 hosts) run the container's command, unchanged but for the image
  root, with GKE's and JobSet's variables. Pod 0 is preempted as the kubelet does it (the pod
  gets DisruptionTarget, its container's first process SIGTERM): both trainers stop at the same
  step, save it and exit 143; the controller restarts the JobSet without counting
  (maxRestarts 0) and the second attempt resumes: each step once."""
  workdir = tmp_path / "run"
  total = 8
  jobset = manifest("v5p-16", str(workdir), [f"--config.total_steps={total}",
                                             "--config.checkpoint.every_steps=100",
                                             "--config.eval.num_examples=4",
                                             "--config.logging.rollouts_every_steps=0"],
                    max_restarts=0)
  jobset_runner.validate(jobset)
  image = image_layout(tmp_path)
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(2),
         "PYTHONUNBUFFERED": "1"}
  controller = jobset_runner.Controller(jobset)
  pods = jobset_runner.start_pods(jobset, image, gke.IMAGE_ROOT, env, free_port_block(4),
                                  tmp_path, attempt=0)
  deadline = time.monotonic() + 400
  while len(metrics_rows(workdir)) < 2:
    assert time.monotonic() < deadline and all(p.poll() is None for p in pods), "no step 2"
    time.sleep(0.2)
  pods[0].send_signal(15)  # the kubelet: SIGTERM to the disrupted pod's first process
  codes = wait_all(pods, timeout_s=300)
  for number in range(2):
    jobset_runner.end_pod(0, number)
  logs = [(tmp_path / f"pod0-{i}.log").read_text()[-2000:] for i in range(2)]
  assert codes == [143, 143], logs
  reached = [row["step"] for row in metrics_rows(workdir)][-1]
  assert checkpoint_steps(workdir) == [reached]  # saved at the step it reached, not a schedule
  assert controller.decide([PodEnd(143, disrupted=True), PodEnd(143)]) == IGNORE
  pods = jobset_runner.start_pods(jobset, image, gke.IMAGE_ROOT, env, free_port_block(4),
                                  tmp_path, attempt=1)
  codes = wait_all(pods, timeout_s=400)
  logs = [(tmp_path / f"pod1-{i}.log").read_text()[-2000:] for i in range(2)]
  assert codes == [0, 0], logs
  assert controller.decide(codes) == "Completed" and controller.counted == 0
  assert [row["step"] for row in metrics_rows(workdir)] == list(range(1, total + 1))


def fake_gcloud_env(tmp_path) -> dict:
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  shim = bin_dir / "gcloud"
  shim.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests' / 'fake_gcloud.py'} \"$@\"\n")
  shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
  return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
          "FAKE_GCLOUD_STATE": str(tmp_path / "cloud")}


def test_setup_gives_the_host_network_pods_write_access_to_the_bucket(tmp_path):
  """--mode=jobset_setup, run against the local gcloud: a node pool per slice whose nodes run as
  the given account with the storage-full scope, and that account's objectUser role on the
  workdir's bucket; the JobSet's pods (host network) act as the node, so they can write. A node
  pool made with GKE's defaults could not, whatever Kubernetes service account the pod names."""
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=jobset_setup", "--cluster=c",
                    "--project=p", "--zone=us-east5-a", "--workdir=gs://bkt/run", "--num_slices=2",
                    "--node_service_account=trainer@p.iam.gserviceaccount.com",
                    "--override=--config.model.path=gs://bkt/m", "--dry_run")
  assert result.returncode == 0, result.stderr
  env = fake_gcloud_env(tmp_path)
  ran = subprocess.run(["bash", "-c", result.stdout], env=env, capture_output=True, text=True,
                       timeout=120)
  assert ran.returncode == 0, ran.stderr
  pools = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "cloud" / "nodepools").iterdir()}
  assert sorted(pools) == ["reasoning-rl-slice-0", "reasoning-rl-slice-1"]
  assert {(p["machine_type"], p["tpu_topology"], p["num_nodes"]) for p in pools.values()} == {
      ("ct5p-hightpu-4t", "2x4x4", "8")}
  bindings = json.loads((tmp_path / "cloud" / "iam" / "bkt.json").read_text())
  jobset = manifest("v5p-64", "gs://bkt/run", num_slices=2)
  for pool in pools.values():
    assert jobset_runner.can_write(jobset_runner.pod_identity(jobset, pool), bindings)
  default_pool = {"service_account": "default", "scopes": ["gke-default"]}
  assert not jobset_runner.can_write(jobset_runner.pod_identity(jobset, default_pool), bindings)
