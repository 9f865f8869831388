"""What a launcher process spends starting and ending, apart from its work: the libraries it
imports and the interpreter's teardown (benchmarks/RESULTS.md, "Start-up and exit of a launcher
process"). Each check runs in a fresh interpreter, as launch/train.py starts."""

import subprocess
import sys


def test_the_training_stack_loads_without_the_libraries_only_some_runs_need():
  """A trainer process starts without math-verify and sympy (the math judge runs in its helper
  processes), gguf (read only with a GGUF file) and aiohttp (only an agent run's server): 1.8 s
  less start-up per process here. Checked in a fresh interpreter, as launch/train.py starts."""
  code = ("import sys, reasoning_rl.build, reasoning_rl.trainer; "
          "print(sorted(m for m in ('sympy', 'math_verify', 'gguf', 'mistral_common', 'aiohttp') "
          "if m in sys.modules))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
  assert result.stdout.strip() == "[]", result.stdout


def test_a_launcher_collects_rarely_and_freezes_what_is_alive_after_every_other_exit_handler():
  """reasoning_rl/process_gc.py: a launcher raises the collector's thresholds and skips the
  interpreter's last collection by freezing the surviving objects in its last exit handler; the
  handlers registered after it (the libraries') still run, before it."""
  code = ("import atexit, gc\n"
          "atexit.register(lambda: print('last: frozen', gc.get_freeze_count() > 0))\n"
          "from reasoning_rl.process_gc import configure_launcher_gc\n"
          "configure_launcher_gc()\n"
          "print('thresholds', gc.get_threshold())\n"
          "atexit.register(lambda: print('library handler: frozen', gc.get_freeze_count() > 0))\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
  assert result.stdout.splitlines() == [
      "thresholds (10000, 10, 10)", "library handler: frozen False", "last: frozen True"]
