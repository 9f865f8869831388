"""The JobSet manifest of launch/gcp/commands.py: accepted by the JobSet CRD's schema (v0.12.0,
vendored), restarted / failed as the issue asks by the controller's rules, and its pods, started
as local processes with the variables GKE and JobSet inject, train debug_cpu as one run."""

from __future__ import annotations

import copy
import importlib.util
import sys

import jsonschema
import pytest

from tests import jobset_runner
from tests.conftest import REPO
from tests.multihost_runs import free_port_block, metrics_rows, wait_all

spec = importlib.util.spec_from_file_location("gcp_commands",
                                              REPO / "launch" / "gcp" / "commands.py")
gcp = importlib.util.module_from_spec(spec)
sys.modules["gcp_commands"] = gcp
spec.loader.exec_module(gcp)


def manifest(accelerator="v5p-64", workdir="gs://b/run", overrides=(), num_slices=1) -> dict:
  return gcp.jobset_manifest(
      gcp.slice_for(accelerator), name="rl", image="img", max_restarts=5, grace_s=162,
      train=gcp.train_command("configs/debug_cpu.py", workdir, overrides),
      service_account="trainer-ksa", num_slices=num_slices)


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
      {"name": "MEGASCALE_NUM_SLICES", "value": "3"},
      {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {
          "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}},
      {"name": "MEGASCALE_COORDINATOR_ADDRESS", "valueFrom": {"fieldRef": {
          "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/coordinator']"}}}]
  one = manifest("v5p-16")
  assert "coordinator" not in one["spec"]
  assert "env" not in one["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
      "containers"][0]


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


@pytest.mark.parametrize("exit_codes, decision", [
    ([0, 0, 0, 0, 0, 0, 0, 0], "Completed"),
    ([143] * 8, "RestartJobSet"),  # preempted: every host saved and exited 143
    ([5, 5, 5, 137, 5, 5, 5, 5], "RestartJobSet"),  # a host was lost, the others exit 5
    ([2] * 8, "FailJobSet"),  # bad config: a rerun fails the same way
    ([3, 3, 3, 3, 3, 3, 3, 3], "FailJobSet"),  # a guard stopped the run
    ([4, 143, 143, 143, 143, 143, 143, 143], "FailJobSet"),  # storage failure on one host
])
def test_controller_restarts_on_preemption_and_lost_peers_only(exit_codes, decision):
  assert jobset_runner.controller_decision(manifest(), exit_codes) == decision


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


@pytest.mark.slow
def test_pods_as_local_processes_train_one_run(tmp_path):
  """2 pods of a v5p-16 slice (2 hosts): the container's command, unchanged but for the image
  root, run with JOB_COMPLETION_INDEX / TPU_WORKER_ID / TPU_WORKER_HOSTNAMES / HOSTNAME."""
  workdir = tmp_path / "run"
  jobset = manifest("v5p-16", str(workdir), ["--config.total_steps=2"])
  jobset_runner.validate(jobset)
  image = tmp_path / "image"  # the image's /opt/reasoning_rl: the project and an environment
  (image / "venv" / "bin").mkdir(parents=True)
  (image / "src").symlink_to(REPO)
  python = image / "venv" / "bin" / "python"
  python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
  python.chmod(0o755)
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "PYTHONUNBUFFERED": "1"}
  pods = jobset_runner.start_pods(jobset, image, gcp.IMAGE_ROOT, env, free_port_block(4),
                                  tmp_path)
  codes = wait_all(pods, timeout_s=500)
  logs = [(tmp_path / f"pod{i}.log").read_text()[-2000:] for i in range(len(pods))]
  # two single-process runs on one workdir would collide on its lock: both exit 0 and one
  # metrics row per step only when the pods joined as one run
  assert codes == [0, 0], logs
  assert jobset_runner.controller_decision(jobset, codes) == "Completed"
  assert [row["step"] for row in metrics_rows(workdir)] == [1, 2]
