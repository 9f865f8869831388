"""Pure scoring: math answers, countdown / reasoning-gym logic, code tests, format, length, rewards.

The code sandbox lives in the `sandbox` subpackage; worker processes and deadlines live in
`reasoning_rl.workers`.

`reasoning_rl.verifiers.code` is a published name (`from reasoning_rl.verifiers.code import
run_tests`); its module is `code_tests`, so that no file here is named like a standard-library
module. Registering the alias costs only standard-library imports (the sandbox loads nothing else).
"""

import sys

from reasoning_rl.verifiers import code_tests

code = code_tests
sys.modules[__name__ + ".code"] = code_tests
