"""The commands that run a config on Google Cloud TPUs, generated from the config and a few flags.

  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=tpu_vm --project=P \
      --zone=us-east5-a --workdir=gs://BUCKET/run --source=https://github.com/U/reasoning_rl.git \
      --spot --dry_run > run_r1zero.sh          # the recipe; without --dry_run it runs
  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=down --project=P --zone=Z
  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=xpk --cluster=C ... --dry_run
  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=jobset --image=IMAGE \
      --workdir=gs://BUCKET/run > jobset.yaml
  python launch/gcp/commands.py --config=configs/r1zero_tpu.py --mode=jobset_setup --cluster=C \
      --node_service_account=SA@P.iam.gserviceaccount.com --workdir=gs://BUCKET/run > setup.sh

Every mode takes --num_slices=N (default: the config's target.num_slices, 1): N slices of the
accelerator type joined over the data-center network (TPU Multislice), one JAX process per host.
On every host the same `launch/train.py` command runs, under launch/gcp/supervise.py (signals
forwarded, exit codes mapped, the code pinned, repeated crashes stopped); on TPU JAX finds the
other hosts itself.

Modes:
- tpu_vm: a bash recipe that drives a queued resource to the end of the run, one driver per
  workdir, reconnecting instead of restarting, preemptions restarted without limit and crashes
  at most --max_restarts times (launch/gcp/tpu_vm.py); with --drive=workers the workers drive
  themselves from a boot script and the recipe only creates the queued resource.
- xpk: one `xpk workload create` (GKE, for users of xpk) with --num-slices, --max-restarts and the
  grace period; the image is --image (--docker-image), or xpk builds it from --base_image and the
  repository root (--base-docker-image + --script-dir=.) (launch/gcp/gke.py).
- jobset: a JobSet manifest (jobset.x-k8s.io/v1alpha2, JobSet >= v0.10.0) for GKE without xpk:
  one Job per slice, one pod per TPU host; preemptions, maintenance and lost hosts restart the
  slices without counting toward --max_restarts, crashes count, exit codes 2 / 3 / 4 / 6 end it.
- jobset_setup: the node pools the JobSet runs on, whose service account writes the workdir's
  bucket (pods on the host network use their node's identity, not Workload Identity).
- down: delete the tpu_vm queued resource.
TPU7x (Ironwood) runs on GKE only here: the Cloud TPU API behind queued resources does not serve it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import pathlib
import re
import shlex
import subprocess
import sys

from absl import app
from absl import flags

# the repository root, so that the script runs from a checkout without an install
REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from launch.gcp import gke, tpu_vm  # noqa: E402
# IMAGE_ROOT, XPK_SCRIPT_DIR: the image's paths, which the tests map onto this machine
from launch.gcp.gke import (IMAGE_ROOT, XPK_SCRIPT_DIR, jobset_manifest,  # noqa: E402,F401
                            xpk_command)
from launch.gcp.tpu_vm import down_command, slices_line  # noqa: E402
from reasoning_rl.errors import ExitCode  # noqa: E402  (light: no jax)
from reasoning_rl.tpu_chips import ACCELERATORS, SliceShape, slice_name, slice_shape  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
INSTALL_SCRIPT = HERE / "install_worker.sh"
LOCK_SCRIPT = HERE / "workdir_lock.py"


def slice_for(accelerator_type: str) -> SliceShape:
  shape = slice_shape(accelerator_type)
  if shape is None:
    raise SystemExit(f"error: --accelerator_type={accelerator_type}: known types are "
                     f"{', '.join(ACCELERATORS)}")
  return shape


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


def planned(config):
  """(plan, warnings) of the config's target as launched: the planner's lines a launch should
  not go without (a save that does not fit the notice, slices that buy no speed); (None, [])
  when the config names no target slice."""
  if not config.target.num_devices:
    return None, []
  from reasoning_rl import planning  # pylint: disable=import-outside-toplevel

  model = planning.dry_run_model_config(config)
  target = dict(config.target)
  plan = planning.plan(config, model, target=target)
  warnings = []
  notice = plan.assumptions.preemption_notice_s
  if plan.preemption.grace_s > notice:
    lost = plan.preemption.lost_s
    warnings.append(
        f"warning: a preemption needs ~{plan.preemption.grace_s:.0f} s (the train step and a "
        f"{plan.preemption.save_s:.0f} s save) and Spot gives {notice:.0f} s: a notice "
        "mid-step loses " + ("everything since the start" if math.isinf(lost) else
                            f"up to {lost / 60:.0f} min of work") +
        " (checkpoint.every_steps / checkpoint.every_minutes bound it; --config.dry_run=True "
        "prints the plan)")
  slices = planning.slices_warning(config, model, plan, target)
  if slices:
    warnings.append(slices)
  return plan, warnings


def grace_seconds(plan) -> int:
  """SIGTERM-to-kill seconds a host needs: the planner's grace (the longer of one decode call and
  the train step, plus the save; reasoning_rl/planning.py) and 30 s for start-up and exit; 60 s
  when the config names no target slice to plan for."""
  return 60 if plan is None else int(math.ceil(plan.preemption.grace_s)) + 30


def git(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["git", *args], capture_output=True, text=True, timeout=60, check=False)


def resolve_source(source: str, ref: str | None) -> tuple[str, str, str | None]:
  """(commit, archive sha256, error) pinning --source: a git URL's commit (--source_ref, or what
  its HEAD is now), an archive's digest; a directory is not pinned here (supervise.py's code
  record still refuses a resume on other code)."""
  path = pathlib.Path(source)
  if source.endswith((".tar.gz", ".tgz", ".zip")):
    if not path.is_file():
      return "", "", None  # a path on the workers: install_worker.sh checks it there
    return "", hashlib.sha256(path.read_bytes()).hexdigest(), None
  if path.is_dir():
    return "", "", None
  if ref and re.fullmatch(r"[0-9a-f]{40}", ref):
    return ref, "", None
  found = git("ls-remote", source, ref or "HEAD")
  commits = [line.split()[0] for line in found.stdout.splitlines() if line.strip()]
  if found.returncode != 0 or not commits:
    reason = (found.stderr.strip().splitlines() or ["no such ref"])[-1]
    return "", "", (f"--source={source}: could not resolve {ref or 'HEAD'} to a commit to pin "
                    f"(git ls-remote: {reason}); give --source_ref=COMMIT")
  return commits[0], "", None


def image_tag() -> str:
  """The commit of this checkout, with the digest of its code when it has uncommitted changes:
  the tag that says which code an image holds."""
  commit = git("-C", str(REPO), "rev-parse", "--short=12", "HEAD").stdout.strip()
  dirty = git("-C", str(REPO), "status", "--porcelain", "--untracked-files=no").stdout.strip()
  if commit and not dirty:
    return commit
  spec = importlib.util.spec_from_file_location("_supervise", HERE / "supervise.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  digest = module.code_identity(REPO)["digest"][:8]
  return f"{commit}-{digest}" if commit else f"code-{digest}"


def tagged(image: str) -> str:
  """`image` with this checkout's tag (`image_tag`) when it names none."""
  last = image.rsplit("/", 1)[-1]
  return image if ":" in last or "@" in last else f"{image}:{image_tag()}"


def image_build_line(image: str, *, base: bool = False) -> str:
  """How the image of the xpk / jobset modes is made: the Dockerfile at the repository root,
  for linux/amd64 (the TPU hosts' platform; a laptop on arm64 would build arm64 otherwise). As
  xpk's base (--base_image) the same image serves: xpk adds the repository to it."""
  line = (f"# the image, from the repository root: docker build --platform=linux/amd64 "
          f"-t {image} . && docker push {image}")
  if base:
    line += ("\n# xpk then builds the workload's image from it and the repository root (run xpk "
             "there: --script-dir=.)")
  return line


# ---------------------------------------------------------------------------------------------
# The program


def define_flags() -> None:
  """The command-line flags (defined when run as a program, not on import)."""
  global F  # pylint: disable=global-statement
  F = {
      "config": flags.DEFINE_string("config", None, "Training config file (its target slice is "
                                    "used)."),
      "mode": flags.DEFINE_enum("mode", "tpu_vm", ["tpu_vm", "down", "xpk", "jobset",
                                                   "jobset_setup"],
                                "What to generate (down: delete the tpu_vm queued resource)."),
      "accelerator_type": flags.DEFINE_string(
          "accelerator_type", None, "e.g. v5p-64; default: from the config's target slice."),
      "project": flags.DEFINE_string("project", "PROJECT", "Google Cloud project."),
      "zone": flags.DEFINE_string("zone", "ZONE", "Zone of the TPU slice."),
      "name": flags.DEFINE_string("name", "reasoning-rl", "Queued resource / TPU / workload name."),
      "workdir": flags.DEFINE_string(
          "workdir", None, "The run's workdir: gs://BUCKET/run, or a path mounted on every host."),
      "source": flags.DEFINE_string(
          "source", None, "git URL (or archive, or a directory the workers see) of the project, "
          "installed on every worker (tpu_vm mode); a git URL is pinned to one commit."),
      "source_ref": flags.DEFINE_string(
          "source_ref", None, "tpu_vm: the branch, tag or commit of a git --source to pin "
          "(default: its HEAD when the recipe is made)."),
      "drive": flags.DEFINE_enum(
          "drive", "here", ["here", "workers"], "tpu_vm: who drives the run: this machine (the "
          "recipe follows, reconnects, restarts), or the workers themselves (a boot script; "
          "logs in WORKDIR/logs/hosts/)."),
      "workdir_is_shared": flags.DEFINE_bool(
          "workdir_is_shared", False, "The local --workdir is mounted at the same path on every "
          "host (NFS, Filestore)."),
      "model_is_shared": flags.DEFINE_bool(
          "model_is_shared", False, "The config's local model.path exists on every host (a "
          "mount, or copied by you)."),
      "spot": flags.DEFINE_bool("spot", False, "Spot capacity (preemptible; the run resumes)."),
      "cluster": flags.DEFINE_string("cluster", "CLUSTER", "GKE cluster (xpk, jobset_setup)."),
      "image": flags.DEFINE_string(
          "image", None, "Container image with the project (xpk / jobset; see Dockerfile); "
          "without a tag it gets this checkout's commit. Default: IMAGE, a placeholder."),
      "base_image": flags.DEFINE_string(
          "base_image", None, "xpk mode: let xpk build the image, from this base (the "
          "Dockerfile's image) and the repository root (--base-docker-image + --script-dir=.), "
          "instead of --image."),
      "node_service_account": flags.DEFINE_string(
          "node_service_account", None, "jobset_setup: the Google service account the TPU nodes "
          "(and so the host-network pods) run as; it is given write access to the workdir's "
          "bucket."),
      # a string, so that a wrong value gets this tool's one-line error, not absl's usage text
      "num_slices": flags.DEFINE_string(
          "num_slices", None, "Slices of --accelerator_type joined over the data-center network "
          "(TPU Multislice), a whole number >= 1; default: the config's target.num_slices, else "
          "1."),
      "override": flags.DEFINE_multi_string("override", [], "Extra --config.a.b=v for the "
                                            "trainer."),
      "dry_run": flags.DEFINE_bool("dry_run", False, "Print the commands instead of running "
                                   "them."),
      "max_restarts": flags.DEFINE_integer(
          "max_restarts", 5, "Restarts after crashes before giving up (a crash repeated at the "
          "same step stops at once); preemptions and lost hosts do not count (tpu_vm, jobset; "
          "xpk counts every restart)."),
      "allow_code_change": flags.DEFINE_bool(
          "allow_code_change", False, "Resume a workdir whose run started on other code."),
      "grace_s": flags.DEFINE_integer(
          "grace_s", None, "SIGTERM-to-kill seconds for GKE pods; default: the planner's grace "
          "for the config's target + 30 s."),
  }


def value(name: str):
  return F[name].value


def load_config(path: str):
  spec = importlib.util.spec_from_file_location("_config_file", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def model_path(config, overrides) -> str:
  """The model.path the trainers will read: the last --override that sets it, else the config's."""
  given = [o.split("=", 1)[1] for o in overrides if o.startswith("--config.model.path=")]
  return given[-1] if given else config.model.path


def bad_input(message: str) -> int:
  print(f"error: {message}", file=sys.stderr)
  return ExitCode.BAD_INPUT


def check(config, mode: str, s: SliceShape, num_slices: int, workdir: str | None) -> str | None:
  """The first flag that cannot work, as its one-line error (None: all can)."""
  accelerator = s.accelerator_type
  if mode == "tpu_vm" and s.generation not in tpu_vm.RUNTIME_VERSION:
    return (f"--accelerator_type={accelerator}: the Cloud TPU API (queued resources) does not "
            "serve TPU7x (cloud.google.com/tpu/docs/runtimes); run it on GKE with --mode=xpk or "
            "--mode=jobset")
  if mode in ("xpk", "jobset", "jobset_setup") and num_slices > 1 and s.hosts == 1:
    return (f"--num_slices={num_slices}: GKE runs Multislice on multi-host slices only and "
            f"{accelerator} is one host (cloud.google.com/kubernetes-engine/docs/how-to/"
            "tpu-multislice); pick an --accelerator_type of several hosts")
  if mode == "xpk" and accelerator in gke.XPK_OTHER_LAYOUT:
    return (f"--accelerator_type={accelerator}: xpk runs it as 2 VMs of 4 chips while the plan "
            "and the other modes use one VM of 8; use --mode=jobset or --mode=tpu_vm, or a "
            "16-chip slice")
  if mode == "jobset_setup" and s.generation == "tpu7x" and s.hosts > 1:
    return (f"--accelerator_type={accelerator}: multi-host TPU7x node pools need a workload "
            "policy (GKE's Ironwood page) that this mode does not make; create them as that page "
            "says (or with xpk cluster create), then use --mode=jobset")
  if mode == "jobset_setup" and not value("node_service_account"):
    return ("--node_service_account: give the Google service account the TPU nodes run as "
            "(SA@PROJECT.iam.gserviceaccount.com); host-network pods use its access")
  base_image = value("base_image")
  if base_image is not None and (mode != "xpk" or value("image") is not None):
    return (f"--base_image={base_image}: only for --mode=xpk, instead of --image (xpk builds the "
            "image from the base); give one of them")
  hosts = num_slices * s.hosts
  where = slices_line(s, num_slices).split(": ", 1)[0]
  if not workdir:
    return ("--workdir: give the run's workdir, gs://BUCKET/run (docs/storage.md) or a "
            "directory mounted on every host")
  if hosts > 1 and "://" not in workdir and not value("workdir_is_shared"):
    return (f"--workdir={workdir}: a local path is not shared by the {hosts} hosts of {where}; "
            "give gs://BUCKET/run, or add --workdir_is_shared if every host mounts it at this "
            "path (NFS, Filestore)")
  model = model_path(config, value("override"))
  if hosts > 1 and model and "://" not in model and not value("model_is_shared"):
    name = pathlib.PurePath(model).name
    return (f"--config.model.path={model}: a local path the {hosts} hosts of {where} do not "
            f"have; upload it (gcloud storage cp -r {model} gs://BUCKET/models/{name}) and add "
            f"--override=--config.model.path=gs://BUCKET/models/{name}, or --model_is_shared if "
            "every host has it at this path")
  return None


def run_or_print(command: list[str]) -> int:
  print(shlex.join(command))
  return 0 if value("dry_run") else subprocess.run(command, check=False).returncode


def main(argv) -> int:
  del argv
  import yaml  # pylint: disable=import-outside-toplevel

  mode = value("mode")
  if mode == "down":
    return run_or_print(down_command(name=value("name"), project=value("project"),
                                     zone=value("zone")))
  if not value("config"):
    return bad_input("--config: give the training config file, e.g. configs/r1zero_tpu.py")
  config = load_config(value("config"))
  slices_given = value("num_slices") if value("num_slices") is not None else str(
      config.target.num_slices)
  num_slices = parse_num_slices(slices_given)
  if num_slices is None:
    return bad_input(f"--num_slices={slices_given}: give a whole number of slices, 1 or more "
                     "(e.g. --num_slices=2)")
  accelerator = value("accelerator_type") or accelerator_from_config(config)
  if accelerator not in ACCELERATORS:
    return bad_input(f"--accelerator_type={accelerator}: unknown; known types are "
                     f"{', '.join(ACCELERATORS)}")
  s = slice_for(accelerator)
  workdir = value("workdir") or config.workdir
  problem = check(config, mode, s, num_slices, workdir)
  if problem:
    return bad_input(problem)
  ref = sha256 = ""
  if mode == "tpu_vm":
    if not value("source"):
      return bad_input("--source: give the project's git URL (installed on every worker)")
    ref, sha256, problem = resolve_source(value("source"), value("source_ref"))
    if problem:
      return bad_input(problem)
  # after every check: bad input is one line, and these only say what differs from the plan
  if config.target.num_devices and s.devices != config.target.num_devices:
    print(f"warning: {value('config')} plans for {config.target.num_devices} devices per slice; "
          f"{s.accelerator_type} has {s.devices}", file=sys.stderr)
  if num_slices != config.target.num_slices:
    print(f"warning: {value('config')} plans for {config.target.num_slices} slice(s); "
          f"launching {num_slices}", file=sys.stderr)
  if config.target.num_devices:  # the plan and the grace period are for what is launched
    config.target.num_slices = num_slices
  plan, warnings = planned(config)
  for warning in warnings:
    print(warning, file=sys.stderr)
  train = train_command(value("config"), workdir, value("override"))
  grace = value("grace_s") or grace_seconds(plan)
  if mode == "jobset_setup":
    script = gke.jobset_setup_script(
        s, name=value("name"), project=value("project"), zone=value("zone"),
        cluster=value("cluster"), service_account=value("node_service_account"),
        workdir=workdir, num_slices=num_slices, spot=value("spot"))
    if value("dry_run"):
      print(script, end="")
      return 0
    return subprocess.run(["bash", "-c", script], check=False).returncode
  if mode == "jobset":
    image = tagged(value("image") or "IMAGE")
    print(image_build_line(image))
    print(yaml.safe_dump(jobset_manifest(
        s, name=value("name"), image=image, train=train, max_restarts=value("max_restarts"),
        grace_s=grace, num_slices=num_slices, allow_code_change=value("allow_code_change")),
        sort_keys=False), end="")
    return 0
  if mode == "xpk":
    base_image = value("base_image")
    image = None if base_image is not None else tagged(value("image") or "IMAGE")
    if base_image is not None:
      base_image = tagged(base_image)
    command = xpk_command(s, name=value("name"), project=value("project"), zone=value("zone"),
                          cluster=value("cluster"), image=image, base_image=base_image,
                          train=train, max_restarts=value("max_restarts"), grace_s=grace,
                          num_slices=num_slices, allow_code_change=value("allow_code_change"))
    print(f"# {slices_line(s, num_slices)}")
    print(shlex.join(command))
    print(image_build_line(base_image or image, base=base_image is not None))
    return 0 if value("dry_run") else subprocess.run(command, check=False).returncode
  if value("drive") == "workers":
    startup = tpu_vm.startup_script(
        source=value("source"), train=train, workdir=workdir, ref=ref, sha256=sha256,
        install_script_text=INSTALL_SCRIPT.read_text(), max_restarts=value("max_restarts"),
        allow_code_change=value("allow_code_change"))
    script = tpu_vm.self_driving_script(s, name=value("name"), project=value("project"),
                                        zone=value("zone"), workdir=workdir, startup=startup,
                                        spot=value("spot"), num_slices=num_slices)
  else:
    script = tpu_vm.tpu_vm_script(
        s, name=value("name"), project=value("project"), zone=value("zone"),
        source=value("source"), ref=ref, sha256=sha256, train=train, workdir=workdir,
        lock_python=sys.executable, lock_script=str(LOCK_SCRIPT),
        install_script=str(INSTALL_SCRIPT), spot=value("spot"),
        max_restarts=value("max_restarts"), num_slices=num_slices,
        allow_code_change=value("allow_code_change"))
  if value("dry_run"):
    print(script, end="")
    return 0
  return subprocess.run(["bash", "-c", script], check=False).returncode


if __name__ == "__main__":
  define_flags()
  app.run(lambda argv: sys.exit(main(argv)))
