"""The one place that maps a backend name to its code.

Each backend is described by a `BackendSpec`, a light object that names (as ``"module:object"``
strings, imported only when needed) the backend class, its launcher, its lines of the
``unified env`` report and its seeding of global generators. The built-in backends are the two
default entries below; a package adds a backend without editing ours through the
``unified.backends`` entry-point group, whose entries point to a `BackendSpec`::

    [project.entry-points."unified.backends"]
    mlx = "unified_mlx:SPEC"

Example:
    >>> from unified.backend.registry import available_backends, resolve_backend_name
    >>> resolve_backend_name("jax")     # doctest: +SKIP
    'jax'
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
from typing import Any, Dict, List, Optional, Tuple

from ..errors import BackendUnavailable, InvalidBackend, see
from ..runtime.environment import BACKEND_VARIABLE, LAUNCHER_BACKEND_VARIABLE
from .capabilities import Backend, check_backend_class

__all__ = ["BackendSpec", "ENTRY_POINT_GROUP", "available_backends", "backend_names", "backend_spec",
           "resolve_backend_name", "create_backend", "load_object"]

ENTRY_POINT_GROUP = "unified.backends"

# The built-in backends, and the one chosen when several are installed and nothing was said.
_DEFAULTS = {"torch": "backends.torch:SPEC", "jax": "backends.jax:SPEC"}
DEFAULT_BACKEND = "torch"


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """How to find, install, launch, report and seed one backend. Every ``"module:object"``
    field is imported only when used; the module holding the spec must import no framework.

    Attributes:
        name: the name users pass as ``Accelerator(backend=...)``.
        backend: the `unified.Backend` subclass.
        framework: the module whose presence means the backend is installed.
        install: the command that installs it (quoted in errors).
        launcher: a `unified.launcher.plan.Launcher`: how a group of this backend is started.
        report: a function returning lines for ``unified env`` (may import the framework).
        seed_globals: ``f(seed, deterministic)`` seeding the framework's global generators when
            `unified.utils.set_seed` runs without an Accelerator (must not import the framework).
        distributions: pip distributions whose versions ``unified env`` lists.
        tested_versions: ``(distribution, oldest, newest)`` for each distribution that CI runs
            the tests with at its oldest supported and its newest version (``.ci/run``);
            ``unified env`` says whether the installed versions are inside these ranges.
        private_apis: a function probing the framework's private APIs that the backend uses,
            raising a clear error when the installed version changed one (may import the framework).
        testing_kit: the `unified.testing.Kit` (class or instance): the tiny training setups the
            conformance suite runs on this backend (see docs/certify-a-backend.md).
    """

    name: str
    backend: str
    framework: str
    install: str
    launcher: str
    report: Optional[str] = None
    seed_globals: Optional[str] = None
    distributions: Tuple[str, ...] = ()
    tested_versions: Tuple[Tuple[str, str, str], ...] = ()
    private_apis: Optional[str] = None
    testing_kit: Optional[str] = None


def load_object(target: str) -> Any:
    """Import ``"package.module:attribute"`` and return the attribute."""
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


@functools.lru_cache(maxsize=None)
def _registry() -> Dict[str, BackendSpec]:
    specs = {name: load_object(target) for name, target in _DEFAULTS.items()}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in specs:
            continue  # a built-in name cannot be taken over by a plugin
        spec = entry.load()
        if not isinstance(spec, BackendSpec) or spec.name != entry.name:
            raise InvalidBackend(
                f"entry point {entry.name!r} = {entry.value!r} of group {ENTRY_POINT_GROUP!r} must point to a "
                f"unified.backend.registry.BackendSpec named {entry.name!r}; found {spec!r}."
                + see("invalid-backend-plugin")
            )
        specs[entry.name] = spec
    return specs


def backend_names() -> List[str]:
    """Every registered backend name, installed or not."""
    return list(_registry())


def backend_spec(name: str) -> BackendSpec:
    """The `BackendSpec` registered under ``name``."""
    return _registry()[name]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def available_backends() -> List[str]:
    """Names of the registered backends whose framework is installed.

    Example:
        >>> import unified
        >>> unified.available_backends()   # doctest: +SKIP
        ['torch', 'jax']
    """
    return [name for name, spec in _registry().items() if _installed(spec.framework)]


def resolve_backend_name(requested: Optional[str] = None) -> str:
    """Pick the backend: argument, then ``UNIFIED_BACKEND``, then the launcher's choice, then the
    only built-in framework installed, then the default."""
    for source, value in (
        ("backend=", requested),
        (BACKEND_VARIABLE, os.environ.get(BACKEND_VARIABLE)),
        (f"the launcher ({LAUNCHER_BACKEND_VARIABLE})", os.environ.get(LAUNCHER_BACKEND_VARIABLE)),
    ):
        if value:
            name = value.strip().lower()
            if name not in _registry():
                choices = ", ".join(repr(n) for n in _registry())
                raise ValueError(
                    f"Invalid backend from {source}: expected one of {choices}; received {value!r}."
                    + see("invalid-backend")
                )
            return name
    installed = [name for name in available_backends() if name in _DEFAULTS]
    if len(installed) == 1:
        return installed[0]
    if not installed:
        options = " or ".join(spec.install for name, spec in _registry().items() if name in _DEFAULTS)
        raise BackendUnavailable("No supported framework is installed. Install one: " + options + "."
                                 + see("no-framework"))
    return DEFAULT_BACKEND


def create_backend(name: str) -> Any:
    """Instantiate the backend registered under ``name`` (importing its framework now)."""
    spec = backend_spec(name)
    if not _installed(spec.framework):
        raise BackendUnavailable(
            f"The {name!r} backend needs {spec.framework}, which is not installed. Install it with: {spec.install}"
            + see("backend-not-installed")
        )
    cls = load_object(spec.backend)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise InvalidBackend(f"{spec.backend} (backend {name!r}) is not a unified.Backend subclass."
                             + see("invalid-backend-class"))
    check_backend_class(cls)
    return cls()
