"""Write report.md (plots, held-out evaluations, sample completions) for a run directory.

Usage:
  python launch/report.py --workdir=DIR

Reads DIR/metrics.jsonl, DIR/eval/*.json and DIR/rollouts/*.jsonl; writes DIR/report.md and
DIR/report/*.png (reasoning_rl/report.py). Quantities a run did not log are shown as "not logged".
"""

import pathlib
import sys

# Make the repository importable when run as `python launch/report.py` from a checkout.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from reasoning_rl.report import write_report  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (the training --config.workdir).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 2,
                                    "Highest- and lowest-reward completions of the last step.")


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _WORKDIR.value:
    raise app.UsageError("--workdir=DIR is required")
  print(write_report(_WORKDIR.value, num_samples=_NUM_SAMPLES.value))
  return 0


if __name__ == "__main__":
  app.run(main)
