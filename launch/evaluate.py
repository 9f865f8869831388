"""Evaluate a policy on a config's held-out set: greedy pass@1, pass@k / maj@k with samples.

  python launch/evaluate.py --checkpoint=WORKDIR_OR_MODEL --config=configs/debug_cpu.py \\
      [--output=eval.json] [--config.eval.num_samples=8 --config.eval.temperature=1.0]

--checkpoint is a training run's workdir (newest complete checkpoint), one of its
checkpoints/<step> directories, a Hugging Face directory or a .gguf file, local or gs://. The
config supplies the held-out data (`data.eval`, `eval.num_examples`), the prompt template, the
rewards and the sampling limits. Writes the evaluation result (reasoning_rl.evaluation) as JSON to
--output (default: eval.json beside the checkpoint) and prints the headline numbers. Exit code 2
on bad input (one line naming it), 4 when a file cannot be read or the output written.

Several processes (hosts) split the prompts: run the same command on each, with
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` where JAX does not detect the
cluster itself (docs/multihost.md). Each process generates for every N-th prompt on its own
devices (`config.mesh.sampler` shape), process 0 scores everything and writes the output; the
result equals a single process's.
"""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from reasoning_rl.process_gc import configure_launcher_gc  # noqa: E402

configure_launcher_gc()  # before the libraries import: see reasoning_rl/process_gc.py
from reasoning_rl.cpu_threads import reserve_collective_threads  # noqa: E402

# Before JAX starts its CPU client: a simulated multi-device CPU mesh needs more threads than
# XLA gives it for its collectives not to deadlock (reasoning_rl/cpu_threads.py).
reserve_collective_threads()

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from reasoning_rl.multihost.runtime import define_absl_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (data, rewards, sampling).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Run workdir, checkpoint step, HF dir or GGUF.")
_OUTPUT = flags.DEFINE_string("output", None, "Where to write eval.json.")
_PROCESS_FLAGS = define_absl_flags()


def evaluate(checkpoint: str, config, *, share=None, mesh=None) -> dict | None:
  """The evaluation result (None on processes other than 0 of a split run)."""
  from reasoning_rl import evaluation
  from reasoning_rl.build import build_evaluation

  parts = build_evaluation(config, checkpoint, mesh=mesh)
  try:
    return evaluation.run_evaluation(
        parts.backend, parts.tokenizer, parts.template, parts.examples, parts.scorer,
        num_samples=config.eval.num_samples, temperature=config.eval.temperature,
        max_new_tokens=parts.max_new_tokens, stop_strings=tuple(config.rollout.stop_strings),
        seed=config.seed, canaries=tuple(config.eval.canaries), share=share,
        episodes=parts.episodes)
  finally:
    parts.backend.stop()
    parts.scorer.close()


def main(argv):
  del argv
  from reasoning_rl import storage
  from reasoning_rl.errors import ExitCode, ReasoningRLError
  from reasoning_rl.multihost import data_parallel, runtime
  from reasoning_rl.workdir import check_output_file_writable

  from reasoning_rl.console import quiet_until_logs_have_a_file

  quiet_until_logs_have_a_file()  # JAX's backend probing is not for the terminal
  if not _CHECKPOINT.value:
    print("error: --checkpoint is required", file=sys.stderr)
    return ExitCode.BAD_INPUT
  try:
    from reasoning_rl import compile_cache

    compile_cache.enable()  # the next run reuses compiled programs (REASONING_RL_COMPILATION_CACHE)
    runtime.initialize(_PROCESS_FLAGS())
    share = data_parallel.current_share()
    checkpoint = storage.path(_CHECKPOINT.value)
    if not checkpoint.exists():
      print(f"error: --checkpoint {checkpoint}: no such file or directory", file=sys.stderr)
      return ExitCode.BAD_INPUT
    output = storage.path(_OUTPUT.value) if _OUTPUT.value else (
        (checkpoint if checkpoint.is_dir() else checkpoint.parent) / "eval.json")
    if share.is_primary and not storage.is_remote(output):
      check_output_file_writable(output)  # before the slow part, not after it
    result = evaluate(_CHECKPOINT.value, _CONFIG.value, share=share,
                      mesh=data_parallel.local_mesh(tuple(_CONFIG.value.mesh.sampler)))
    if share.is_primary:
      storage.atomic_write(output, json.dumps(result, indent=2))
  except ReasoningRLError as error:
    print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
    return ExitCode.BAD_INPUT
  except OSError as error:  # the checkpoint or data could not be read, or the output written
    print(f"error: StorageError: {error.filename or _OUTPUT.value or _CHECKPOINT.value}: "
          f"{error.strerror or error}", file=sys.stderr)
    return ExitCode.STORAGE
  if share.is_primary:
    print(f"accuracy {result['accuracy']:.4f} on {result['num_examples']} examples "
          f"(reward/mean {result['reward/mean']:.4f}) -> {output}")
  runtime.finish()
  return 0


if __name__ == "__main__":
  from reasoning_rl.config import absl_flags_or_exit, precheck_or_exit

  precheck_or_exit(sys.argv)
  flags.mark_flags_as_required(["config"])
  app.run(lambda argv: sys.exit(main(argv)), flags_parser=absl_flags_or_exit)
