"""Train a policy with RL from verifiable rewards.

  python launch/train.py --config=configs/debug_cpu.py --config.workdir=/tmp/run [--config.a.b=v]

The config file's `get_config()` gives every field (documented in reasoning_rl/config.py); the
`--config.FIELD=value` flags override them. The config is validated before anything is loaded or
compiled. Run again on the same workdir to resume from its newest complete checkpoint.

Exit codes: 0 finished; 2 bad config or input (one line naming the field); 3 a guard stopped the
run (see WORKDIR/STOPPED.md); 143 preempted by SIGTERM after saving a checkpoint.
"""

import logging
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)


def main(argv):
  del argv
  from reasoning_rl.errors import ReasoningRLError

  config = _CONFIG.value
  logging.getLogger("reasoning_rl").setLevel(logging.INFO)
  try:
    if config.dry_run:
      from reasoning_rl.planning import print_dry_run

      print_dry_run(config)
      return 0
    from reasoning_rl.trainer import Trainer

    return Trainer(config).run()
  except ReasoningRLError as error:
    print(f"error: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
