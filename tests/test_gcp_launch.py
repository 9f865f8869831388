"""launch/gcp/commands.py: the Cloud TPU / GKE commands generated from a config."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
import yaml

from launch.gcp import tpu_vm
from reasoning_rl.tpu_chips import ACCELERATORS
from tests.conftest import REPO
from tests.support.cloud import gcp, run_tool


@pytest.mark.parametrize("accelerator, chips, hosts, topology", [
    ("v5p-8", 4, 1, "2x2x1"), ("v5p-64", 32, 8, "2x4x4"), ("v5p-128", 64, 16, "4x4x4"),
    ("v4-32", 16, 4, "2x2x4"), ("v6e-8", 8, 1, "2x4"), ("v6e-16", 16, 4, "4x4"),
    ("v6e-256", 256, 64, "16x16"), ("v5litepod-4", 4, 1, "2x2"), ("v5litepod-32", 32, 8, "4x8"),
    ("tpu7x-2", 1, 1, "1x1x1"), ("tpu7x-8", 4, 1, "2x2x1"), ("tpu7x-16", 8, 2, "2x2x2"),
    ("tpu7x-64", 32, 8, "2x4x4"), ("tpu7x-512", 256, 64, "4x8x8")])
def test_slices_count_chips_and_hosts(accelerator, chips, hosts, topology):
  s = gcp.slice_for(accelerator)
  assert (s.chips, s.hosts, s.topology) == (chips, hosts, topology)


def test_a_tpu7x_chip_is_two_jax_devices():
  assert (gcp.slice_for("tpu7x-16").devices, gcp.slice_for("v5p-16").devices,
          gcp.slice_for("v6e-16").devices) == (16, 8, 16)


@pytest.mark.parametrize("tpu, devices, accelerator", [
    ("v5p", 32, "v5p-64"), ("v4", 16, "v4-32"), ("v5e", 16, "v5litepod-16"), ("v6e", 64, "v6e-64"),
    ("v7x", 16, "tpu7x-16"), ("v7x", 128, "tpu7x-128")])
def test_config_target_names_its_accelerator_type(tpu, devices, accelerator):
  import ml_collections

  config = ml_collections.ConfigDict({"target": {"tpu": tpu, "num_devices": devices}})
  assert gcp.accelerator_from_config(config) == accelerator


def recipe(s, **kw) -> str:
  """A driving tpu_vm recipe with placeholder paths for the launching machine's files."""
  args = dict(name="rl", project="p", zone="z", source="https://e/r.git",
              train=gcp.train_command("c.py", "gs://b/r"), workdir="gs://b/r",
              lock_python="python3", lock_script="/x/workdir_lock.py",
              install_script="/x/install_worker.sh")
  return tpu_vm.tpu_vm_script(s, **{**args, **kw})


def test_v6e_recipe_uses_its_runtime_image():
  assert ("--accelerator-type=v6e-32 \\\n      --runtime-version=v2-alpha-tpuv6e" in
          recipe(gcp.slice_for("v6e-32")))


@pytest.mark.parametrize("accelerator,pods,label,topology", [
    ("v6e-32", 8, "tpu-v6e-slice", "4x8"),
    ("tpu7x-32", 4, "tpu7x", "2x2x4"),
])
def test_manifest_uses_the_node_label_and_four_chips_per_pod(accelerator, pods, label, topology):
  manifest = gcp.jobset_manifest(gcp.slice_for(accelerator), name="n", image="i",
                                 train=gcp.train_command("c.py", "gs://b"))
  job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
  pod = job["template"]["spec"]
  assert job["parallelism"] == pods and pod["containers"][0]["resources"]["limits"] == {
      "google.com/tpu": 4}
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": label,
                                 "cloud.google.com/gke-tpu-topology": topology}


def test_unknown_accelerator_is_one_line():
  with pytest.raises(SystemExit, match="--accelerator_type=v9-8: known types are v5p-8"):
    gcp.slice_for("v9-8")


@pytest.mark.parametrize("flags, message", [
    (["--accelerator_type=v9-8", "--workdir=gs://b/run"],
     "error: --accelerator_type=v9-8: unknown; known types are v5p-8"),
    (["--workdir=/mnt/run"], "error: --workdir=/mnt/run: a local path is not shared by the 8 "
     "hosts of v5p-64; give gs://BUCKET/run, or add --workdir_is_shared"),
    (["--workdir=gs://b/run", "--model_is_shared", "--mode=tpu_vm"],
     "error: --source: give the project's git URL"),
    (["--workdir=gs://b/run"], "error: --config.model.path=/mnt/models/Qwen2.5-7B: a local path "
     "the 8 hosts of v5p-64 do not have; upload it (gcloud storage cp -r /mnt/models/Qwen2.5-7B "
     "gs://BUCKET/models/Qwen2.5-7B) and add "
     "--override=--config.model.path=gs://BUCKET/models/Qwen2.5-7B"),
    (["--workdir=gs://b/run", "--num_slices=0"],
     "error: --num_slices=0: give a whole number of slices, 1 or more (e.g. --num_slices=2)"),
    (["--workdir=gs://b/run", "--num_slices=two"], "error: --num_slices=two: give a whole number"),
    (["--workdir=gs://b/run", "--num_slices=1.5"], "error: --num_slices=1.5: give a whole number"),
    (["--workdir=gs://b/run", "--num_slices=-2"], "error: --num_slices=-2: give a whole number"),
    (["--workdir=gs://b/run", "--accelerator_type=v5p-8", "--num_slices=2"],
     "error: --num_slices=2: GKE runs Multislice on multi-host slices only and v5p-8 is one host"),
    (["--workdir=gs://b/run", "--accelerator_type=tpu7x-16", "--mode=tpu_vm", "--source=s"],
     "error: --accelerator_type=tpu7x-16: the Cloud TPU API (queued resources) does not serve "
     "TPU7x (cloud.google.com/tpu/docs/runtimes); run it on GKE with --mode=xpk or --mode=jobset"),
    (["--workdir=gs://b/run", "--accelerator_type=v6e-8"],
     "error: --accelerator_type=v6e-8: xpk runs it as 2 VMs of 4 chips while the plan and the "
     "other modes use one VM of 8"),
    (["--workdir=gs://b/run", "--mode=jobset_setup"],
     "error: --node_service_account: give the Google service account the TPU nodes run as"),
    (["--workdir=gs://b/run", "--mode=jobset_setup", "--accelerator_type=tpu7x-16",
      "--node_service_account=a@p.iam.gserviceaccount.com"],
     "error: --accelerator_type=tpu7x-16: multi-host TPU7x node pools need a workload policy"),
    (["--workdir=gs://b/run", "--mode=jobset", "--base_image=b"],
     "error: --base_image=b: only for --mode=xpk, instead of --image"),
    (["--workdir=gs://b/run", "--image=i", "--base_image=b"],
     "error: --base_image=b: only for --mode=xpk, instead of --image"),
    (["--workdir=/mnt/run", "--accelerator_type=v5p-8", "--num_slices=2", "--mode=tpu_vm"],
     "error: --workdir=/mnt/run: a local path is not shared by the 2 hosts of 2 x v5p-8"),
    (["--workdir=gs://b/run", "--model_is_shared", "--mode=tpu_vm",
      "--source=/nonexistent/repo.git"],
     "error: --source=/nonexistent/repo.git: could not resolve HEAD to a commit to pin")])
def test_bad_input_is_one_line_and_exit_2_before_any_command(flags, message):
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=xpk", *flags)
  assert result.returncode == 2, result.stderr
  assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
  assert result.stdout == ""


def test_multislice_recipe_asks_for_one_queued_resource_of_n_nodes():
  script = recipe(gcp.slice_for("v5p-16"), num_slices=3)
  assert script.splitlines()[1] == ("# 3 x v5p-16: 24 chips on 6 hosts, 3 slices of 8 chips on 2 "
                                    "hosts (2x2x2); generated by launch/gcp/commands.py.")
  assert ('queued-resources create "$NAME" --node-count=3 --node-prefix="$NAME" '
          "--accelerator-type=v5p-16 \\\n      --runtime-version=v2-alpha-tpuv5 --project=p "
          "--zone=z\n") in script
  assert "tpu-vm ssh" not in script and "--node-id" not in script
  subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_one_slice_recipe_names_its_node():
  script = recipe(gcp.slice_for("v5p-16"))
  assert 'create "$NAME" --node-id="$NAME" --accelerator-type=v5p-16' in script
  assert 'gcloud compute tpus tpu-vm ssh "$NAME" --project=p --zone=z --worker=all' in script
  assert "--node=all" not in script and "--node-count" not in script


def test_down_deletes_the_queued_resource():
  result = run_tool("--mode=down", "--project=p", "--zone=z", "--name=n", "--dry_run")
  assert result.returncode == 0, result.stderr
  assert shlex.split(result.stdout) == ["gcloud", "compute", "tpus", "queued-resources", "delete",
                                        "n", "--project=p", "--zone=z", "--force", "--quiet"]


def test_a_git_source_is_pinned_to_the_commit_it_had(tmp_path):
  """The recipe installs the commit --source's HEAD had when it was made, on every (re)install."""
  origin = tmp_path / "origin"
  subprocess.run(["git", "init", "-q", str(origin)], check=True)
  subprocess.run(["git", "-C", str(origin), "-c", "user.name=t", "-c", "user.email=t@t", "commit",
                  "-q", "--allow-empty", "-m", "a"], check=True)
  head = subprocess.run(["git", "-C", str(origin), "rev-parse", "HEAD"], capture_output=True,
                        text=True, check=True).stdout.strip()
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=tpu_vm", f"--source=file://{origin}",
                    "--workdir=gs://b/run", "--model_is_shared", "--dry_run")
  assert result.returncode == 0, result.stderr
  assert f"REASONING_RL_REF={head} bash install_worker.sh file://{origin}" in result.stdout


def test_the_printed_image_build_targets_the_tpu_hosts_and_tags_the_code(tmp_path):
  """The build line, run with a stand-in docker: linux/amd64, and the image the manifest runs is
  the one it builds, tagged with this checkout's commit (and code digest when it has changes)."""
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=jobset", "--image=reg/rl",
                    "--workdir=gs://b/run", "--model_is_shared")
  assert result.returncode == 0, result.stderr
  build = result.stdout.splitlines()[0]
  assert build.startswith("# the image, from the repository root: ")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  docker = bin_dir / "docker"
  docker.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/docker_calls\n")
  docker.chmod(0o755)
  ran = subprocess.run(["bash", "-c", build.split(": ", 1)[1]], cwd=REPO, capture_output=True,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, text=True)
  assert ran.returncode == 0, ran.stderr
  built, pushed = (tmp_path / "docker_calls").read_text().splitlines()
  image = yaml.safe_load(result.stdout)["spec"]["replicatedJobs"][0]["template"]["spec"][
      "template"]["spec"]["containers"][0]["image"]
  commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
  assert image.startswith(f"reg/rl:{commit}") and image == f"reg/rl:{gcp.image_tag()}"
  assert built == f"build --platform=linux/amd64 -t {image} ." and pushed == f"push {image}"
  given = run_tool("--config=configs/r1zero_tpu.py", "--mode=jobset", "--image=reg/rl:v1",
                   "--workdir=gs://b/run", "--model_is_shared")
  assert "-t reg/rl:v1 ." in given.stdout.splitlines()[0]  # a tag given is kept


def test_xpk_command_carries_the_slice_restarts_and_the_trainer():
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=xpk", "--cluster=c", "--image=img:1",
                    "--workdir=gs://b/run", "--override=--config.model.path=gs://b/models/q",
                    "--override=--config.total_steps=5", "--dry_run")
  assert result.returncode == 0, result.stderr
  command = shlex.split(result.stdout.splitlines()[1])
  assert command[:3] == ["xpk", "workload", "create"]
  assert {"--tpu-type=v5p-64", "--cluster=c", "--docker-image=img:1", "--num-slices=1",
          "--max-restarts=5", "--no-use-parallel-containers"} <= set(command)
  # the planner's grace for r1zero (~132 s: the train step and the save) plus 30 s
  grace = int(next(a for a in command if a.startswith("--termination-grace-period-seconds="))
              .split("=")[1])
  assert 150 <= grace <= 200, grace
  line = next(a for a in command if a.startswith("--command=")).split("=", 1)[1]
  assert line.startswith("cd /opt/reasoning_rl/src && export PYTHONPATH=/opt/reasoning_rl/src && "
                         "exec /opt/reasoning_rl/venv/bin/python launch/gcp/supervise.py "
                         "--lost_peer_as_preempted --crash_as_preempted -- launch/train.py ")
  assert line.endswith("--config.total_steps=5")
  assert "warning: a preemption needs ~132 s" in result.stderr


def test_xpk_multislice_and_xpk_built_image():
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=xpk", "--cluster=c",
                    "--base_image=us-docker.pkg.dev/p/r/base:1", "--num_slices=4",
                    "--workdir=gs://b/run", "--override=--config.model.path=gs://b/models/q",
                    "--dry_run")
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert lines[0] == ("# 4 x v5p-64: 128 chips on 32 hosts, 4 slices of 32 chips on 8 hosts "
                      "(2x4x4)")
  command = shlex.split(lines[1])
  assert {"--num-slices=4", "--base-docker-image=us-docker.pkg.dev/p/r/base:1",
          "--script-dir=."} <= set(command)
  assert not any(a.startswith("--docker-image=") for a in command)
  line = next(a for a in command if a.startswith("--command=")).split("=", 1)[1]
  assert line.startswith("cd /app && export PYTHONPATH=/app && exec /opt/reasoning_rl/venv/bin/"
                         "python launch/gcp/supervise.py ")
  assert lines[2] == ("# the image, from the repository root: docker build --platform=linux/amd64 "
                      "-t us-docker.pkg.dev/p/r/base:1 . && docker push "
                      "us-docker.pkg.dev/p/r/base:1")
  # 4 slices plan the step of one: the extra slices are named a cost without speed
  assert "warning: 4 slices cost 4x one slice" in result.stderr


def test_jobset_manifest_restarts_on_preemption_not_on_config_errors():
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=jobset", "--image=img:1",
                    "--workdir=gs://b/run", "--model_is_shared")
  assert result.returncode == 0, result.stderr
  manifest = yaml.safe_load(result.stdout)
  assert (manifest["apiVersion"], manifest["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
  assert job["parallelism"] == job["completions"] == 8
  assert job["backoffLimit"] == 0  # any pod failure fails the Job: the JobSet restarts all
  assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 5
  pod = job["template"]["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                 "cloud.google.com/gke-tpu-topology": "2x4x4"}
  assert pod["hostNetwork"] and "serviceAccountName" not in pod  # the node's identity
  assert 150 <= pod["terminationGracePeriodSeconds"] <= 200
  container = pod["containers"][0]
  assert container["resources"]["limits"]["google.com/tpu"] == 4
  assert container["workingDir"] == "/opt/reasoning_rl/src"
  assert container["command"][:6] == ["/opt/reasoning_rl/venv/bin/python",
                                      "launch/gcp/supervise.py", "--", "launch/train.py",
                                      "--config=configs/r1zero_tpu.py",
                                      "--config.workdir=gs://b/run"]


@pytest.mark.parametrize("accelerator", sorted(ACCELERATORS))
def test_the_plan_runs_one_process_per_host_the_launchers_start(accelerator):
  """One source of chips per host: the planner's processes for a slice are the launchers' VMs
  (tpu_chips.ACCELERATORS), v5e / v6e multi-host slices as VMs of 4 chips."""
  from reasoning_rl import memory_plan, planning

  s = gcp.slice_for(accelerator)
  tpu = {"v5litepod": "v5e", "tpu7x": "v7x"}.get(s.generation, s.generation)
  assert planning.slice_name(tpu, s.devices) == accelerator
  chip, devices = memory_plan._chip({"tpu": tpu, "num_devices": s.devices})
  processes = devices // (chip.devices_per_host or devices)
  assert processes == s.hosts, (accelerator, processes, s.hosts)


def test_r1zero_on_v6e_plans_the_vms_it_launches_on():
  result = subprocess.run([sys.executable, "launch/train.py", "--config=configs/r1zero_tpu.py",
                           "--config.dry_run=True", "--config.target.tpu=v6e",
                           "--config.target.num_devices=32"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert "Target: 32 x TPU v6e = v6e-32 on 8 hosts of 4" in result.stdout, result.stderr[-2000:]
  launched = run_tool("--config=configs/r1zero_tpu.py", "--mode=tpu_vm",
                      "--accelerator_type=v6e-32", "--source=/tmp", "--workdir=gs://b/r",
                      "--model_is_shared", "--dry_run")
  assert launched.returncode == 0, launched.stderr
  assert launched.stdout.splitlines()[1].startswith("# v6e-32: 32 chips on 8 hosts (4x8)")


def test_tpu_host_variables_map_onto_the_coordinator_flags():
  from reasoning_rl.multihost.tpu_env import flags_from_tpu_environment

  flags = flags_from_tpu_environment({"TPU_WORKER_HOSTNAMES": "h0,h1,h2",
                                      "TPU_WORKER_ID": "2"})
  assert (flags.coordinator_address, flags.num_processes, flags.process_id,
          flags.transfer_address) == ("h0:8482", 3, 2, "h2:8485")
  flags.check()
  port = flags_from_tpu_environment({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0",
                                     "JAX_COORDINATOR_PORT": "9000"})
  assert port.coordinator_address == "a:9000" and port.process_id == 0
  assert not flags_from_tpu_environment({"TPU_WORKER_HOSTNAMES": "a", "TPU_WORKER_ID": "0"}).given
  assert not flags_from_tpu_environment({}).given
