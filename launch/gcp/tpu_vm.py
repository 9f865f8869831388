"""Cloud TPU VMs: the bash recipe that drives a queued resource through a run, and the boot script
of workers that drive themselves (launch/gcp/commands.py --mode=tpu_vm; docs/cloud_tpu.md).

The recipe (`tpu_vm_script`), in order:
- takes the workdir's driver lock (launch/gcp/workdir_lock.py; a heartbeat keeps it) or stops
  with one line: a second recipe never drives a live run;
- creates the queued resource if there is none, waits until it is ACTIVE;
- asks every worker whether its trainer is alive (`worker_status`): while any is, it follows
  worker 0's log, and a dropped connection reconnects (nothing is reinstalled or restarted);
- when none is, reads their exit codes and acts: 0 done; 2 / 3 / 4 / 6 / 130 stop (bad input,
  guard, storage, a crash repeated at the same step, Ctrl-C); 143 / 5 / a worker that vanished
  (a preemption, maintenance, a lost host) restart, counted apart and without limit; any other
  code (a crash) restart, at most --max_restarts times. Before a restart it waits for the queued
  resource to leave ACTIVE (Spot TPU VMs are recreated, never restarted) and recreates it;
- installs (launch/gcp/install_worker.sh, the commit pinned when the recipe was made) and starts
  the trainer on every worker that has none alive (`worker_start` refuses to start a second);
- deletes the queued resource when the run ends (done, stopped, given up) or on Ctrl-C; a hangup
  (the terminal closed) or SIGTERM leaves the run going, undriven: running the recipe again
  drives it again; `--mode=down` deletes it.

With drive=workers the workers drive themselves: the queued resource is created with a boot
script (`startup_script`) that installs the project and runs the trainer at every boot of every
worker, restarts it after a lost peer or a first crash, and copies its log to
WORKDIR/logs/hosts/; the recipe only creates the resource (or recreates a preempted one: run it
again) and ends.
"""

from __future__ import annotations

import shlex

from reasoning_rl.errors import ExitCode
from reasoning_rl.tpu_chips import SliceShape

WORKER_ROOT = "$HOME/reasoning_rl"  # install_worker.sh's default root on a worker
WORKER_PYTHON = f"{WORKER_ROOT}/venv/bin/python"
SUPERVISOR = "launch/gcp/supervise.py"
STATUS_PREFIX = "reasoning_rl worker: "
FINAL_CODES = [int(c) for c in (ExitCode.BAD_INPUT, ExitCode.GUARD, ExitCode.STORAGE,
                                ExitCode.CRASH_REPEATED, ExitCode.INTERRUPTED)]
DISRUPTED_CODES = [int(ExitCode.PREEMPTED), int(ExitCode.LOST_PEER)]
# TPU VM software versions (cloud.google.com/tpu/docs/runtimes: the versions for JAX / PyTorch).
# TPU7x has none here: the same page says "The Cloud TPU API is not supported on TPU7x and later
# TPU versions", and queued resources are that API, so --mode=tpu_vm refuses tpu7x (Google's own
# AI-Hypercomputer/accelerator-microbenchmarks README once created a tpu7x-8 queued resource with
# --runtime-version=v2-alpha-tpu7-ubuntu2404 and `gcloud alpha`; the docs no longer offer that).
RUNTIME_VERSION = {"v5p": "v2-alpha-tpuv5", "v4": "tpu-ubuntu2204-base",
                   "v5litepod": "v2-alpha-tpuv5-lite", "v6e": "v2-alpha-tpuv6e"}


def _files(root: str) -> tuple[str, str, str]:
  return f"{root}/train.log", f"{root}/train.pid", f"{root}/exit_code"


def _alive(root: str) -> str:
  """Shell test: the recorded trainer (its supervisor) is alive, not just some reused pid."""
  _, pid, _ = _files(root)
  return (f'{{ p="$(cat {pid} 2> /dev/null)"; [ -n "$p" ] && kill -0 "$p" 2> /dev/null && '
          f'grep -q supervise.py "/proc/$p/cmdline" 2> /dev/null; }}')


def supervised_run(train: list[str], *, python: str, flags=()) -> str:
  """The trainer under the supervisor, as a shell line (`python` stays unquoted: it names $HOME,
  expanded on the worker)."""
  return " ".join([python, SUPERVISOR, *map(shlex.quote, flags), "--",
                   *map(shlex.quote, train[1:])])


def worker_start(run: str, root: str = WORKER_ROOT) -> str:
  """Starts `run` in the background on one worker unless its trainer is alive, and returns once
  the pid is written, so that ssh returns: ROOT/train.log (the previous one kept as
  train.previous.log), train.pid, and exit_code when it ends."""
  log, pid, code = _files(root)
  # this shell outlives a host-wide SIGTERM (trap :, not inherited) to write the exit code
  background = (f"trap : TERM; {run} > {log} 2>&1 < /dev/null & p=$!; echo $p > {pid}; "
                "wait $p; c=$?; while kill -0 $p 2> /dev/null; do wait $p; c=$?; done; "
                f"wait $p; c=$?; echo $c > {code}")
  # only the nohup command goes to the background, its output away from the session's: ssh
  # returns once everything holding the session's output has closed it
  return (f"if {_alive(root)}; then echo '{STATUS_PREFIX}alive: not started again'; exit 0; fi; "
          f"cd {root}/src || exit 1; rm -f {code} {pid}; "
          f"[ ! -f {log} ] || mv -f {log} {root}/train.previous.log; "
          f"nohup bash -c {shlex.quote(background)} > /dev/null 2>&1 < /dev/null & "
          f"until [ -s {pid} ]; do sleep 0.2; done")


def worker_status(root: str = WORKER_ROOT) -> str:
  """One line per worker: "alive", "exit CODE" (its trainer ended), or "none" (no trainer and no
  exit code: never started here, or the host lost it). A trainer that just ended gets 10 s to
  have its exit code written."""
  _, pid, code = _files(root)
  return (f"if {_alive(root)}; then echo '{STATUS_PREFIX}alive'; exit 0; fi; "
          f"if [ -s {pid} ]; then for i in $(seq 50); do [ -s {code} ] && break; sleep 0.2; "
          f"done; fi; "
          f"if [ -s {code} ]; then echo \"{STATUS_PREFIX}exit $(cat {code})\"; "
          f"else echo '{STATUS_PREFIX}none'; fi")


def worker_follow(lines: str, root: str = WORKER_ROOT) -> str:
  """Worker 0's log until its trainer ends (`lines`: tail's -n, "+1" for all of it)."""
  log, pid, _ = _files(root)
  return (f"if {_alive(root)}; then tail -n {lines} --pid=\"$(cat {pid})\" -f {log}; "
          "fi")


def slices_line(s: SliceShape, num_slices: int = 1) -> str:
  """One line saying what runs where, e.g. "v5p-64: 32 chips on 8 hosts (2x4x4)"."""
  if num_slices == 1:
    return f"{s.accelerator_type}: {s.chips} chips on {s.hosts} hosts ({s.topology})"
  return (f"{num_slices} x {s.accelerator_type}: {num_slices * s.chips} chips on "
          f"{num_slices * s.hosts} hosts, {num_slices} slices of {s.chips} chips on {s.hosts} "
          f"hosts ({s.topology})")


def install_line(source: str, ref: str = "", sha256: str = "", root: str = "") -> str:
  """install_worker.sh for `source`, the git commit `ref` or the archive digest `sha256` pinned."""
  pins = (f"REASONING_RL_REF={shlex.quote(ref)} " if ref else "") + (
      f"REASONING_RL_SHA256={shlex.quote(sha256)} " if sha256 else "")
  return f"{pins}bash install_worker.sh {shlex.quote(source)}{f' {root}' if root else ''}"


class Gcloud:
  """The gcloud commands of one queued resource (one slice: `tpu-vm ssh NAME`; several: the
  queued resource's own `ssh --node=all`)."""

  def __init__(self, num_slices: int, project: str, zone: str):
    self.where = f"--project={shlex.quote(project)} --zone={shlex.quote(zone)}"
    self.qr = "gcloud compute tpus queued-resources"
    self.multi = num_slices > 1
    self.num_slices = num_slices

  def nodes(self) -> str:
    # cloud.google.com/tpu/docs/multislice-introduction: a multislice queued resource takes
    # --node-count / --node-prefix instead of --node-id (gcloud reference of queued-resources
    # create); its nodes are PREFIX-0 ... PREFIX-(N-1) (the TPU API's MultisliceParams); `gcloud
    # compute tpus queued-resources ssh|scp QR --node=all --worker=all` reach every worker of every
    # node (their gcloud reference pages).
    if self.multi:
      return f'--node-count={self.num_slices} --node-prefix="$NAME"'
    return '--node-id="$NAME"'

  def ssh(self, which: str) -> str:
    """ssh to every worker ("all") or to the first ("first")."""
    if self.multi:
      node = "--node=all --worker=all" if which == "all" else "--node=0 --worker=0"
      return f'{self.qr} ssh "$NAME" {self.where} {node}'
    worker = "--worker=all" if which == "all" else "--worker=0"
    return f'gcloud compute tpus tpu-vm ssh "$NAME" {self.where} {worker}'

  def scp(self, local: str, remote: str) -> str:
    if self.multi:
      return f'{self.qr} scp {local} "$NAME":{remote} {self.where} --node=all --worker=all'
    return f'gcloud compute tpus tpu-vm scp {local} "$NAME":{remote} {self.where} --worker=all'


def tpu_vm_script(s: SliceShape, *, name, project, zone, source, train, workdir, lock_python,
                  lock_script, install_script, ref="", sha256="", spot=False, max_restarts=5,
                  poll_s=30, settle_s=120, num_slices=1, allow_code_change=False,
                  stale_s=600, heartbeat_s=60) -> str:
  """The driving recipe (module docstring). `lock_python` / `lock_script`: the Python and
  workdir_lock.py of the machine that runs the recipe; `install_script`: install_worker.sh there."""
  g = Gcloud(num_slices, project, zone)
  flags = ["--allow_code_change"] if allow_code_change else []
  run = supervised_run(train, python=WORKER_PYTHON, flags=flags)
  lock = f'"$LOCK_PYTHON" {shlex.quote(lock_script)}'
  final = " | ".join(map(str, FINAL_CODES))
  disrupted = " | ".join(map(str, DISRUPTED_CODES))
  return f"""#!/usr/bin/env bash
# {slices_line(s, num_slices)}; generated by launch/gcp/commands.py.
# Deletes the queued resource when the run ends or on Ctrl-C; a hangup leaves the run going (run
# this again to drive it; commands.py --mode=down deletes it).
set -uo pipefail
NAME={shlex.quote(name)}
WORKDIR={shlex.quote(workdir)}
MAX_RESTARTS={max_restarts}
POLL_S="${{POLL_S:-{poll_s}}}"
SETTLE_S="${{SETTLE_S:-{settle_s}}}"
LOCK_PYTHON="${{REASONING_RL_PYTHON:-{shlex.quote(lock_python)}}}"
OWNER="$(hostname):$$:$NAME"
DELETE=0  # set where the run ends: the exit trap then deletes the queued resource

create() {{
  {g.qr} create "$NAME" {g.nodes()} --accelerator-type={s.accelerator_type} \\
      --runtime-version={RUNTIME_VERSION[s.generation]} {g.where}{' --spot' if spot else ''}
}}
down() {{ {g.qr} delete "$NAME" {g.where} --force --quiet; }}
state() {{
  {g.qr} describe "$NAME" {g.where} --format='value(state.state)' 2> /dev/null || echo MISSING
}}
# 0 once ACTIVE; 1 when the queued resource failed, was suspended (preempted) or is gone
wait_active() {{
  while :; do
    case "$(state)" in
      ACTIVE) return 0 ;;
      FAILED | SUSPENDED | SUSPENDING | MISSING) return 1 ;;
      *) sleep "$POLL_S" ;;
    esac
  done
}}
recreate() {{ down || true; create && wait_active; }}
install() {{
  {g.scp(shlex.quote(install_script), "install_worker.sh")} &&
  {g.ssh("all")} \\
      --command={shlex.quote(install_line(source, ref, sha256))}
}}
start() {{ {g.ssh("all")} --command={shlex.quote(worker_start(run))}; }}
# one word per worker: alive | exit CODE | none
states() {{
  {g.ssh("all")} --command={shlex.quote(worker_status())} 2> /dev/null |
    sed -n 's/^{STATUS_PREFIX}//p'
}}
FOLLOW={shlex.quote(worker_follow("LINES"))}
follow() {{ {g.ssh("first")} --command="${{FOLLOW//LINES/$1}}"; }}
# done | stop CODE | disrupted | crash CODE, from the workers' exit codes
outcome() {{
  local code kind=done
  while read -r _ code; do
    case "$code" in
      0) ;;
      {final}) echo "stop $code"; return ;;
      {disrupted} | "") [ "$kind" = done ] && kind=disrupted ;;
      *) kind="crash $code" ;;
    esac
  done
  echo "$kind"
}}
on_exit() {{
  [ -n "${{HEARTBEAT:-}}" ] && kill "$HEARTBEAT" 2> /dev/null
  {lock} release "$WORKDIR" --owner="$OWNER" 2> /dev/null
  if [ "$DELETE" = 1 ]; then down; fi
}}
finish() {{ DELETE=1; exit "$1"; }}

{lock} acquire "$WORKDIR" --owner="$OWNER" --stale_s={stale_s:g} || exit $?
{lock} heartbeat "$WORKDIR" --owner="$OWNER" --every_s={heartbeat_s:g} --while_pid=$$ &
HEARTBEAT=$!
trap on_exit EXIT
trap 'DELETE=1; exit 130' INT
trap 'echo "hangup: $NAME goes on undriven; run this again to drive it" >&2; exit 129' HUP
trap 'echo "terminated: $NAME goes on undriven; run this again to drive it" >&2; exit 143' TERM
case "$(state)" in MISSING) create || exit 1 ;; esac
crashes=0
preemptions=0
installed=0
lines=+1
while :; do
  if ! wait_active; then
    preemptions=$((preemptions + 1))
    echo "preemption $preemptions (not counted toward --max_restarts):" \
      "queued resource $(state); recreating"
    recreate || sleep "$POLL_S"
    installed=0
    continue
  fi
  if ! found="$(states)" || [ -z "$found" ]; then
    sleep "$POLL_S"  # a worker did not answer: ask again (the loop notices a queued resource gone)
    continue
  fi
  if printf '%s\\n' "$found" | grep -q '^alive'; then
    [ "$lines" = +1 ] || echo "following worker 0 again: the trainers are running"
    follow "$lines" || true
    lines=20  # a reconnection shows the last lines, not the whole log again
    sleep "$POLL_S"
    continue
  fi
  if printf '%s\\n' "$found" | grep -q '^exit'; then
    result="$(printf '%s\\n' "$found" | sed 's/^none/exit /' | outcome)"
    case "$result" in
      done) echo "the run finished"; finish 0 ;;
      stop*)
        echo "the trainers stopped with exit code ${{result#stop }}: not restarted (see train.log)"
        finish "${{result#stop }}" ;;
      crash*)
        crashes=$((crashes + 1))
        if [ "$crashes" -gt "$MAX_RESTARTS" ]; then
          echo "error: the trainers crashed (exit code ${{result#crash }}) $crashes times;" \
            "gave up (--max_restarts)"
          finish 1
        fi
        echo "restart $crashes/$MAX_RESTARTS: the trainers crashed" \
          "(exit code ${{result#crash }})" ;;
      disrupted)
        preemptions=$((preemptions + 1))
        echo "preemption $preemptions (not counted toward --max_restarts):" \
          "the trainers were stopped or lost a host" ;;
    esac
    # preempted hosts take a while to leave ACTIVE: recreate once they did, else restart in place
    for i in $(seq "$SETTLE_S"); do [ "$(state)" = ACTIVE ] || break; sleep 1; done
    if [ "$(state)" != ACTIVE ]; then continue; fi
  fi
  if [ "$installed" = 0 ]; then
    install || {{ sleep "$POLL_S"; continue; }}
    installed=1
  fi
  start || sleep "$POLL_S"
  lines=+1
done
"""


def startup_script(*, source, train, workdir, install_script_text, ref="", sha256="",
                   max_restarts=5, allow_code_change=False) -> str:
  """The boot script of a worker that drives itself (drive=workers): installs the project (the
  pinned commit), runs the trainer under the supervisor with its log copied to
  WORKDIR/logs/hosts/HOST.log, restarts it in place after a lost peer (5) or a first crash, at
  most `max_restarts` times, and stops after the codes that end a run (0, 2, 3, 4, 6, 130) or a
  preemption (143: the host is going away; its next boot starts again and resumes)."""
  root = '"$ROOT"'
  flags = " --allow_code_change" if allow_code_change else ""
  run = (f'{root}/venv/bin/python {SUPERVISOR}{flags} --log="$LOG" -- '
         + " ".join(map(shlex.quote, train[1:])))
  _, pid, code = _files(root)
  final = " | ".join(map(str, [0, *FINAL_CODES, int(ExitCode.PREEMPTED)]))
  return f"""#!/bin/bash
# reasoning_rl: the boot script of a self-driving TPU VM worker (launch/gcp/tpu_vm.py), run at
# every boot of every worker. Logs: {workdir}/logs/hosts/
set -uo pipefail
ROOT="${{HOME:-/root}}/reasoning_rl"
LOG="$ROOT/logs/${{HOSTNAME:-$(hostname)}}.log"
mkdir -p "$ROOT/logs"
if {_alive('"$ROOT"')}; then exit 0; fi  # already running (the script ran twice)
cat > "$ROOT/install_worker.sh" << 'REASONING_RL_INSTALL'
{install_script_text.rstrip()}
REASONING_RL_INSTALL
cd "$ROOT"
{install_line(source, ref, sha256, root)} >> "$LOG" 2>&1 || exit 1
restarts=0
while :; do
  (cd "$ROOT/src" && exec {run}) < /dev/null >> "$LOG" 2>&1 &
  echo $! > {pid}
  wait $!
  status=$?
  echo "$status" > {code}
  case "$status" in
    {final}) exit 0 ;;
  esac
  restarts=$((restarts + 1))
  [ "$restarts" -gt {max_restarts} ] && exit 1
  sleep "${{REASONING_RL_RESTART_DELAY_S:-10}}"  # the other hosts' trainers end meanwhile
done
"""


def down_command(*, name, project, zone) -> list[str]:
  return ["gcloud", "compute", "tpus", "queued-resources", "delete", name, f"--project={project}",
          f"--zone={zone}", "--force", "--quiet"]


def self_driving_script(s: SliceShape, *, name, project, zone, workdir, startup, spot=False,
                        num_slices=1) -> str:
  """The recipe of drive=workers: the boot script written next to it, the queued resource
  created with it (or recreated when preempted), and nothing else: the workers drive."""
  g = Gcloud(num_slices, project, zone)
  return f"""#!/usr/bin/env bash
# {slices_line(s, num_slices)}, workers driving themselves; generated by
# launch/gcp/commands.py. Run it again after a Spot preemption (it recreates the queued resource);
# commands.py --mode=down deletes it. Logs: {workdir}/logs/hosts/
set -euo pipefail
NAME={shlex.quote(name)}
POLL_S="${{POLL_S:-30}}"
BOOT="$(mktemp)"
trap 'rm -f "$BOOT"' EXIT
cat > "$BOOT" << 'REASONING_RL_BOOT'
{startup.rstrip()}
REASONING_RL_BOOT
state() {{
  {g.qr} describe "$NAME" {g.where} --format='value(state.state)' 2> /dev/null || echo MISSING
}}
case "$(state)" in
  ACTIVE | ACCEPTED | PROVISIONING | WAITING_FOR_RESOURCES | CREATING)
    echo "$NAME exists ($(state)): its workers drive the run"; exit 0 ;;
  MISSING) ;;
  *) {g.qr} delete "$NAME" {g.where} --force --quiet ;;
esac
{g.qr} create "$NAME" {g.nodes()} --accelerator-type={s.accelerator_type} \\
    --runtime-version={RUNTIME_VERSION[s.generation]} {g.where}{' --spot' if spot else ''} \\
    --metadata-from-file=startup-script="$BOOT"
until [ "$(state)" = ACTIVE ]; do sleep "$POLL_S"; done
echo "$NAME is ACTIVE: its workers install and train on their own; logs in {workdir}/logs/hosts/"
"""
