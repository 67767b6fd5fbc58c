"""The package's import graph has no cycle: every ``ipa_probe`` module sits on a layer, and imports only below it.

The graph is read from the source with :mod:`ast` (nothing is imported): an edge ``a -> b`` for every
``import ipa_probe.x`` / ``from ipa_probe.x import y`` / relative ``from .x import y`` in ``a``, wherever it stands
(module level, inside a function, under ``TYPE_CHECKING``), so an import moved into a function to dodge a cycle still
counts. ``from p import y`` points at the module ``p.y`` when there is one, else at ``p``. A package is not
implicitly imported by its submodules in this graph (Python runs ``p/__init__`` first, but that order is not an
import the submodule chose); the lazy attributes of :mod:`ipa_probe._lazy` are strings, not imports, and ``_lazy``
itself imports nothing of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ipa_probe

PACKAGE = Path(ipa_probe.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (path, is a package)}`` of every module under ``ipa_probe/``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["ipa_probe", *path.relative_to(PACKAGE).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_graph() -> dict[str, set[str]]:
    """``{module: the ipa_probe modules it imports}``, as described in the module docstring."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
                graph[name].update(t for t in targets if t.split(".")[0] == "ipa_probe")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "ipa_probe":
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    graph[name].add(submodule if submodule in modules else source)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``None`` (iterative depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph.get(root, ())))]
        state[root] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph.get(child, ()))))
    return None


def test_graph_reads_relative_imports():
    # the reader itself: known edges of each import form must be there, so an empty graph cannot pass
    graph = import_graph()
    assert "ipa_probe.tiny.digits.classifier" in graph["ipa_probe.tiny.digits.following"]  # from .classifier import
    assert "ipa_probe._checks" in graph["ipa_probe.tiny.digits"]  # from ..._checks import (three dots)
    assert "ipa_probe.tiny.zoo_builders" in graph["ipa_probe.tiny.zoo"]
    assert sum(len(v) for v in graph.values()) > 100


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_no_import_cycle_in_ipa_probe():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
