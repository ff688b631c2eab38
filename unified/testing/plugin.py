"""The pytest plugin of the conformance suite (registered through the ``pytest11`` entry point,
so it is active wherever `unified` is installed).

``python -m pytest --pyargs unified.testing --unified-backend NAME`` runs the suite on backend
NAME (any registered backend: built in, or from the ``unified.backends`` entry points); without
the option, on every registered backend whose framework is installed. A test of the suite takes
the ``backend`` argument, which this plugin parametrizes. A test that reads a scenario its
backend lacks a capability for (``group.scenario(f)`` in its body, or a scenario it is
parametrized with) is reported as skipped at collection, naming the capability.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import pytest

OPTION = "--unified-backend"
_selected: Optional[List[str]] = None


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("unified", "unified conformance suite")
    group.addoption(OPTION, action="append", default=[], metavar="NAME",
                    help="run the conformance suite (unified.testing) on this registered backend; repeat for "
                         "several (default: every installed one)")


def pytest_configure(config: Any) -> None:
    global _selected
    config.addinivalue_line("markers", "multiprocess: spawns real process groups (slower)")
    requested = config.getoption("unified_backend", default=None)
    _selected = _resolve(requested) if requested else None


def _resolve(names: List[str]) -> List[str]:
    from unified.backend.registry import available_backends, backend_names

    names = [n for name in names for n in name.split(",") if n]
    unknown = [n for n in names if n not in backend_names()]
    if unknown:
        raise pytest.UsageError(f"{OPTION}: no registered backend {unknown}; registered: {', '.join(backend_names())} "
                                "(a backend from another package registers through the 'unified.backends' entry "
                                "points)")
    missing = [n for n in names if n not in available_backends()]
    if missing:
        from unified.backend.registry import backend_spec

        raise pytest.UsageError(f"{OPTION}: the framework of {missing} is not installed: "
                                + "; ".join(backend_spec(n).install for n in missing))
    return names


def selected_backends() -> List[str]:
    """The backends the suite runs on: those named with ``--unified-backend``, or every
    installed one."""
    if _selected is not None:
        return list(_selected)
    from unified.backend.registry import available_backends

    return available_backends()


def pytest_generate_tests(metafunc: Any) -> None:
    if "backend" in metafunc.fixturenames and not _parametrized(metafunc, "backend"):
        metafunc.parametrize("backend", selected_backends(), scope="module")


def _parametrized(metafunc: Any, name: str) -> bool:
    """Whether the test parametrizes ``name`` itself (``"backend"``, ``"backend, fault"``, ``["backend"]``)."""
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", "")
        if name in ([n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)):
            return True
    return False


def pytest_collection_modifyitems(config: Any, items: List[Any]) -> None:
    from .scenario import is_scenario, missing_requirements

    for item in items:
        if item.nodeid.startswith("unified/testing/") or "unified.testing" in getattr(item.module, "__name__", ""):
            item.add_marker(pytest.mark.multiprocess)
        backend = getattr(getattr(item, "callspec", None), "params", {}).get("backend")
        function = getattr(item, "function", None)
        if backend is None or function is None:
            continue
        read = [value for value in (item.module.__dict__.get(name) for name in _names(function)) if is_scenario(value)]
        read += [value for value in item.callspec.params.values() if is_scenario(value)]  # parametrized by scenario
        reasons = missing_requirements(backend, read)
        if reasons:
            item.add_marker(pytest.mark.skip(reason="; ".join(sorted(set(reasons.values())))))


def _names(function: Callable) -> List[str]:
    """The global names the test's body reads (nested code included)."""
    names, stack = [], [function.__code__]
    while stack:
        code = stack.pop()
        names += code.co_names
        stack += [c for c in code.co_consts if hasattr(c, "co_names")]
    return names
