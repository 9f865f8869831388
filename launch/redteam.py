"""Throw known reward hacks at a config's reward and report every one that pays.

Usage:
  python launch/redteam.py --config=configs/NAME.py [--config.rewards.format.weight=0.2 …]

The config file's `get_config()` must return a ConfigDict with a `rewards` field (see
reasoning_rl/verifiers/rewards.py). Prints one row per probe; exits 1 when any exploit earns reward,
0 otherwise. The trainer runs the same check at start-up (reasoning_rl.reward_redteam).
"""

import pathlib
import sys

# Make the repository importable when run as `python launch/redteam.py` from a checkout.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from reasoning_rl.errors import ConfigError  # noqa: E402
from reasoning_rl.reward_redteam import run_redteam  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file whose get_config() has a `rewards` field.",
    lock_config=True)


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config=PATH is required")
  if "rewards" not in config:
    raise ConfigError("the config has no `rewards` field; add config.rewards = {part: {weight, …}}")
  report = run_redteam(config.rewards)
  print(report.table())
  return 0 if report.ok else 1


if __name__ == "__main__":
  from reasoning_rl.config import absl_flags_or_exit, precheck_or_exit

  precheck_or_exit(sys.argv, full=False)
  app.run(main, flags_parser=absl_flags_or_exit)
