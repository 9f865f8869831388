"""The import graph of `reasoning_rl/` (tests/support/import_graph.py): no cycles, and no new
function-local imports. A function-local import only postpones a cycle to the first call; it is
still a cycle in the design. The top package `reasoning_rl` must import nothing of its own
(checked below).
"""

from __future__ import annotations

import pathlib

import pytest

from tests.support.import_graph import (PACKAGE, describe, find_cycles, import_edges,
                                        local_imports, package_edges, package_modules)

# Why a function-local import is left local (cost: seconds / modules it adds when imported last).
_JAX = "JAX, flax"
_MODEL_PART = ("verifier worker processes import the reward parts without JAX; a model-scored "
               "part loads its model on the main process only (JAX, flax: 0.7 s)")
_SETTINGS = ("run_settings.py is read by the builder and the planner from a bare config; it "
             "loads the training stack only in the function that needs it: ")
_SAMPLER_EXPORTS = ("sampler/__init__.py re-exports its JAX modules on first use (PEP 562), so "
                    "that sampler/api.py, the rollout backend's interface, loads without JAX "
                    "(0.7 s)")
_TOKENIZERS = ("the tokenizer libraries (tokenizers, sentencepiece, jinja2: 0.3 s) load with a "
               "model's tokenizer only")

# Function-local imports of reasoning_rl modules that may stay, as (importer, module the statement
# names): why. A new one fails test_function_local_imports_do_not_grow, and so does one that is
# gone, so this list only shrinks.
ALLOWED_LOCAL_IMPORTS: dict[tuple[str, str], str] = {
    ("reasoning_rl.run_settings", "reasoning_rl.data.debug_vocab"): _SETTINGS + "JAX, "
        "tokenizers (1.2 s)",
    ("reasoning_rl.run_settings", "reasoning_rl.lora"): _SETTINGS + _JAX + " (0.7 s)",
    ("reasoning_rl.run_settings", "reasoning_rl.models.config"): _SETTINGS + _JAX + " (0.75 s)",
    ("reasoning_rl.run_settings", "reasoning_rl.rl.step_config"): _SETTINGS + _JAX + ", optax "
        "(1.5 s)",
    ("reasoning_rl.config", "reasoning_rl.lora"):
        "config files and `--help` load config.py without JAX; lora loads it (1 s)",
    ("reasoning_rl.config", "reasoning_rl.registry"):
        "config files and `--help` load config.py without JAX; every built-in choice loads it "
        "(1.8 s)",
    ("reasoning_rl.config", "reasoning_rl.sharding"):
        "config files and `--help` load config.py without JAX; sharding loads it (0.4 s)",
    ("reasoning_rl.evaluation", "reasoning_rl.sampler.sampling"):
        "scoring-only users of evaluation (replay, report) do not load JAX (0.8 s)",
    ("reasoning_rl.models", "reasoning_rl.models.tokenizers"): _TOKENIZERS,
    ("reasoning_rl.multihost.cluster", "reasoning_rl.sharding"):
        "multihost/cluster.py loads without JAX (0.4 s; it imports jax itself inside functions)",
    ("reasoning_rl.multihost.data_parallel", "reasoning_rl.sharding"):
        "multihost/data_parallel.py loads without JAX (0.4 s; it imports jax itself inside "
        "functions)",
    ("reasoning_rl.multihost.topology", "reasoning_rl.sharding"):
        "multihost/topology.py (devices -> roles) loads without JAX (0.5 s)",
    ("reasoning_rl.trainer", "reasoning_rl.report"):
        "matplotlib (0.4 s) loads only when a run ends and writes report.md",
    ("reasoning_rl.verifiers.judge", "reasoning_rl.run_checkpoint"): _MODEL_PART,
    **{("reasoning_rl.sampler", f"reasoning_rl.sampler.{module}"): _SAMPLER_EXPORTS
       for module in ("engine", "engine_backend", "engine_factory", "multiturn", "rollout",
                      "sampling")},
    ("reasoning_rl.verifiers.judge", "reasoning_rl.sampler"): _MODEL_PART,
    ("reasoning_rl.verifiers.judge", "reasoning_rl.sampler.rollout"): _MODEL_PART,
    ("reasoning_rl.verifiers.judge", "reasoning_rl.sampler.sampling"): _MODEL_PART,
    ("reasoning_rl.verifiers.reward_model_part", "reasoning_rl.models.reward_model"): _MODEL_PART,
}


# ------------------------------------------------------------------------------------ the tests


def test_reasoning_rl_has_no_import_cycle():
  edges = import_edges()
  top = [str(e) for e in edges if e.importer == PACKAGE]
  assert not top, f"{PACKAGE}/__init__.py runs before every module, so it imports none: {top}"
  cycles = find_cycles(edges)
  assert not cycles, (f"{len(cycles)} import cycle(s) in {PACKAGE}/ (function-local imports "
                      "count):\n" + "\n".join(describe(cycle) for cycle in cycles))


def test_no_cycle_between_packages():
  """Modules may be acyclic while their packages are not (rl.step_config -> registry ->
  rl.losses was one): a package that needs another's registrations imports the module that
  makes them, not the catalogue above both."""
  cycles = find_cycles(package_edges(import_edges()))
  assert not cycles, (f"{len(cycles)} cycle(s) between packages of {PACKAGE}/:\n"
                      + "\n".join(describe(cycle) for cycle in cycles))


def test_function_local_imports_do_not_grow():
  edges = import_edges()
  found = local_imports(edges)
  new = sorted(found - set(ALLOWED_LOCAL_IMPORTS))
  gone = sorted(set(ALLOWED_LOCAL_IMPORTS) - found)
  lines = {(e.importer, e.imported): e.line for e in edges if e.local}
  assert not new, ("function-local imports of reasoning_rl modules not in ALLOWED_LOCAL_IMPORTS: "
                   "move them to the top of the module, or add them with the reason:\n" +
                   "\n".join(f"    {a} -> {b} (line {lines[a, b]})" for a, b in new))
  assert not gone, ("ALLOWED_LOCAL_IMPORTS lists imports that are no longer function-local; "
                    "remove them from the list:\n" + "\n".join(f"    {a} -> {b}" for a, b in gone))


def test_every_allowed_local_import_says_why():
  for pair, reason in ALLOWED_LOCAL_IMPORTS.items():
    assert reason.strip(), f"{pair}: give the reason the import is function-local"


# The graph walk itself, on a package written for the purpose: it must see what it claims to see.


def _write(root: pathlib.Path, files: dict[str, str]) -> dict[str, pathlib.Path]:
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return package_modules(root)


def test_a_cycle_through_a_function_local_import_is_found(tmp_path):
  modules = _write(tmp_path, {
      "reasoning_rl/__init__.py": "",
      "reasoning_rl/registry.py": "def load():\n  from reasoning_rl.rl import losses\n",
      "reasoning_rl/rl/__init__.py": "",
      "reasoning_rl/rl/losses.py": "from reasoning_rl import registry\n",
  })
  cycles = find_cycles(import_edges(modules))
  assert [[(e.importer, e.imported, e.local) for e in c] for c in cycles] == [[
      ("reasoning_rl.registry", "reasoning_rl.rl.losses", True),
      ("reasoning_rl.rl.losses", "reasoning_rl.registry", False)]]
  assert describe(cycles[0]).startswith(
      "reasoning_rl.registry -> reasoning_rl.rl.losses -> reasoning_rl.registry\n")


@pytest.mark.parametrize("statement", [
    "from . import b", "from .b import x", "import reasoning_rl.pkg.b",
    "from reasoning_rl.pkg import b", "from reasoning_rl.pkg.b import x as y"])
def test_every_form_of_import_is_resolved(tmp_path, statement):
  modules = _write(tmp_path, {
      "reasoning_rl/__init__.py": "",
      "reasoning_rl/pkg/__init__.py": "",
      "reasoning_rl/pkg/a.py": f"if True:\n  {statement}\n",
      "reasoning_rl/pkg/b.py": "class C:\n  def f(self):\n    from reasoning_rl.pkg import a\n",
  })
  edges = import_edges(modules)
  assert {(e.importer, e.imported, e.local) for e in edges} == {
      ("reasoning_rl.pkg.a", "reasoning_rl.pkg.b", False),
      ("reasoning_rl.pkg.b", "reasoning_rl.pkg.a", True)}
  assert len(find_cycles(edges)) == 1


def test_a_package_init_counts_for_importers_outside_it(tmp_path):
  modules = _write(tmp_path, {
      "reasoning_rl/__init__.py": "",
      "reasoning_rl/lora.py": "from reasoning_rl.models.transformer import abstract_model\n",
      "reasoning_rl/models/__init__.py": "from reasoning_rl.models.checkpoints import save_hf\n",
      "reasoning_rl/models/checkpoints.py": ("from reasoning_rl.models import transformer\n"
                                             "from reasoning_rl import lora\n"),
      "reasoning_rl/models/transformer.py": "",
  })
  edges = import_edges(modules)
  # a package re-exporting its own modules is no cycle; lora reaching checkpoints through
  # models/__init__.py is one
  assert ("reasoning_rl.models.checkpoints", "reasoning_rl.models") not in {
      (e.importer, e.imported) for e in edges}
  [cycle] = find_cycles(edges)
  assert {e.importer for e in cycle} == {"reasoning_rl.lora", "reasoning_rl.models",
                                        "reasoning_rl.models.checkpoints"}


def test_the_function_local_import_check_sees_a_new_one(tmp_path):
  modules = _write(tmp_path, {
      "reasoning_rl/__init__.py": "",
      "reasoning_rl/a.py": "import json\ndef f():\n  import reasoning_rl.b\n  import numpy\n",
      "reasoning_rl/b.py": "",
  })
  assert local_imports(import_edges(modules)) == {("reasoning_rl.a", "reasoning_rl.b")}

