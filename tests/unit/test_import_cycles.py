"""No import cycles in unified/ and backends/ (issue 47): every import counts, at the top of a
module or inside a function (an import inside a function only hides a cycle from Python, not
from a reader), except those under ``if TYPE_CHECKING:``, which name a type for the reader and
the type checker and are never executed. A cycle found is named module by module."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("unified", "backends")


def _modules() -> Dict[str, Path]:
    found = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _owner(name: str, modules: Dict[str, Path]) -> Optional[str]:
    """The module of ours that ``name`` (a module, or a name inside one) lives in, if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def import_graph() -> Dict[str, Set[str]]:
    """Module -> the modules of ours it imports (``from pkg import name`` counts as importing
    ``pkg.name`` where that is a module, else ``pkg``)."""
    modules = _modules()
    graph: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        imported: Set[Optional[str]] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking_block(block) for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                imported.update(_owner(alias.name, modules) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                imported.update(_owner(f"{base}.{alias.name}", modules) for alias in node.names)
        graph[module] = {m for m in imported if m and m != module}
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: Dict[str, int] = {}  # 1: on the path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "unified.accelerator" in graph["unified"]  # the package's __init__ counts as a module


def test_no_import_cycles_in_unified_and_backends():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
