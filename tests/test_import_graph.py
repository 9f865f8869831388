"""The import graph of `reasoning_rl/`: no cycles, and no new function-local imports.

Every module is parsed with `ast` (nothing is imported), and every import of a `reasoning_rl`
module is an edge, wherever it is written: at the top, under `if`/`try`, or inside a function. A
function-local import only postpones a cycle to the first call; it is still a cycle in the design.

Edges follow what Python executes:
- `import reasoning_rl.a.b` and `from reasoning_rl.a import b` (b a submodule) reach
  `reasoning_rl.a.b`; `from reasoning_rl.a import name` (name not a submodule) reaches
  `reasoning_rl.a`; relative imports are resolved against the importing module's package.
- importing `reasoning_rl.a.b` first runs `reasoning_rl/a/__init__.py`, so a module outside package
  `reasoning_rl.a` also depends on `reasoning_rl.a` (a package's own modules do not: the package
  re-exporting its modules is not a cycle). The top package `reasoning_rl` is left out: it
  must import nothing of its own (checked below).
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "reasoning_rl"

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
        "and math-verify (1.4 s)",
    ("reasoning_rl.config", "reasoning_rl.sharding"):
        "config files and `--help` load config.py without JAX; sharding loads it (0.4 s)",
    ("reasoning_rl.config", "reasoning_rl.verifiers.rewards"):
        "config files and `--help` load config.py without math-verify and sympy (0.3 s)",
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


@dataclasses.dataclass(frozen=True)
class Edge:
  importer: str
  imported: str
  line: int
  local: bool  # inside a function (or lambda) body
  implied: bool = False  # a package run on the way to the module the statement names

  def __str__(self) -> str:
    where = "function-local" if self.local else "module-level"
    return f"{self.importer} -> {self.imported} ({where}, line {self.line})"


def package_modules(root: pathlib.Path = REPO) -> dict[str, pathlib.Path]:
  """{dotted module name: file} of every module under reasoning_rl/ (packages by their __init__)."""
  modules = {}
  for path in sorted((root / PACKAGE).rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    modules[".".join(parts)] = path
  return modules


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
             modules: dict[str, pathlib.Path]) -> list[str]:
  """The reasoning_rl modules one import statement executes (before adding parent packages)."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  base = node.module or ""
  if node.level:
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    base = ".".join(package + ([base] if base else []))
  return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
          for alias in node.names]


def _with_packages(target: str, importer: str) -> list[str]:
  """`target` and the packages Python runs on the way to it, except the importer's own packages
  and the top package."""
  parts = target.split(".")
  found = []
  for depth in range(2, len(parts) + 1):
    name = ".".join(parts[:depth])
    if depth < len(parts) and (importer == name or importer.startswith(name + ".")):
      continue
    found.append(name)
  return found


def import_edges(modules: dict[str, pathlib.Path] | None = None) -> list[Edge]:
  """Every import of a reasoning_rl module by a reasoning_rl module, module-level and local."""
  modules = package_modules() if modules is None else modules
  edges = []
  for importer, path in modules.items():
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, local: bool, importer=importer, is_package=is_package) -> None:
      for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
          for target in _targets(child, importer, is_package, modules):
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
              continue
            for imported in _with_packages(target, importer):
              if imported in modules:
                edges.append(Edge(importer, imported, child.lineno, local, imported != target))
        visit(child, local or isinstance(
            child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), filename=str(path)), False)
  return edges


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
  """One cycle (as its edges, in order) per strongly connected component that has one."""
  graph: dict[str, dict[str, Edge]] = {}
  for edge in edges:
    graph.setdefault(edge.importer, {}).setdefault(edge.imported, edge)
    graph.setdefault(edge.imported, {})
  # Tarjan's strongly connected components, iterative.
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  components = []
  for start in sorted(graph):
    if start in index:
      continue
    work = [(start, iter(sorted(graph[start])))]
    index[start] = low[start] = len(index)
    stack.append(start)
    on_stack.add(start)
    while work:
      node, successors = work[-1]
      for successor in successors:
        if successor not in index:
          index[successor] = low[successor] = len(index)
          stack.append(successor)
          on_stack.add(successor)
          work.append((successor, iter(sorted(graph[successor]))))
          break
        if successor in on_stack:
          low[node] = min(low[node], index[successor])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          component = set()
          while True:
            member = stack.pop()
            on_stack.discard(member)
            component.add(member)
            if member == node:
              break
          if len(component) > 1 or node in graph[node]:
            components.append(component)
  return [_one_cycle(sorted(component)[0], component, graph) for component in components]


def _one_cycle(start: str, component: set[str], graph: dict[str, dict[str, Edge]]) -> list[Edge]:
  """A shortest cycle through `start` inside its component (breadth-first)."""
  previous: dict[str, Edge] = {}
  frontier = [start]
  while frontier:
    following = []
    for node in frontier:
      for successor, edge in sorted(graph[node].items()):
        if successor not in component or successor in previous:
          continue
        previous[successor] = edge
        if successor == start:
          cycle = [edge]
          while cycle[0].importer != start:
            cycle.insert(0, previous[cycle[0].importer])
          return cycle
        following.append(successor)
    frontier = following
  raise AssertionError(f"no cycle through {start}")  # a component always has one


def describe(cycle: list[Edge]) -> str:
  modules = " -> ".join([cycle[0].importer] + [edge.imported for edge in cycle])
  return modules + "\n" + "\n".join(f"    {edge}" for edge in cycle)


def local_imports(edges: list[Edge]) -> set[tuple[str, str]]:
  """(importer, module named by the statement) of every function-local import."""
  return {(edge.importer, edge.imported) for edge in edges if edge.local and not edge.implied}


# ------------------------------------------------------------------------------------ the tests


def test_reasoning_rl_has_no_import_cycle():
  edges = import_edges()
  top = [str(e) for e in edges if e.importer == PACKAGE]
  assert not top, f"{PACKAGE}/__init__.py runs before every module, so it imports none: {top}"
  cycles = find_cycles(edges)
  assert not cycles, (f"{len(cycles)} import cycle(s) in {PACKAGE}/ (function-local imports "
                      "count):\n" + "\n".join(describe(cycle) for cycle in cycles))


def package_edges(edges: list[Edge]) -> list[Edge]:
  """`edges` between subpackages (reasoning_rl.rl, reasoning_rl.sampler, ...; a top-level module
  stands for itself): what a reader sees as layers. Edges inside one subpackage are dropped."""
  def layer(module: str) -> str:
    return ".".join(module.split(".")[:2])

  return [dataclasses.replace(edge, importer=layer(edge.importer), imported=layer(edge.imported))
          for edge in edges if layer(edge.importer) != layer(edge.imported)]


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
