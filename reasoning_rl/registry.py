"""Every choice a config names by string, in one catalogue: advantage estimators, KL estimators,
policy-loss types, loss aggregations, sampler importance corrections, off-policy rejections,
reward parts, `correct` verifiers, task sources, rollout backends and multi-turn environments.

Each choice registers itself beside its implementation, into the registries of
`reasoning_rl.registries`, with a one-line summary (what it does, and its paper) and the config
fields it reads:

    @registries.KL_ESTIMATORS.register("k3", summary="exp(x) − x − 1: unbiased, >= 0")
    def _k3(x, xp): ...

This module imports every module that registers a built-in choice, so once it is imported every
registry is complete; the code that uses a choice looks it up by name
(`registry.KL_ESTIMATORS.get(name).impl`). A name that is not registered is a ConfigError naming
the config field and the valid names; `config.validate` checks every name of a config this way
before anything is loaded. To add a choice of your own, register it from a module you import before
building the run. `python -m reasoning_rl.registry` prints the catalogue.
"""

from __future__ import annotations

# The modules below register the built-in choices when imported; nothing else of them is used here.
from reasoning_rl import environments  # noqa: F401  pylint: disable=unused-import
from reasoning_rl.data import tasks  # noqa: F401  pylint: disable=unused-import
from reasoning_rl.registries import (ADVANTAGE_ESTIMATORS, ALL, ENVIRONMENTS, IS_CORRECTIONS,
                                     KL_ESTIMATORS, LOSS_AGGREGATIONS, LOSS_TYPES,
                                     OFF_POLICY_REJECTIONS, REWARD_PARTS, ROLLOUT_BACKENDS,
                                     TASK_SOURCES, VERIFIERS, Choice, Registry)
# pylint: disable-next=unused-import
from reasoning_rl.rl import advantages, losses, off_policy  # noqa: F401
from reasoning_rl.sampler import engine_backend  # noqa: F401  pylint: disable=unused-import
from reasoning_rl.verifiers import rewards  # noqa: F401  pylint: disable=unused-import

__all__ = ["ADVANTAGE_ESTIMATORS", "ALL", "Choice", "ENVIRONMENTS", "IS_CORRECTIONS",
           "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "LOSS_TYPES", "OFF_POLICY_REJECTIONS",
           "REWARD_PARTS", "ROLLOUT_BACKENDS",
           "Registry", "TASK_SOURCES", "VERIFIERS", "catalogue"]


def catalogue() -> str:
  return "\n\n".join(r.describe() for r in ALL)


if __name__ == "__main__":
  print(catalogue())
