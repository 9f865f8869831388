"""One conversion of config values to plain data, in the three forms its callers need."""

import math

import ml_collections

from reasoning_rl.plain_data import plain


def _config():
  return ml_collections.ConfigDict({"kind": "jsonl", "stop": ("a", "b"), "nested": {"k": [1, 2]},
                                    "limit": math.inf, "missing": None})


def test_default_form_is_dicts_and_lists():
  assert plain(_config()) == {"kind": "jsonl", "stop": ["a", "b"], "nested": {"k": [1, 2]},
                              "limit": math.inf, "missing": None}


def test_task_settings_keep_their_tuples():
  settings = plain(_config(), keep_tuples=True)
  assert settings["stop"] == ("a", "b") and isinstance(settings["stop"], tuple)
  assert settings["nested"]["k"] == [1, 2]


def test_json_safe_form_writes_what_strict_json_holds():
  class Opaque:
    def __repr__(self):
      return "Opaque()"

  assert plain({1: [math.inf, -math.inf, math.nan, Opaque(), True, 2.5]}, json_safe=True) == {
      "1": ["inf", "-inf", "nan", "Opaque()", True, 2.5]}
