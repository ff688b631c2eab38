"""The backend boundary, checked: shared code names no framework, tests branch on no backend name,
and a backend that forgets a method fails when it is constructed, naming the method."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from unified.backend import Backend, KeyStream
from unified.backend.registry import _DEFAULTS, check_backend_class
from unified.errors import InvalidBackend
from unified.runtime.environment import ProcessEnvironment

ROOT = Path(__file__).resolve().parents[2]
# Backend names and the frameworks behind them: only the registry's default entries may say them.
FRAMEWORK_WORDS = set(_DEFAULTS) | {"jaxlib", "flax", "optax", "orbax", "orbax.checkpoint"}
ALLOWED_IN_UNIFIED = {("unified/backend/registry.py", "_DEFAULTS"), ("unified/backend/registry.py", "DEFAULT_BACKEND")}
# The conformance suite may import the libraries whose objects it hands to a backend (a torch
# DataLoader for ForeignLoaders, torch modules for the FSDP2 scenarios), never a backend package.
SUITE = "unified/testing/"


def _python_files(folder: str) -> Iterator[Tuple[str, ast.AST]]:
    for path in sorted((ROOT / folder).rglob("*.py")):
        yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path))


def _assigned_name(tree: ast.AST, node: ast.AST) -> str:
    """The module-level name whose assignment holds ``node`` ('' when none)."""
    for statement in getattr(tree, "body", []):
        if isinstance(statement, (ast.Assign, ast.AnnAssign)) and any(n is node for n in ast.walk(statement)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            return next((t.id for t in targets if isinstance(t, ast.Name)), "")
    return ""


def test_shared_code_names_no_backend_or_framework():
    offenders: List[str] = []
    for path, tree in _python_files("unified"):
        for node in ast.walk(tree):
            if path.startswith(SUITE) and not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                modules = [node.value] if node.value in FRAMEWORK_WORDS or node.value.startswith("backends.") else []
                if modules and (path, _assigned_name(tree, node)) in ALLOWED_IN_UNIFIED:
                    continue
            else:
                continue
            bad = [m for m in modules
                   if m.split(".")[0] in ({"backends"} if path.startswith(SUITE) else FRAMEWORK_WORDS | {"backends"})]
            offenders += [f"{path}:{node.lineno}: {m!r}" for m in bad]
    assert not offenders, ("framework or backend names in unified/ (move them into the backend package):\n"
                           + "\n".join(offenders))


def _backend_branches(tree: ast.AST) -> Iterator[ast.AST]:
    """``if``s and conditional expressions whose test compares something backend-ish with a name."""
    for node in ast.walk(tree):
        if not isinstance(node, (ast.If, ast.IfExp)):
            continue
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            constants = {c.value for c in (compare.left, *compare.comparators) if isinstance(c, ast.Constant)}
            words = {n.id for n in ast.walk(compare) if isinstance(n, ast.Name)}
            words |= {n.attr for n in ast.walk(compare) if isinstance(n, ast.Attribute)}
            if constants & set(_DEFAULTS) and any("backend" in w.lower() for w in words):
                yield node


def test_tests_and_the_conformance_suite_branch_on_no_backend_name():
    offenders = [f"{path}:{node.lineno}: {ast.unparse(node.test)}"
                 for folder in ("tests", "unified/testing") for path, tree in _python_files(folder)
                 if not path.startswith("tests/plugin/") for node in _backend_branches(tree)]
    assert not offenders, ("gate on a capability (@unified.testing.scenario(requires=...)) or read the backend's "
                           "attributes instead:\n" + "\n".join(offenders))


def _imports_of_tests(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """(line, module) of every absolute import of the ``tests`` package."""
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        yield from ((node.lineno, n) for n in names if n.split(".")[0] == "tests")


def test_nothing_that_ships_or_benchmarks_imports_the_tests():
    """unified/, backends/ and benchmarks/ depend on unified (and unified.testing), never on tests/."""
    offenders = [f"{path}:{line}: {module}" for folder in ("unified", "backends", "benchmarks")
                 for path, tree in _python_files(folder) for line, module in _imports_of_tests(tree)]
    assert not offenders, "\n".join(offenders)


def test_the_import_check_sees_an_import_of_the_tests():
    tree = ast.parse("from tests.conformance import harness\nimport tests.netns\n"
                     "from .tests import x\nimport testsuite\n")
    assert [m for _, m in _imports_of_tests(tree)] == ["tests.conformance", "tests.netns"]


def test_the_branch_detector_sees_a_branch():
    """The check above can fail: it finds the pattern it forbids."""
    tree = ast.parse("if acc.backend == 'torch':\n    pass\nx = 1 if backend != 'jax' else 2\n")
    assert len(list(_backend_branches(tree))) == 2


def test_a_backend_missing_a_method_fails_at_construction_naming_it():
    class Forgetful(Backend, KeyStream):
        name = "forgetful"

        def barrier(self, key, timeout): ...

    with pytest.raises(InvalidBackend, match=r"Forgetful does not implement .*all_gather_bytes.*next_key"):
        Forgetful()
    with pytest.raises(TypeError):  # InvalidBackend is a TypeError, as Python's own ABC error
        check_backend_class(Forgetful)


def test_process_environment_round_trip_and_torchrun_variables():
    env = ProcessEnvironment(3, 4, 1, 2, coordinator="10.0.0.1:29500", service_hosted=True)
    assert ProcessEnvironment.from_env(env.to_env()) == env
    torchrun = {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    assert ProcessEnvironment.from_env(torchrun) == ProcessEnvironment(2, 3, 0, 1)
    assert ProcessEnvironment.from_env({}) == ProcessEnvironment() and not ProcessEnvironment().distributed


def test_a_backend_declares_its_own_distributed_type_value():
    from unified import DistributedType

    assert DistributedType("MLX") == "MLX" and DistributedType("MLX") is DistributedType("MLX")
    assert DistributedType("JAX") is DistributedType.JAX
    with pytest.raises(ValueError):
        DistributedType("not a value")
