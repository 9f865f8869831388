"""Every choice a config names by string, in one catalogue: advantage estimators, KL estimators,
policy-loss types, loss aggregations, sampler importance corrections, reward parts and task
sources.

Each choice registers itself beside its implementation, with a one-line summary (what it does, and
its paper) and the config fields it reads:

    @registry.KL_ESTIMATORS.register("k3", summary="exp(x) − x − 1: unbiased, >= 0 (Schulman 2020)")
    def _k3(x, xp): ...

and the code that uses it looks it up by name (`KL_ESTIMATORS.get(name).impl`). A name that is not
registered is a ConfigError naming the config field and the valid names; `config.validate` checks
every name of a config this way before anything is loaded. To add a choice of your own, register it
from a module you import before building the run. `python -m reasoning_rl.registry` prints the
catalogue.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from reasoning_rl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Choice:
  """One registered name: its implementation, what it is, and the config fields it reads."""

  name: str
  impl: Any
  summary: str
  options: tuple[str, ...] = ()


class Registry:
  """The choices of one kind, in registration order.

  Args:
    kind: what a choice is, for messages ("KL estimator").
    field: the config field that names one ("algo.kl_estimator"); errors name it.
  """

  def __init__(self, kind: str, field: str):
    self.kind = kind
    self.field = field
    self._choices: dict[str, Choice] = {}

  def register(self, name: str, *, summary: str,
               options: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """Decorator: registers the decorated function or class as `name`; returns it unchanged."""

    def add(impl):
      self.add(name, impl, summary=summary, options=options)
      return impl

    return add

  def add(self, name: str, impl: Any, *, summary: str, options: tuple[str, ...] = ()) -> None:
    if name in self._choices:
      raise ValueError(f"{self.kind} {name!r} is registered twice")
    self._choices[name] = Choice(name, impl, summary, tuple(options))

  def remove(self, name: str) -> None:
    """Unregisters `name` (a plug-in unloading itself, a test cleaning up)."""
    del self._choices[name]

  def names(self) -> tuple[str, ...]:
    return tuple(self._choices)

  def __contains__(self, name: object) -> bool:
    return name in self._choices

  def get(self, name: Any, *, field: str | None = None) -> Choice:
    """The choice `name`; ConfigError naming `field` (default: this registry's) otherwise."""
    try:
      return self._choices[name]
    except (KeyError, TypeError):
      raise ConfigError(f"config.{field or self.field}={name!r}: unknown {self.kind}; use one "
                        f"of {list(self._choices)}") from None

  def describe(self) -> str:
    width = max((len(n) for n in self._choices), default=0)
    lines = [f"{self.kind} (config.{self.field}):"]
    for choice in self._choices.values():
      options = f"  [reads: {', '.join(choice.options)}]" if choice.options else ""
      lines.append(f"  {choice.name:<{width}}  {choice.summary}{options}")
    return "\n".join(lines)


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "algo.estimator")
KL_ESTIMATORS = Registry("KL estimator", "algo.kl_estimator")
LOSS_TYPES = Registry("policy loss", "algo.loss_type")
LOSS_AGGREGATIONS = Registry("loss aggregation", "algo.loss_agg")
IS_CORRECTIONS = Registry("sampler importance correction", "algo.is_correction")
REWARD_PARTS = Registry("reward part", "rewards.<name>.kind")
TASK_SOURCES = Registry("task source", "data.<split>.kind")

ALL = (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_TYPES, LOSS_AGGREGATIONS, IS_CORRECTIONS,
       REWARD_PARTS, TASK_SOURCES)


def load_builtin_choices() -> None:
  """Imports the modules whose choices register themselves, so every registry is complete."""
  # pylint: disable=import-outside-toplevel,unused-import
  from reasoning_rl.data import tasks  # noqa: F401
  from reasoning_rl.rl import advantages, losses  # noqa: F401
  from reasoning_rl.verifiers import rewards  # noqa: F401


def catalogue() -> str:
  load_builtin_choices()
  return "\n\n".join(r.describe() for r in ALL)


if __name__ == "__main__":
  # run as a script this file is `__main__`, not the module the choices register into
  from reasoning_rl import registry as _registry  # pylint: disable=import-self

  print(_registry.catalogue())
