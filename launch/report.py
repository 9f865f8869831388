"""Write report.md (plots, held-out evaluations, sample completions) for a run directory.

Usage:
  python launch/report.py --workdir=DIR

Reads DIR/metrics.jsonl, DIR/eval/*.json and DIR/rollouts/*.jsonl; writes DIR/report.md and
DIR/report/*.png (reasoning_rl/report.py). Quantities a run did not log are shown as "not logged".

Exit codes: 0 written; 2 bad input (one line: a missing workdir, a file of the run that cannot be
read; nothing is written); 4 the report could not be written (or a file read) for I/O reasons.
"""

import pathlib
import sys

# Make the repository importable when run as `python launch/report.py` from a checkout.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from reasoning_rl.errors import ExitCode, ReasoningRLError  # noqa: E402
from reasoning_rl.report import write_report  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (the training --config.workdir).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 2,
                                    "Highest- and lowest-reward completions of the last step.")


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    return _fail(f"unexpected arguments: {argv[1:]}", ExitCode.BAD_INPUT)
  if not _WORKDIR.value:
    return _fail("--workdir=DIR is required", ExitCode.BAD_INPUT)
  if _NUM_SAMPLES.value < 0:
    return _fail(f"--num_samples={_NUM_SAMPLES.value}: must be >= 0", ExitCode.BAD_INPUT)
  try:
    print(write_report(_WORKDIR.value, num_samples=_NUM_SAMPLES.value))
  except ReasoningRLError as error:
    return _fail(f"{type(error).__name__}: {error}", ExitCode.BAD_INPUT)
  except OSError as error:
    return _fail(f"StorageError: {error.filename or _WORKDIR.value}: {error.strerror or error}",
                 ExitCode.STORAGE)
  return 0


def _fail(message: str, code: int) -> int:
  print(f"error: {message}", file=sys.stderr)
  return code


if __name__ == "__main__":
  from reasoning_rl.config import absl_flags_or_exit

  app.run(main, flags_parser=absl_flags_or_exit)
