"""Pure scoring: math answers, countdown / reasoning-gym logic, code tests, format, length, rewards.

The code sandbox lives in the `sandbox` subpackage; worker processes and deadlines live in
`reasoning_rl.workers`.

`reasoning_rl.verifiers.math` (`is_correct`) and `reasoning_rl.verifiers.code` (`run_tests`) are
published names; their modules are `math_answers` and `code_tests`, so that no file here is named
like a standard-library module. The published names are aliases resolved on first import (a
meta-path finder), so `import reasoning_rl.verifiers` stays cheap: math-verify and sympy load only
when the math verifier is used.
"""

import importlib
import importlib.abc
import importlib.util
import sys

_ALIASES = {f"{__name__}.math": f"{__name__}.math_answers",
            f"{__name__}.code": f"{__name__}.code_tests"}


class _PublishedNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports a published name as the module that implements it (the same module object)."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname in _ALIASES:
      return importlib.util.spec_from_loader(fullname, self)
    return None

  def create_module(self, spec):
    return importlib.import_module(_ALIASES[spec.name])

  def exec_module(self, module):
    del module  # already executed under its own name


if not any(isinstance(finder, _PublishedNames) for finder in sys.meta_path):
  sys.meta_path.insert(0, _PublishedNames())
