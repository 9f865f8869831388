"""How a config field is declared and checked: `Field` (name, default, meaning, accepted
values), the accepted-value rules (`Range`, `OneOf` — a fixed list or a registry's names —,
`Text`, `ManyOf`, `Satisfies`), `Section`, and `checked`, which turns a value a field refuses into
one ConfigError naming config.<field>, the value, what it accepts and its default. The training
config's fields are declared with these in `config_schema`, the per-choice settings in
`config_groups`; `kind_name` / `accepts` describe a field for `--help` and docs/config.md.

JAX-free, as the schema is.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

from reasoning_rl import registries  # the registries alone: no choice, no JAX
from reasoning_rl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Range:
  """The values a numeric field accepts: an integer or a real number between optional bounds
  (`low` / `high`, inclusive unless `*_open`). Reals must be finite unless `infinite_ok` (an
  unbounded setting, e.g. a guard that is off); `none_ok` accepts None (a feature that is off)."""

  kind: type = float
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  infinite_ok: bool = False
  none_ok: bool = False
  meaning: str = ""  # what a special value means, appended to the error ("0 = off")

  def problem(self, value) -> str | None:
    """Why `value` is refused, or None."""
    if value is None and self.none_ok:
      return None
    kinds = (int,) if self.kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (
        isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and
                                                            not self.infinite_ok))):
      return f"must be {self.describe()}"
    if ((self.low is not None and (value <= self.low if self.low_open else value < self.low)) or
        (self.high is not None and (value >= self.high if self.high_open else value > self.high))):
      return f"must be {self.describe()}"
    return None

  def describe(self) -> str:
    noun = "an integer" if self.kind is int else "a number"
    if self.low is not None and self.high is not None:
      bounds = (f" in {'(' if self.low_open else '['}{self.low:g}, "
                f"{self.high:g}{')' if self.high_open else ']'}")
    elif self.low is not None:
      bounds = f" {'>' if self.low_open else '>='} {self.low:g}"
    elif self.high is not None:
      bounds = f" {'<' if self.high_open else '<='} {self.high:g}"
    else:
      bounds = ""
    extras = [text for text in ("inf allowed" if self.infinite_ok else "",
                                "or None" if self.none_ok else "", self.meaning) if text]
    return noun + bounds + (f" ({'; '.join(extras)})" if extras else "")


@dataclasses.dataclass(frozen=True)
class OneOf:
  """A name from a fixed list (`values`) or from a registry of pluggable choices (`registry`, an
  attribute of `reasoning_rl.registry`, resolved by `config.check_choice`: users register their
  own, and this module stays free of the registry's imports)."""

  values: tuple = ()
  registry: str = ""

  def describe(self) -> str:
    if self.registry:
      return f"a name of registry.{self.registry}"
    return "one of " + " | ".join(repr(v) if v == "" else str(v) for v in self.values)


@dataclasses.dataclass(frozen=True)
class Text:
  """A string that fully matches `pattern` (a tag name, an identifier, a non-empty path);
  `wants` says which in words."""

  pattern: str
  wants: str

  def problem(self, value) -> str | None:
    if isinstance(value, str) and re.fullmatch(self.pattern, value):
      return None
    return f"must be {self.describe()}"

  def describe(self) -> str:
    return self.wants


@dataclasses.dataclass(frozen=True)
class ManyOf:
  """A non-empty list of names from `values` (a list or a tuple; read as a tuple)."""

  values: tuple

  def problem(self, value) -> str | None:
    if (isinstance(value, (list, tuple)) and value and
        all(isinstance(name, str) and name in self.values for name in value)):
      return None
    return f"must be {self.describe()}"

  def describe(self) -> str:
    return "a non-empty list of " + " | ".join(self.values)


@dataclasses.dataclass(frozen=True)
class Satisfies:
  """A value `test` accepts, for the rules the other checks do not express (a list of source
  configs, a string of operators); `wants` says which in words."""

  test: Callable[[Any], bool]
  wants: str

  def problem(self, value) -> str | None:
    return None if self.test(value) else f"must be {self.wants}"

  def describe(self) -> str:
    return self.wants


class Shown:
  """A default that is not a value, shown in --help and docs/config.md by what it means."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


# The default of a setting that has none: the config must give it.
REQUIRED = Shown("(required)")


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field. `kind`: the value's type where the default does not say it (a None
  default); `typed_none`: the None default is an ml_collections placeholder of `kind`, so
  --config overrides parse as that type; `check`: a `Range`, a `OneOf`, a `Text`, a `ManyOf`, a
  `Satisfies`, or
  None (free text, or a dict of settings checked where it is read: a task source's, or a reward
  part's / an environment's by its `Group`)."""

  name: str
  default: Any
  doc: str
  check: Range | OneOf | Text | ManyOf | Satisfies | None = None
  kind: type | None = None
  typed_none: bool = False


@dataclasses.dataclass(frozen=True)
class Section:
  name: str  # dotted path below `config` ("" = top level)
  doc: str
  fields: tuple[Field, ...]


def int_range(low=None, high=None, meaning=""):
  return Range(int, low, high, meaning=meaning)


POSITIVE = Range(float, 0, low_open=True)
NON_NEGATIVE = Range(float, 0)
FRACTION = Range(float, 0, 1)
COUNT = int_range(1)
# An optional 'package.module:attribute' (an agent hub setting that names code to import).


def checked(dotted: str, item: Field, value: Any, *, floats: bool = False) -> Any:
  """`value` as field `item` of config.<dotted> holds it (a list of a `ManyOf` as a tuple; with
  `floats`, an integer of a real `Range` as a float), or a ConfigError naming config.<dotted>, the
  value, what the field accepts and its default (where that is a value it accepts)."""
  if value is REQUIRED:
    raise ConfigError(f"config.{dotted} is missing; set it to {accepts(item)} ({item.doc})")
  if (floats and isinstance(item.check, Range) and item.check.kind is float
      and isinstance(value, int) and not isinstance(value, bool)):
    value = float(value)
  problem = _problem(item, value)
  if problem:
    usable_default = not isinstance(item.default, Shown) and not _problem(item, item.default)
    raise ConfigError(f"config.{dotted}={value!r}: {problem}"
                      + (f" (default {item.default!r})" if usable_default else ""))
  return tuple(value) if isinstance(item.check, ManyOf) else value


def _problem(item: Field, value: Any) -> str | None:
  """Why `item` refuses `value`, or None."""
  rule = item.check
  if isinstance(item.default, bool) or item.kind is bool:
    return None if isinstance(value, bool) else "must be True or False"
  if isinstance(rule, OneOf) and rule.registry:
    registry = getattr(registries, rule.registry)
    return None if isinstance(value, str) and value in registry else (
        f"unknown {registry.kind}; use one of {list(registry.names())}")
  if isinstance(rule, OneOf):
    return None if value in rule.values else f"must be {rule.describe()}"
  if rule is not None:
    return rule.problem(value)
  if isinstance(item.default, str):
    return None if isinstance(value, str) else "must be a string"
  if item.kind is not None and value is not None and not isinstance(value, item.kind):
    return f"must be a {item.kind.__name__} or None"
  return None


def kind_name(item: Field) -> str:
  value = item.default
  if isinstance(value, Shown):
    return (item.kind or str).__name__
  kind = item.kind or type(value)
  if isinstance(value, dict):
    return "dict"
  if isinstance(value, tuple):
    return "tuple"
  return ("bool" if kind is bool else kind.__name__) + (" | None" if value is None else "")


def accepts(item: Field) -> str:
  if isinstance(item.default, bool) or item.kind is bool:
    return "True or False" + (" or None" if item.default is None else "")
  if item.check is not None:
    return item.check.describe()
  return ""
