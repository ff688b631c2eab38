"""The backends share a shape (as Keras 3's do): every `backends/<name>/` package has the same
module names, each for the same concern, and no backend imports another backend. Code that two
backends need (the torch DataLoader adapter a JAX run uses too) lives in `backends/common.py`."""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

BACKENDS = Path(__file__).resolve().parents[2] / "backends"


def _packages() -> Dict[str, Path]:
    """Every backend package: a folder of `backends/` with an ``__init__.py``."""
    return {p.name: p for p in sorted(BACKENDS.iterdir()) if p.is_dir() and (p / "__init__.py").is_file()}


def _module_names(package: Path) -> Set[str]:
    """The package's modules and subpackages, by name (``core``, ``sharding``, ...)."""
    names = {p.stem for p in package.glob("*.py")}
    return names | {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}


def _imported(tree: ast.AST, package: List[str]) -> Iterator[Tuple[int, str]]:
    """``(line, dotted name)`` of everything ``tree`` imports, relative imports made absolute from
    ``package`` (the dotted parts of the package holding the module, ``["backends", "jax"]``), plus
    string constants that name a module under `backends` (a ``"module:object"`` reference or a
    ``python -m`` argument imports it too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # level 1 is the module's own package, 2 the one above, ...
                base = package[: max(0, len(package) - node.level + 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # `from backends import torch`
                yield node.lineno, f"{module}.{alias.name}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("backends."):
            yield node.lineno, node.value.split(":")[0]


def _foreign_imports(packages: Dict[str, Path]) -> List[str]:
    """Imports of one backend package by another, and by the modules beside them (what every
    backend shares, `backends/common.py`, must not reach into one of them either)."""
    found = []
    shared = [p for p in sorted(BACKENDS.glob("*.py")) if p.name != "__init__.py"]
    for path in shared:
        lines: Dict[int, str] = {}  # one entry per line
        for line, module in _imported(ast.parse(path.read_text(), str(path)), ["backends"]):
            parts = module.split(".")
            if len(parts) >= 2 and parts[0] == "backends" and parts[1] in packages:
                lines.setdefault(line, module)
        found += [f"backends/{path.name}:{line}: {module}" for line, module in sorted(lines.items())]
    for name, folder in packages.items():
        others = set(packages) - {name}
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            package = ["backends", *path.relative_to(BACKENDS).parent.parts]
            lines = {}  # one entry per line
            for line, module in _imported(tree, package):
                parts = module.split(".")
                if len(parts) >= 2 and parts[0] == "backends" and parts[1] in others:
                    lines.setdefault(line, module)
            found += [f"backends/{path.relative_to(BACKENDS)}:{line}: {module}"
                      for line, module in sorted(lines.items())]
    return found


def test_there_are_backend_packages():
    assert len(_packages()) >= 2, sorted(_packages())


def test_every_backend_has_the_same_module_names():
    packages = _packages()
    modules = {name: _module_names(folder) for name, folder in packages.items()}
    every = set().union(*modules.values())
    missing = {name: sorted(every - names) for name, names in modules.items() if every - names}
    assert not missing, (
        "every backends/<name>/ holds the same module names, one concern each (see backends/__init__.py); "
        f"missing: {missing}")


def test_no_backend_imports_another_backend():
    found = _foreign_imports(_packages())
    assert not found, ("a backend imports another backend (move what they share into backends/common.py):\n"
                       + "\n".join(found))


def test_the_import_check_sees_a_foreign_import(tmp_path, monkeypatch):
    """The check above can fail: it finds each form of a cross-backend import."""
    for name, text in (("a", "from backends.b.core import X\n"), ("b", "from ..a import core\n"),
                       ("c", "import backends.a.data\n"), ("d", "SPEC = 'backends.b.core:Backend'\n"),
                       ("e", "from backends import a\n"), ("f", "from . import core\nimport backends.common\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "core.py").write_text(text)
    (tmp_path / "common.py").write_text("def f():\n    from backends.a import private\n")
    monkeypatch.setattr(sys.modules[__name__], "BACKENDS", tmp_path)
    found = _foreign_imports(_packages())
    assert [line.split("/")[1].split(":")[0] for line in found] == ["common.py", "a", "b", "c", "d", "e"], found
