"""Reading an environment's settings mapping: unknown names, types and ranges are ConfigErrors that
name `config.<field>.<setting>` and say what is accepted, before the run starts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from reasoning_rl.errors import ConfigError
from reasoning_rl.plain_data import plain


@dataclasses.dataclass(frozen=True)
class Setting:
  """One setting: its default, the Python types it accepts, a check and what the check wants."""

  name: str
  default: Any
  types: tuple[type, ...]
  check: Callable[[Any], bool] = lambda value: True
  wants: str = ""


def read_settings(settings: Mapping[str, Any] | None, declared: tuple[Setting, ...], *,
                  field: str) -> dict[str, Any]:
  """`settings` with every declared default filled in, checked.

  field: where the settings sit in the config, e.g. "environment.settings"; errors name
  `config.<field>.<setting>`.
  """
  given = plain(settings) if settings is not None else {}
  if not isinstance(given, Mapping):
    raise ConfigError(f"config.{field}={given!r}: must be a mapping of setting name -> value")
  names = {s.name: s for s in declared}
  unknown = sorted(set(given) - set(names))
  if unknown:
    raise ConfigError(f"config.{field}.{unknown[0]}: not a setting of this environment; its "
                      f"settings are {sorted(names)}")
  values = {}
  for setting in declared:
    value = given.get(setting.name, setting.default)
    if isinstance(value, bool) and bool not in setting.types:
      ok = False
    elif isinstance(value, int) and float in setting.types and not isinstance(value, bool):
      value, ok = float(value), True
    else:
      ok = isinstance(value, setting.types)
    if ok and isinstance(value, float):
      ok = math.isfinite(value)
    if not ok or not setting.check(value):
      raise ConfigError(f"config.{field}.{setting.name}={value!r}: must be {setting.wants} "
                        f"(default {setting.default!r})")
    values[setting.name] = value
  return values


def integer(name: str, default: int, low: int, high: int) -> Setting:
  return Setting(name, default, (int,), lambda v: low <= v <= high,
                 f"an integer in [{low}, {high}]")


def number(name: str, default: float, low: float, high: float) -> Setting:
  return Setting(name, default, (float,), lambda v: low < v <= high,
                 f"a number in ({low:g}, {high:g}]")


def flag(name: str, default: bool) -> Setting:
  return Setting(name, default, (bool,), wants="True or False")


def one_of(name: str, default: str, choices: tuple[str, ...]) -> Setting:
  return Setting(name, default, (str,), lambda v: v in choices, f"one of {list(choices)}")
