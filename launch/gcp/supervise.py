"""The trainer as every cloud launcher runs it: signals reach it, its exit code means one thing to
every launcher, the code a run started with is the code it resumes with, and a crash that repeats
is not retried.

  python launch/gcp/supervise.py [--lost_peer_as_preempted] [--crash_as_preempted]
      [--allow_code_change] [--log=FILE] -- launch/train.py --config=C --config.workdir=W ...

Why a wrapper at all: xpk's container script starts the workload's command as its one background
child, sends SIGTERM to that child only, and ends the container (every other process with it) once
the child exits (google/xpk src/xpk/core/docker_container.py). A `bash -c '...; code=$?; ...'` in
between dies of that SIGTERM and the trainer never hears of it. The launchers `exec` this program
instead, so it is the process that gets the signal (xpk's child, a GKE container's first process,
the pid a TPU VM worker recorded); it forwards SIGTERM / SIGINT to the trainer and waits for it,
so the preemption's checkpoint is written and 143 is what the launcher sees.

The trainer runs as a child (this Python, `launch/train.py` and what follows `--`) in a session of
its own: a signal sent to this program's process group (a terminal's Ctrl-C) reaches it once,
from here, never twice (the trainer's second SIGINT means "stop without saving").

Around the trainer:
1. Pinned code. WORKDIR/launcher/code.json holds the digest of the code the run started with
   (each .py file under reasoning_rl/ and configs/, launch/*.py, setup.cfg) and its git commit
   where the project is a git checkout. A start on other code stops with one line and exit 2
   before the trainer runs, unless --allow_code_change, which records the new code.
2. Exit codes (docs/cloud_tpu.md, "Exit codes under the launchers"): 0, 2, 3, 4, 130 and 143 pass
   through. 5 (a lost peer) becomes 143 with --lost_peer_as_preempted (an xpk workload restarts on
   143). Any other code is a crash, recorded in WORKDIR/launcher/crash-pN.json (N: this process's
   index in the run) with the last step of metrics.jsonl: a crash at the same step as this
   process's previous one becomes 6 (CRASH_REPEATED: every launcher stops on it); a first one
   passes through, or becomes 143 with --crash_as_preempted (xpk). After a forwarded signal the
   trainer's code passes through as it is.
3. --log=FILE: this program's and the trainer's output are appended to FILE and copied to
   WORKDIR/logs/hosts/<FILE's name> every REASONING_RL_LOG_COPY_S seconds (default 30) and at the
   end (TPU VM workers that drive themselves: their logs are in the workdir).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

# the repository root, so that the wrapper runs from a checkout without an install
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from reasoning_rl.errors import ExitCode  # noqa: E402  (light: no jax)

PASSED_THROUGH = frozenset(int(code) for code in (
    ExitCode.DONE, ExitCode.BAD_INPUT, ExitCode.GUARD, ExitCode.STORAGE, ExitCode.INTERRUPTED,
    ExitCode.PREEMPTED, ExitCode.CRASH_REPEATED))
CODE_FILES = ("reasoning_rl/**/*.py", "configs/**/*.py", "launch/*.py", "setup.cfg")
RECORDS = "launcher"  # WORKDIR/launcher/: code.json, crash-pN.json


def say(message: str) -> None:
  print(f"supervise.py: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the trainer's command line


def option(train: list[str], name: str) -> str | None:
  """The last `--NAME=value` of the trainer's arguments (absl lets a later one win)."""
  values = [a.split("=", 1)[1] for a in train if a.startswith(f"--{name}=")]
  return values[-1] if values else None


def process_index(train: list[str], environ=os.environ) -> int:
  """This process's index in the run: --process_id, else what the TPU host's variables imply
  (reasoning_rl/multihost/tpu_env.py), else 0."""
  given = option(train, "process_id")
  if given is not None and given.isdigit():
    return int(given)
  from reasoning_rl.multihost.tpu_env import flags_from_tpu_environment  # noqa: PLC0415

  try:
    flags = flags_from_tpu_environment(environ)
  except ValueError:
    return 0
  return flags.process_id or 0


# ---------------------------------------------------------------------------------------------
# records in the workdir


def records_dir(workdir: str):
  from reasoning_rl import storage  # noqa: PLC0415  (gcsfs only when a record is read)

  return storage.path(workdir) / RECORDS


def read_record(path) -> dict | None:
  return json.loads(path.read_text()) if path.exists() else None


def write_record(path, record: dict) -> None:
  from reasoning_rl import storage  # noqa: PLC0415

  if not storage.is_remote(path):
    path.parent.mkdir(parents=True, exist_ok=True)
  storage.atomic_write(path, json.dumps(record, sort_keys=True) + "\n")


def code_identity(project: pathlib.Path) -> dict:
  """{"digest": sha256 of the code's files (path and bytes, in path order), "commit": the git
  commit of `project`, or "" where it is not a git checkout (an image, an unpacked archive)}."""
  digest = hashlib.sha256()
  files = sorted({p for pattern in CODE_FILES for p in project.glob(pattern) if p.is_file()
                  and "__pycache__" not in p.parts})
  for file in files:
    digest.update(file.relative_to(project).as_posix().encode() + b"\0")
    digest.update(file.read_bytes() + b"\0")
  commit = ""
  if (project / ".git").exists():
    found = subprocess.run(["git", "-C", str(project), "rev-parse", "HEAD"], capture_output=True,
                           text=True, timeout=30, check=False)
    commit = found.stdout.strip() if found.returncode == 0 else ""
  return {"digest": digest.hexdigest(), "commit": commit}


def describe(identity: dict) -> str:
  commit = f", commit {identity['commit'][:12]}" if identity.get("commit") else ""
  return f"code {identity['digest'][:12]}{commit}"


def pin_code(workdir: str, project: pathlib.Path, *, allow_change: bool) -> str | None:
  """Records the run's code at its first start; returns the one-line refusal when a later start
  runs other code (None: go on)."""
  path = records_dir(workdir) / "code.json"
  current = code_identity(project)
  recorded = read_record(path)
  if recorded is not None and recorded.get("digest") == current["digest"]:
    return None
  if recorded is not None and not allow_change:
    return (f"{workdir} was started on {describe(recorded)} and this host runs "
            f"{describe(current)}: a resume on other code is refused; install the run's code "
            "again, or allow it (launch/gcp/commands.py --allow_code_change, or supervise.py "
            "--allow_code_change)")
  if recorded is not None:
    say(f"resuming {workdir} on {describe(current)} instead of {describe(recorded)} "
        "(--allow_code_change)")
  write_record(path, {**current, "recorded": time.time()})
  return None


def last_step(workdir: str) -> int:
  """The step of the last complete row of WORKDIR/metrics.jsonl (0 when there is none)."""
  from reasoning_rl import storage  # noqa: PLC0415

  metrics = storage.path(workdir) / "metrics.jsonl"
  if not metrics.exists():
    return 0
  for line in reversed(metrics.read_text().splitlines()):
    try:
      return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
      continue
  return 0


# ---------------------------------------------------------------------------------------------
# exit codes


def reported_code(code: int, *, signalled: bool, repeated: bool, lost_peer_as_preempted: bool,
                  crash_as_preempted: bool) -> int:
  """What the launcher sees for the trainer's exit `code` (module docstring, 2)."""
  if signalled or code in PASSED_THROUGH:
    return code
  if code == ExitCode.LOST_PEER:
    return int(ExitCode.PREEMPTED) if lost_peer_as_preempted else code
  if repeated:
    return int(ExitCode.CRASH_REPEATED)
  return int(ExitCode.PREEMPTED) if crash_as_preempted else code


def is_crash(code: int) -> bool:
  return code not in PASSED_THROUGH and code != ExitCode.LOST_PEER


def record_crash(workdir: str, process: int, code: int) -> bool:
  """Records this process's crash at the run's last step; True when its previous crash was at
  the same step (a restart would crash there again)."""
  path = records_dir(workdir) / f"crash-p{process}.json"
  step = last_step(workdir)
  previous = read_record(path)
  write_record(path, {"step": step, "exit_code": code, "time": time.time()})
  return previous is not None and previous.get("step") == step


# ---------------------------------------------------------------------------------------------
# the log copy


class LogCopy:
  """Copies the local log FILE to WORKDIR/logs/hosts/<name> now and then, and once at the end."""

  def __init__(self, local: pathlib.Path, workdir: str):
    from reasoning_rl import storage  # noqa: PLC0415

    self.local, self.remote = local, storage.path(workdir) / "logs" / "hosts" / local.name
    self.every_s = float(os.environ.get("REASONING_RL_LOG_COPY_S", "30"))
    self.stopped = threading.Event()
    self.thread = threading.Thread(target=self._loop, daemon=True)

  def copy(self) -> None:
    from reasoning_rl import storage  # noqa: PLC0415

    try:
      if not storage.is_remote(self.remote):
        self.remote.parent.mkdir(parents=True, exist_ok=True)
      storage.atomic_write(self.remote, self.local.read_bytes())
    except Exception as error:  # noqa: BLE001  (a log copy never stops the run)
      say(f"could not copy the log to {self.remote}: {error}")

  def _loop(self) -> None:
    while not self.stopped.wait(self.every_s):
      self.copy()

  def __enter__(self):
    self.thread.start()
    return self

  def __exit__(self, *exc):
    self.stopped.set()
    self.thread.join()
    self.copy()


# ---------------------------------------------------------------------------------------------
# the program


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  if "--" not in argv:
    raise SystemExit("error: supervise.py: give the trainer's command after `--`, e.g. "
                     "supervise.py -- launch/train.py --config=C --config.workdir=W")
  split = argv.index("--")
  parser = argparse.ArgumentParser(prog="supervise.py", description=__doc__.split("\n\n")[0])
  parser.add_argument("--lost_peer_as_preempted", action="store_true",
                      help="report a lost peer (5) as preempted (143)")
  parser.add_argument("--crash_as_preempted", action="store_true",
                      help="report a first crash as preempted (143), so that xpk restarts it")
  parser.add_argument("--allow_code_change", action="store_true",
                      help="resume a workdir started on other code (records this code)")
  parser.add_argument("--log", type=pathlib.Path, default=None,
                      help="append all output to this file and copy it into the workdir")
  return parser.parse_args(argv[:split]), argv[split + 1:]


def run(args: argparse.Namespace, train: list[str]) -> int:
  workdir = option(train, "config.workdir")
  if not train or not workdir:
    say("error: the trainer's command must give --config.workdir=DIR")
    return int(ExitCode.BAD_INPUT)
  stops: list[int] = []
  child: list[subprocess.Popen] = []

  def forward(signum, frame):
    del frame
    stops.append(signum)
    if child:
      child[0].send_signal(signum)

  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, forward)
  signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal is no reason to stop
  project = pathlib.Path(train[0]).resolve().parents[1]
  try:
    refusal = pin_code(workdir, project, allow_change=args.allow_code_change)
  except Exception as error:  # noqa: BLE001  (the trainer reports storage failures itself)
    refusal = None
    say(f"could not check the code record in {workdir} ({error}); starting anyway")
  if refusal:
    say(f"error: {refusal}")
    return int(ExitCode.BAD_INPUT)
  if stops:  # stopped before the trainer started: nothing to save
    return 128 + stops[0]
  child.append(subprocess.Popen([sys.executable, *train], start_new_session=True))
  if stops:  # a signal between the check above and the start
    child[0].send_signal(stops[0])
  code = child[0].wait()
  code = 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it
  repeated = False
  if not stops and is_crash(code):
    try:
      repeated = record_crash(workdir, process_index(train), code)
    except Exception as error:  # noqa: BLE001
      say(f"could not record the crash in {workdir} ({error})")
  reported = reported_code(code, signalled=bool(stops), repeated=repeated,
                           lost_peer_as_preempted=args.lost_peer_as_preempted,
                           crash_as_preempted=args.crash_as_preempted)
  if repeated:
    say(f"the trainer crashed (exit {code}) at step {last_step(workdir)} again, as before its "
        f"last restart: reported as {reported} so that it is not restarted")
  elif reported != code:
    say(f"the trainer exited {code}: reported as {reported} so that the launcher restarts it")
  return reported


def main(argv: list[str]) -> int:
  args, train = parse(argv)
  if args.log is None:
    return run(args, train)
  args.log.parent.mkdir(parents=True, exist_ok=True)
  with open(args.log, "ab") as log:
    os.dup2(log.fileno(), sys.stdout.fileno())
    os.dup2(log.fileno(), sys.stderr.fileno())
  workdir = option(train, "config.workdir")
  if not workdir:
    return run(args, train)
  with LogCopy(args.log, workdir):
    return run(args, train)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
