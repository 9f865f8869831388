"""Config values as plain Python data: what is hashed, compared, pickled or written as JSON."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def plain(value: Any, *, keep_tuples: bool = False, json_safe: bool = False) -> Any:
  """ConfigDict / FrozenConfigDict / mappings / sequences as dicts (string keys), lists and scalars.

  keep_tuples: tuples stay tuples (a task source receives its settings as the config wrote them);
    otherwise every sequence becomes a list (the form JSON gives back, so a value compares equal
    to its own round trip).
  json_safe: NaN / ±inf become the strings "nan" / "inf" / "-inf" and objects of other types their
    repr (strict JSON has neither).
  """
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {str(key): plain(item, keep_tuples=keep_tuples, json_safe=json_safe)
            for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    items = [plain(item, keep_tuples=keep_tuples, json_safe=json_safe) for item in value]
    return tuple(items) if keep_tuples and isinstance(value, tuple) else items
  if json_safe:
    if isinstance(value, float) and not math.isfinite(value):
      return str(value)
    if not (value is None or isinstance(value, (bool, int, float, str))):
      return repr(value)
  return value
