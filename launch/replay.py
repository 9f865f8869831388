"""Re-score a past run's rollout records with the current verifiers; list every changed reward.

Usage:
  python launch/replay.py --workdir=DIR --config=configs/NAME.py [--config.rewards.X.weight=…]
      [--output=replay.json] [--fail_on_change]

The config's `rewards` field defines the reward to re-score with (usually the run's config, perhaps
with a changed verifier setting). Prints a summary (records changed per reward part, old and new
verifier_version, the first changed records); `--output` writes the full report as JSON. Exit code 0,
or 1 with `--fail_on_change` when any record changed, or 2 with one line naming the flag or file at
fault (no workdir or rollouts there, a config without `rewards`, a rollout record that cannot be
replayed: not UTF-8 JSON, another format_version, a missing field), or 4 with one line when a file
cannot be read or the report written for I/O reasons.
"""

import json
import pathlib
import sys

# Make the repository importable when run as `python launch/replay.py` from a checkout.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from reasoning_rl.errors import ConfigError, ExitCode, ReasoningRLError  # noqa: E402
from reasoning_rl.replay import replay  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file whose get_config() has the `rewards` field to re-score with.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding rollouts/.")
_OUTPUT = flags.DEFINE_string("output", None, "Write the full report here as JSON.")
_FAIL_ON_CHANGE = flags.DEFINE_bool("fail_on_change", False, "Exit 1 if any reward changed.")


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    return _fail(f"unexpected arguments: {argv[1:]}", ExitCode.BAD_INPUT)
  if _CONFIG.value is None or not _WORKDIR.value:
    return _fail("--config=PATH and --workdir=DIR are required", ExitCode.BAD_INPUT)
  config = _CONFIG.value
  scorer = None
  try:
    if "rewards" not in config:
      raise ConfigError("the config has no `rewards` field; add config.rewards = {part: {weight, "
                        "…}}")
    if _OUTPUT.value:  # before the slow part, not after it
      from reasoning_rl.workdir import (  # pylint: disable=import-outside-toplevel
          check_output_file_writable)

      check_output_file_writable(_OUTPUT.value)
    if "verifier" in config:  # a full training config: score as the run did (pool or inline)
      from reasoning_rl.build import (  # pylint: disable=import-outside-toplevel
          build_reward_fn, build_scorer)

      scorer = build_scorer(config, build_reward_fn(config, redteam=False))
    report = replay(_WORKDIR.value, config.rewards, scorer=scorer)
    print(report.summary())
    if _OUTPUT.value:
      pathlib.Path(_OUTPUT.value).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
  except ReasoningRLError as error:
    return _fail(f"{type(error).__name__}: {error}", ExitCode.BAD_INPUT)
  except OSError as error:
    return _fail(f"StorageError: {error.filename or _WORKDIR.value}: {error.strerror or error}",
                 ExitCode.STORAGE)
  finally:
    if scorer is not None:
      scorer.close()
  return 1 if _FAIL_ON_CHANGE.value and report.changed else 0


def _fail(message: str, code: int) -> int:
  print(f"error: {message}", file=sys.stderr)
  return code


if __name__ == "__main__":
  from reasoning_rl.config import absl_flags_or_exit, precheck_or_exit

  precheck_or_exit(sys.argv, full=False)
  app.run(main, flags_parser=absl_flags_or_exit)
