"""The import graph of `reasoning_rl/`, read with `ast` (nothing is imported): every import of a
`reasoning_rl` module is an edge, wherever it is written (at the top, under `if` / `try`, inside a
function). tests/test_import_graph.py checks it; other tests read it (which module imports which).

Edges follow what Python executes:
- `import reasoning_rl.a.b` and `from reasoning_rl.a import b` (b a submodule) reach
  `reasoning_rl.a.b`; `from reasoning_rl.a import name` (name not a submodule) reaches
  `reasoning_rl.a`; relative imports are resolved against the importing module's package.
- importing `reasoning_rl.a.b` first runs `reasoning_rl/a/__init__.py`, so a module outside package
  `reasoning_rl.a` also depends on `reasoning_rl.a` (a package's own modules do not: the package
  re-exporting its modules is not a cycle).
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
PACKAGE = "reasoning_rl"


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


def package_edges(edges: list[Edge]) -> list[Edge]:
  """`edges` between subpackages (reasoning_rl.rl, reasoning_rl.sampler, ...; a top-level module
  stands for itself): what a reader sees as layers. Edges inside one subpackage are dropped."""
  def layer(module: str) -> str:
    return ".".join(module.split(".")[:2])

  return [dataclasses.replace(edge, importer=layer(edge.importer), imported=layer(edge.imported))
          for edge in edges if layer(edge.importer) != layer(edge.imported)]
