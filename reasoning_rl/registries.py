"""The registries of named choices, one per kind, empty until the modules that implement the
choices register into them: advantage estimators, KL estimators, policy-loss types, loss
aggregations, sampler importance corrections, off-policy rejections, reward parts, `correct` verifiers, task sources,
rollout backends and multi-turn environments.

This module knows no concrete choice and imports nothing of the package but `errors`, so every
implementing module can import it at the top:

    @registries.KL_ESTIMATORS.register("k3", summary="exp(x) − x − 1: unbiased, >= 0")
    def _k3(x, xp): ...

`reasoning_rl.registry` is the complete catalogue: it imports every built-in choice, and is what
code that looks choices up by name imports.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from reasoning_rl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Choice:
  """One registered name: its implementation, what it is, the config fields it reads and what
  it declares it can do (a rollout backend's `sampler.api.Capabilities`; None for the kinds whose
  choices declare nothing)."""

  name: str
  impl: Any
  summary: str
  options: tuple[str, ...] = ()
  capabilities: Any = None


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

  def register(self, name: str, *, summary: str, options: tuple[str, ...] = (),
               capabilities: Any = None) -> Callable[[Any], Any]:
    """Decorator: registers the decorated function or class as `name`; returns it unchanged."""

    def add(impl):
      self.add(name, impl, summary=summary, options=options, capabilities=capabilities)
      return impl

    return add

  def add(self, name: str, impl: Any, *, summary: str, options: tuple[str, ...] = (),
          capabilities: Any = None) -> None:
    if name in self._choices:
      raise ValueError(f"{self.kind} {name!r} is registered twice")
    self._choices[name] = Choice(name, impl, summary, tuple(options), capabilities)

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
# Each choice: (log ρ [B, T], valid, xp, *, geo_low, geo_high, k3_threshold) -> (rejected rows [B],
# stats); composes with IS_CORRECTIONS (reasoning_rl.rl.off_policy).
OFF_POLICY_REJECTIONS = Registry("off-policy rejection", "algo.rejection")
REWARD_PARTS = Registry("reward part", "rewards.<name>.kind")
VERIFIERS = Registry("verifier", "rewards.<name>.verifier")
TASK_SOURCES = Registry("task source", "data.<split>.kind")
# Each choice: a factory (sampler.api.BackendSpec) -> sampler.api.RolloutBackend, registered with
# its sampler.api.Capabilities (sampler.api.register_backend).
ROLLOUT_BACKENDS = Registry("rollout backend", "rollout.backend")
# Each choice: a factory (settings mapping, *, field) -> environments.Environment that checks the
# settings before the run starts (ConfigError naming config.<field>.<setting>).
ENVIRONMENTS = Registry("environment", "environment.name")

ALL = (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_TYPES, LOSS_AGGREGATIONS, IS_CORRECTIONS,
       OFF_POLICY_REJECTIONS, REWARD_PARTS, VERIFIERS, TASK_SOURCES, ROLLOUT_BACKENDS,
       ENVIRONMENTS)
