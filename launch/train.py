"""Train a policy with RL from verifiable rewards.

  python launch/train.py --config=configs/debug_cpu.py --config.workdir=/tmp/run [--config.a.b=v]

The config file's `get_config()` gives every field (`--help` lists them with their defaults, types
and accepted values; declared in reasoning_rl/config_schema.py, docs/config.md); the
`--config.FIELD=value` flags override them. The config is validated before anything is loaded or
compiled. Run again on the same workdir to resume from its newest complete checkpoint.

The terminal shows one progress line (step, train reward, held-out accuracy, s/step, ETA) and a
summary at the end; library logs go to WORKDIR/logs/train.log (`--verbose` prints them too), and
WORKDIR/report.md (with plots) is written however the run ends.

Exit codes: 0 finished; 2 bad config or input (one line naming the field); 3 a guard stopped the
run (see WORKDIR/STOPPED.md); 4 storage failure (a checkpoint could not be read or written);
5 another process of a multi-process run was lost; 130 interrupted by Ctrl-C and 143 preempted by
SIGTERM, both after saving a checkpoint.

Several processes (hosts): on Cloud TPU / GKE nothing extra; elsewhere give every process
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (docs/multihost.md).
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from reasoning_rl.process_gc import configure_launcher_gc  # noqa: E402

configure_launcher_gc()  # before the libraries import: see reasoning_rl/process_gc.py
from reasoning_rl.cpu_threads import reserve_collective_threads  # noqa: E402

# Before JAX starts its CPU client: a simulated multi-device CPU mesh needs more threads than
# XLA gives it for its collectives not to deadlock (reasoning_rl/cpu_threads.py).
reserve_collective_threads()

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from reasoning_rl.errors import CheckpointError, ExitCode, ReasoningRLError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_VERBOSE = flags.DEFINE_bool("verbose", False, "Also print library logs (INFO and up) on the "
                             "terminal; they always go to WORKDIR/logs/train.log.")
# A run over several processes (hosts): --coordinator_address, --num_processes, --process_id,
# --transfer_address (docs/multihost.md).
from reasoning_rl.multihost.runtime import define_absl_flags  # noqa: E402

_PROCESS_FLAGS = define_absl_flags()


def main(argv):
  del argv
  config = _CONFIG.value
  from reasoning_rl.console import quiet_until_logs_have_a_file

  quiet_until_logs_have_a_file(verbose=_VERBOSE.value)
  from reasoning_rl import deadlines

  # this process ends itself at the stop and storage deadlines (reasoning_rl/deadlines.py)
  deadlines.enable_process_exit()
  from reasoning_rl import host_memory

  if host_memory.wanted(config):
    # Before anything starts JAX's backend threads: they keep the malloc arena they first use.
    host_memory.keep_freed_memory()
  try:
    if config.dry_run:
      from reasoning_rl.planning import print_dry_run

      print_dry_run(config)
      return 0
    from reasoning_rl.multihost import runtime

    process_flags = _PROCESS_FLAGS()
    if not process_flags.given and not runtime.cluster_detected():
      # a TPU host's variables on a machine without TPUs (local stand-ins of a slice)
      from reasoning_rl.multihost.tpu_env import flags_from_tpu_environment

      process_flags = flags_from_tpu_environment()
      if process_flags.num_slices and process_flags.num_slices > 1 and not config.mesh.num_slices:
        # the stand-ins' devices carry no slice_index: the environment's slices are the run's
        config.mesh.num_slices = process_flags.num_slices
    from reasoning_rl import compile_cache

    compile_cache.enable()  # the next run reuses compiled programs (REASONING_RL_COMPILATION_CACHE)
    runtime.initialize(process_flags)
    exit_code = train(config)
    runtime.finish()  # every process ended normally: none of them is "lost" when it exits
    return exit_code
  except CheckpointError as error:
    print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
    return ExitCode.STORAGE
  except OSError as error:  # metrics, rollouts, logs or reports could not be written
    from reasoning_rl.workdir import storage_failure_line

    print(f"error: StorageError: {storage_failure_line(error, config.workdir)}", file=sys.stderr)
    return ExitCode.STORAGE
  except ReasoningRLError as error:
    print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
    return ExitCode.BAD_INPUT
  except KeyboardInterrupt:  # a second Ctrl-C: abort at once, nothing saved
    print("interrupted twice: stopped without saving", file=sys.stderr)
    return ExitCode.INTERRUPTED
  except Exception:
    from reasoning_rl.multihost import runtime

    runtime.stop_if_a_peer_was_lost()  # a lost process caused it: say so, exit 5
    raise


def train(config) -> int:
  """Validates config and workdir, locks the workdir, builds the run, checks it against the run's
  first start (WORKDIR/run_config.json), then trains. Nothing but the lock and the logs is
  written to the workdir before the model has loaded and the config has been checked."""
  from reasoning_rl import config as config_lib
  from reasoning_rl import workdir as workdir_lib
  from reasoning_rl.build import build
  from reasoning_rl.console import send_logs_to_workdir, stop_logging_to_workdir
  from reasoning_rl.trainer import Trainer

  import contextlib

  import jax

  from reasoning_rl import memory_plan, sharding, step_layout

  # The fingerprint keeps what was asked for: a field left to the machine (step_layout) may be
  # chosen differently on a resume elsewhere.
  requested = config.to_dict()
  num_slices = sharding.count_slices(jax.devices(), config.mesh.num_slices)
  chosen = memory_plan.resolve_layout(config, machine=step_layout.this_machine(num_slices))
  # before the workdir is touched
  config_lib.validate(config, num_devices=jax.device_count(), num_slices=num_slices)
  from reasoning_rl import deadlines

  deadlines.apply_config(config)  # before the workdir is touched: its calls get the deadlines
  # process 0 owns the workdir's files (lock, logs, fingerprint); every process trains
  primary = jax.process_index() == 0
  # a start refused before training (exit 2, or an I/O error) leaves the workdir as it found it
  start = workdir_lib.StartSnapshot(config.workdir) if primary else None
  try:
    if primary:
      workdir_lib.check_workdir_writable(config.workdir, field="config.workdir")
    lock = workdir_lib.WorkdirLock(config.workdir) if primary else contextlib.nullcontext()
    with lock:
      try:
        if primary:
          send_logs_to_workdir(config.workdir, verbose=_VERBOSE.value)
        step_layout.log_choices(chosen)
        run = build(config, validated=True)  # validated above, before the workdir was touched
        try:
          if primary:
            workdir_lib.check_or_write_fingerprint(config.workdir, requested,
                                                   allow_changes=tuple(config.resume.allow_changes))
        except ReasoningRLError:
          run.scorer.close()
          raise
      except BaseException:
        if primary:
          stop_logging_to_workdir()
          lock.release(remove=not start.lock_existed)
          start.undo(logs=True)
        raise
      start = None  # accepted: from here on the workdir is the run's
      return Trainer(run).run()
  finally:
    if start is not None:  # refused before logging (or by another trainer's lock): dirs only
      start.undo(logs=False)

if __name__ == "__main__":
  from reasoning_rl.config import absl_flags_or_exit, precheck_or_exit

  precheck_or_exit(sys.argv)
  app.run(lambda argv: sys.exit(main(argv)), flags_parser=absl_flags_or_exit)
