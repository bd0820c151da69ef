"""No import circles in the project's packages.

The graph is built from the source (ast), not by importing: every ``import`` and
``from ... import`` anywhere in a module counts, at the top or inside a function, because a
function-local import only hides a circle until the function runs. Importing ``a.b.c`` also
runs the ``__init__`` of ``a`` and ``a.b``, so those are edges too, except a module's own
ancestor packages (they are already being imported when it runs). Imports under
``if TYPE_CHECKING:`` never run and are left out.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flowgrpo_kernels", "ipc", "trainer", "bench")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _imported_names(module: str, path: Path):
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:  # the deepest project module a dotted name lies in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        deps = set()
        for name in _imported_names(module, path):
            target = owner(name)
            if target is None:
                continue
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                is_ancestor = module == dep or module.startswith(dep + ".")
                if dep in mods and not is_ancestor:
                    deps.add(dep)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_sees_a_circle_through_a_chain_and_none_in_a_tree():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_counts_function_local_imports_and_parent_packages():
    graph = import_graph()
    # trainer.models.adapter_class imports base inside the function
    assert "trainer.models.base" in graph["trainer.models"]
    # the driver imports trainer.models.base, which runs trainer/models/__init__.py first
    assert {"trainer.models", "trainer.models.base"} <= graph["trainer.rollout.driver"]


def test_no_module_imports_a_module_that_imports_it_back():
    found = cycles(import_graph())
    assert not found, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)
