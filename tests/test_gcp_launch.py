"""launch/gcp/commands.py: the Cloud TPU / GKE commands generated from a config."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("gcp_commands", REPO / "launch" / "gcp" / "commands.py")
gcp = importlib.util.module_from_spec(spec)
sys.modules["gcp_commands"] = gcp  # dataclasses look their module up there
spec.loader.exec_module(gcp)


def run_tool(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "launch/gcp/commands.py", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("accelerator, chips, hosts, topology", [
    ("v5p-8", 4, 1, "2x2x1"), ("v5p-64", 32, 8, "2x4x4"), ("v5p-128", 64, 16, "4x4x4"),
    ("v4-32", 16, 4, "2x2x4")])
def test_slices_count_chips_and_hosts(accelerator, chips, hosts, topology):
  s = gcp.slice_for(accelerator)
  assert (s.chips, s.hosts, s.topology) == (chips, hosts, topology)


def test_unknown_accelerator_is_one_line():
  with pytest.raises(SystemExit, match="--accelerator_type=v9-8: known types are v5p-8"):
    gcp.slice_for("v9-8")


def test_tpu_vm_recipe_for_r1zero_targets_its_slice():
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=tpu_vm", "--project=p",
                    "--zone=us-east5-a", "--source=https://example.com/r.git",
                    "--workdir=/mnt/shared/run dir", "--spot", "--dry_run")
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert lines[0] == "# v5p-64: 32 chips on 8 hosts (2x4x4)"
  commands = [shlex.split(line) for line in lines[1:]]
  create, _, install, start, tail, delete = commands
  assert create[:5] == ["gcloud", "compute", "tpus", "queued-resources", "create"]
  assert "--accelerator-type=v5p-64" in create and "--runtime-version=v2-alpha-tpuv5" in create
  assert "--spot" in create and "--zone=us-east5-a" in create
  assert "--worker=all" in install and "--worker=all" in start and "--worker=0" in tail
  started = shlex.split(start[-1].split("=", 1)[1].replace(" > train.log 2>&1 &", ""))
  assert started[started.index("nohup") + 1:] == [
      "python3", "launch/train.py", "--config=configs/r1zero_tpu.py",
      "--config.workdir=/mnt/shared/run dir"]  # the space survives the quoting
  assert delete[3:5] == ["queued-resources", "delete"]


def test_xpk_command_carries_the_slice_and_the_trainer():
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=xpk", "--cluster=c", "--image=img",
                    "--workdir=/mnt/run", "--override=--config.total_steps=5", "--dry_run")
  assert result.returncode == 0, result.stderr
  command = shlex.split(result.stdout.splitlines()[1])
  assert command[:3] == ["xpk", "workload", "create"]
  assert {"--tpu-type=v5p-64", "--cluster=c", "--docker-image=img", "--num-slices=1"} <= set(command)
  trainer = shlex.split(next(a for a in command if a.startswith("--command=")).split("=", 1)[1])
  assert trainer[-1] == "--config.total_steps=5"


def test_jobset_manifest_has_one_pod_per_host():
  result = run_tool("--config=configs/r1zero_tpu.py", "--mode=jobset", "--image=img",
                    "--workdir=/mnt/run")
  assert result.returncode == 0, result.stderr
  manifest = yaml.safe_load(result.stdout)
  assert (manifest["apiVersion"], manifest["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
  assert job["parallelism"] == job["completions"] == 8
  pod = job["template"]["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                 "cloud.google.com/gke-tpu-topology": "2x4x4"}
  container = pod["containers"][0]
  assert container["resources"]["limits"]["google.com/tpu"] == 4
  assert container["command"][:2] == ["python3", "launch/train.py"]
  assert manifest["spec"]["failurePolicy"]["maxRestarts"] > 0
