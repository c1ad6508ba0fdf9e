"""No import cycles in the package, imports inside functions included.

A cycle hidden by an import inside a function still ties two modules together: neither can be read, tested or
replaced without the other, and moving the import to the top of the file breaks at import time. So the graph
below has an edge for every `import` / `from ... import` statement anywhere in a module (function bodies and
`if TYPE_CHECKING:` blocks too), and the package must be a DAG.

The same graph keeps evaluation off the training package: nothing under `printpress.eval` may reach
`printpress.train`, whatever the route.
"""

from __future__ import annotations

import ast
from pathlib import Path

import printpress

PACKAGE_ROOT = Path(printpress.__file__).parent


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under `root`: dotted name -> file (a package's name -> its __init__.py)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The package's modules one import statement imports (importing a submodule is not counted as importing its
    parent package: that happens for every import and is never what ties two modules together)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    # `from package import name`: the submodule if `name` is one, else the package itself.
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports, from every import statement anywhere in its source."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(t for t in _imported(node, module, is_package, modules) if t in modules and t != module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None if the graph is acyclic (depth-first search)."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph.get(node, ())):
            if target in on_path:
                return path[path.index(target):] + [target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def import_chain(graph: dict[str, set[str]], start: str, package: str) -> list[str] | None:
    """A chain of imports [start, ..., m] from `start` to a module m of `package` (the package itself or one of its
    submodules), or None when `start` reaches none, directly or through other modules (breadth-first: a shortest)."""
    came_from: dict[str, str | None] = {start: None}
    queue = [start]
    for node in queue:
        if node != start and (node == package or node.startswith(package + ".")):
            chain = [node]
            while came_from[chain[-1]] is not None:
                chain.append(came_from[chain[-1]])
            return chain[::-1]
        for target in sorted(graph.get(node, ())):
            if target not in came_from:
                came_from[target] = node
                queue.append(target)
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph(PACKAGE_ROOT, "printpress"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_the_generation_core_layers():
    """A sanity check that the graph is read at all: the loops import the canvas step, the pipeline the loops."""
    graph = import_graph(PACKAGE_ROOT, "printpress")
    assert "printpress.canvas" in graph["printpress.editing"]
    assert {"printpress.diffusion", "printpress.speculative", "printpress.editing"} <= graph["printpress.pipeline"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_cycle_hidden_in_a_function_is_found(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "def late():\n    from pkg import high  # a submodule named in a from-import\n",
        "pkg/high.py": "from .low import late  # relative\n",
        "pkg/other.py": "import pkg.low\n",
    })
    graph = import_graph(root, "pkg")
    assert graph == {"pkg": set(), "pkg.low": {"pkg.high"}, "pkg.high": {"pkg.low"}, "pkg.other": {"pkg.low"}}
    assert find_cycle(graph) in (["pkg.high", "pkg.low", "pkg.high"], ["pkg.low", "pkg.high", "pkg.low"])


def test_relative_imports_in_subpackages_and_names_that_are_not_modules(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "from .sub import thing\n",  # `thing` is a name in pkg/sub/__init__.py
        "pkg/sub/__init__.py": "from . import leaf\nthing = 1\n",
        "pkg/sub/leaf.py": "from ..base import value\nfrom pkg.sub import thing\n",
        "pkg/base.py": "value = 1\n",
    })
    graph = import_graph(root, "pkg")
    assert graph == {"pkg": {"pkg.sub"}, "pkg.sub": {"pkg.sub.leaf"}, "pkg.sub.leaf": {"pkg.base", "pkg.sub"},
                     "pkg.base": set()}
    assert find_cycle(graph) == ["pkg.sub", "pkg.sub.leaf", "pkg.sub"]
    (tmp_path / "pkg/sub/leaf.py").write_text("from ..base import value\n")
    assert find_cycle(import_graph(root, "pkg")) is None


def test_evaluation_does_not_import_the_training_package():
    """Evaluation measures models; it must not need the training package (its loop, optimizer, recipes) for that.
    What both need — the objectives and held-out losses, the token files and validation windows — lives below both
    (`printpress.objectives`, `printpress.data`). No module of `printpress.eval` may import `printpress.train`,
    directly, inside a function, or through another module."""
    graph = import_graph(PACKAGE_ROOT, "printpress")
    evaluation = [m for m in graph if m == "printpress.eval" or m.startswith("printpress.eval.")]
    assert "printpress.eval.bench" in evaluation and "printpress.data" in graph["printpress.eval.bench"]
    chains = {m: import_chain(graph, m, "printpress.train") for m in evaluation}
    offending = [" -> ".join(chain) for chain in chains.values() if chain]
    assert not offending, "evaluation imports training: " + "; ".join(offending)


def test_an_import_of_a_package_is_found_inside_a_function_and_through_another_module(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/train/__init__.py": "",
        "pkg/train/loop.py": "",
        "pkg/shared.py": "def late():\n    from pkg.train import loop\n",
        "pkg/eval.py": "from . import shared\n",
        "pkg/clean.py": "",
    })
    graph = import_graph(root, "pkg")
    assert import_chain(graph, "pkg.eval", "pkg.train") == ["pkg.eval", "pkg.shared", "pkg.train.loop"]
    assert import_chain(graph, "pkg.clean", "pkg.train") is None
    assert import_chain(graph, "pkg.train.loop", "pkg.train") is None  # a module does not reach itself
