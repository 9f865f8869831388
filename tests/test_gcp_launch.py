"""launch/gcp/commands.py: the Cloud TPU / GKE commands generated from a config."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("gcp_commands",
                                              REPO / "launch" / "gcp" / "commands.py")
gcp = importlib.util.module_from_spec(spec)
sys.modules["gcp_commands"] = gcp  # dataclasses look their module up there
spec.loader.exec_module(gcp)


def run_tool(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "launch/gcp/commands.py", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120)


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


def test_v6e_recipe_uses_its_runtime_image():
  script = gcp.tpu_vm_script(gcp.slice_for("v6e-32"), name="n", project="p", zone="z",
                             source="src", train=gcp.train_command("c.py", "gs://b/r"))
  assert "--accelerator-type=v6e-32 \\\n      --runtime-version=v2-alpha-tpuv6e" in script


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
    (["--workdir=gs://b/run", "--mode=jobset", "--base_image=b"],
     "error: --base_image=b: only for --mode=xpk, instead of --image"),
    (["--workdir=gs://b/run", "--image=i", "--base_image=b"],
     "error: --base_image=b: only for --mode=xpk, instead of --image"),
    (["--workdir=/mnt/run", "--accelerator_type=v5p-8", "--num_slices=2", "--mode=tpu_vm"],
     "error: --workdir=/mnt/run: a local path is not shared by the 2 hosts of 2 x v5p-8")])
def test_bad_input_is_one_line_and_exit_2_before_any_command(flags, message):
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=xpk", *flags)
  assert result.returncode == 2, result.stderr
  assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
  assert result.stdout == ""


def test_tpu_vm_recipe_for_r1zero_targets_its_slice():
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=tpu_vm", "--project=p",
                    "--zone=us-east5-a", "--source=https://example.com/r.git",
                    "--workdir=/mnt/shared/run dir", "--workdir_is_shared", "--model_is_shared",
                    "--spot", "--dry_run")
  assert result.returncode == 0, result.stderr
  script = result.stdout
  assert script.splitlines()[1].startswith("# v5p-64: 32 chips on 8 hosts (2x4x4)")
  assert ("--accelerator-type=v5p-64 \\\n      --runtime-version=v2-alpha-tpuv5 "
          "--project=p --zone=us-east5-a --spot") in script
  assert "trap 'down' EXIT" in script and "MAX_RESTARTS=5" in script
  assert "--command='bash install_worker.sh https://example.com/r.git'" in script
  start = next(line for line in script.splitlines() if line.startswith("start()"))
  inner = shlex.split(shlex.split(start)[-2].split("=", 1)[1])  # the worker's command
  run = shlex.split(inner[inner.index("-c") + 1])
  assert run[:4] == ["$HOME/reasoning_rl/venv/bin/python", "launch/train.py",
                     "--config=configs/r1zero_tpu.py", "--config.workdir=/mnt/shared/run dir"]
  subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_multislice_recipe_asks_for_one_queued_resource_of_n_nodes():
  s = gcp.slice_for("v5p-16")
  script = gcp.tpu_vm_script(s, name="rl", project="p", zone="z", source="https://e/r.git",
                             train=gcp.train_command("c.py", "gs://b/r"), num_slices=3)
  assert script.splitlines()[1] == ("# 3 x v5p-16: 24 chips on 6 hosts, 3 slices of 8 chips on 2 "
                                    "hosts (2x2x2); generated by")
  assert ('queued-resources create "$NAME" --node-count=3 --node-prefix="$NAME" '
          "--accelerator-type=v5p-16 \\\n      --runtime-version=v2-alpha-tpuv5 --project=p "
          "--zone=z\n") in script
  lines = {line.split("()")[0]: line for line in script.splitlines() if "() {" in line}
  for step in ("start", "follow", "exit_code"):
    assert 'gcloud compute tpus queued-resources ssh "$NAME" --project=p --zone=z' in lines[step]
  assert "--node=all --worker=all --command=" in lines["start"]
  assert "--node=0 --worker=0 --command=" in lines["follow"]
  assert ('gcloud compute tpus queued-resources scp ' in script
          and '"$NAME":install_worker.sh --project=p --zone=z --node=all --worker=all' in script)
  assert "tpu-vm ssh" not in script and "--node-id" not in script
  subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_one_slice_recipe_names_its_node_as_before():
  script = gcp.tpu_vm_script(gcp.slice_for("v5p-16"), name="rl", project="p", zone="z",
                             source="s", train=gcp.train_command("c.py", "gs://b/r"))
  assert 'create "$NAME" --node-id="$NAME" --accelerator-type=v5p-16' in script
  assert 'gcloud compute tpus tpu-vm ssh "$NAME" --project=p --zone=z --worker=all' in script
  assert "--node=all" not in script and "--node-count" not in script


def test_down_deletes_the_queued_resource():
  result = run_tool("--mode=down", "--project=p", "--zone=z", "--name=n", "--dry_run")
  assert result.returncode == 0, result.stderr
  assert shlex.split(result.stdout) == ["gcloud", "compute", "tpus", "queued-resources", "delete",
                                        "n", "--project=p", "--zone=z", "--force", "--quiet"]


def test_xpk_command_carries_the_slice_restarts_and_the_trainer():
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=xpk", "--cluster=c", "--image=img",
                    "--workdir=gs://b/run", "--override=--config.model.path=gs://b/models/q",
                    "--override=--config.total_steps=5", "--dry_run")
  assert result.returncode == 0, result.stderr
  command = shlex.split(result.stdout.splitlines()[1])
  assert command[:3] == ["xpk", "workload", "create"]
  assert {"--tpu-type=v5p-64", "--cluster=c", "--docker-image=img", "--num-slices=1",
          "--max-restarts=5"} <= set(command)
  # the planner's grace for r1zero (~132 s: the train step and the save) plus 30 s
  grace = int(next(a for a in command if a.startswith("--termination-grace-period-seconds="))
              .split("=")[1])
  assert 150 <= grace <= 200, grace
  script = shlex.split(next(a for a in command if a.startswith("--command=")).split("=", 1)[1])
  assert script[:2] == ["bash", "-c"]
  assert "--config.total_steps=5; code=$?;" in script[2]
  assert "if [ $code = 5 ]" in script[2] and "exit 143" in script[2]
  assert result.stdout.splitlines()[2] == ("# the image, from the repository root: "
                                           "docker build -t img . && docker push img")


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
  script = shlex.split(next(a for a in command if a.startswith("--command=")).split("=", 1)[1])
  assert script[2].startswith("cd /app && export PYTHONPATH=/app && "
                              "/opt/reasoning_rl/venv/bin/python launch/train.py ")
  assert lines[2] == ("# the image, from the repository root: docker build -t "
                      "us-docker.pkg.dev/p/r/base:1 . && docker push us-docker.pkg.dev/p/r/base:1")


def test_lost_peer_is_reported_to_xpk_as_preemption(tmp_path):
  """xpk restarts only on 143 (without --restart-on-user-code-failure): the container command
  turns 5 into 143 and keeps 2 / 3 / 4."""
  for code, expected in ((5, 143), (2, 2), (3, 3), (0, 0), (143, 143)):
    fake = tmp_path / "fake_python"
    fake.write_text(f"#!/bin/sh\nexit {code}\n")
    fake.chmod(0o755)
    command = gcp.container_command([str(fake), "x"], lost_peer_as_preempted=True)
    command[2] = command[2].replace(f"cd {gcp.IMAGE_ROOT}/src && ", "").replace(
        f"{gcp.IMAGE_ROOT}/venv/bin/python", str(fake))
    assert command[2].startswith(f"export PYTHONPATH={gcp.IMAGE_ROOT}/src && {fake} x;")
    assert subprocess.run(command, capture_output=True).returncode == expected, code


def test_jobset_manifest_restarts_on_preemption_not_on_config_errors():
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=jobset", "--image=img",
                    "--workdir=gs://b/run", "--service_account=trainer-ksa", "--model_is_shared")
  assert result.returncode == 0, result.stderr
  manifest = yaml.safe_load(result.stdout)
  assert (manifest["apiVersion"], manifest["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
  assert job["parallelism"] == job["completions"] == 8
  assert job["backoffLimit"] == 0  # any pod failure fails the Job: the JobSet restarts all
  assert job["podFailurePolicy"]["rules"] == [{"action": "FailJob", "onExitCodes": {
      "containerName": "trainer", "operator": "In", "values": [2, 3, 4]}}]
  assert manifest["spec"]["failurePolicy"] == {"maxRestarts": 5, "rules": [
      {"name": "stopOnConfigGuardOrStorage", "action": "FailJobSet",
       "onJobFailureReasons": ["PodFailurePolicy"]}]}
  pod = job["template"]["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                 "cloud.google.com/gke-tpu-topology": "2x4x4"}
  assert pod["serviceAccountName"] == "trainer-ksa"
  assert 150 <= pod["terminationGracePeriodSeconds"] <= 200
  container = pod["containers"][0]
  assert container["resources"]["limits"]["google.com/tpu"] == 4
  assert container["workingDir"] == "/opt/reasoning_rl/src"
  run = shlex.split(container["command"][2].split(" && exec ")[1])
  assert run[:3] == ["/opt/reasoning_rl/venv/bin/python", "launch/train.py",
                     "--config=configs/r1zero_tpu.py"]


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
