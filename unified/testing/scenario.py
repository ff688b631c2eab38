"""Declaring a conformance scenario: a function run in every process of a group, and what a
backend needs to run it.

A scenario takes the process's ``state`` dict (shared by the scenarios of one run, in order)
and returns JSON-serialisable observations; tests read them by the function
(``group.scenario(identity)``), so a renamed scenario fails when the test module is imported.

Example:
    >>> from unified.testing import scenario
    >>> @scenario(requires=("TrainingObjects",))
    ... def saves_once(state):
    ...     return {"saved": True}
    >>> requirements(saves_once).capabilities
    ('TrainingObjects',)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from unified.backend import CAPABILITIES

from .kit import HEALTH_CHANNEL, KIT_SLOTS, backend_features, kit_of

__all__ = ["scenario", "requirements", "reference", "is_scenario", "backend_features", "missing_requirements",
           "HEALTH_CHANNEL", "REQUIREMENT_NAMES"]

# Not a capability class: a backend has it when its `Backend.health_channel` is overridden, so
# that a process that fails alone (e.g. cannot write its part of an async save) tells the others.
REQUIREMENT_NAMES = tuple(c.__name__ for c in CAPABILITIES) + (HEALTH_CHANNEL,)
_ATTRIBUTE = "__unified_scenario__"


@dataclasses.dataclass(frozen=True)
class Requirements:
    """What a scenario needs: capabilities (names of `unified.backend` capability classes, or
    ``"HealthChannel"``), parts of the backend's `unified.testing.Kit`, and the group sizes it is
    written for (``None``: any)."""

    capabilities: Tuple[str, ...] = ()
    kit: Tuple[str, ...] = ()
    processes: Optional[Tuple[int, ...]] = None


def scenario(function: Optional[Callable] = None, *, requires: Sequence[str] = (), kit: Sequence[str] = (),
             processes: Optional[Sequence[int]] = None) -> Any:
    """Mark ``function`` as a conformance scenario needing the capabilities ``requires`` and the
    `Kit` attributes ``kit``, runnable in groups of the sizes ``processes``. An unknown name
    fails here, when the module is imported (so at collection).

    Example:
        >>> @scenario(requires=("TrainingLoop",), processes=(2, 3))
        ... def accumulates(state):
        ...     return {}
    """
    unknown = [name for name in requires if name not in REQUIREMENT_NAMES]
    if unknown:
        raise ValueError(f"unknown capabilities {unknown} in @scenario(requires=...): "
                         f"use {', '.join(REQUIREMENT_NAMES)} (docs/certify-a-backend.md)")
    unknown = [name for name in kit if name not in KIT_SLOTS]
    if unknown:
        raise ValueError(f"unknown Kit attributes {unknown} in @scenario(kit=...): use {', '.join(KIT_SLOTS)} "
                         "(docs/certify-a-backend.md)")
    needs = Requirements(tuple(requires), tuple(kit), tuple(processes) if processes is not None else None)

    def mark(fn: Callable) -> Callable:
        setattr(fn, _ATTRIBUTE, needs)
        return fn

    return mark(function) if function is not None else mark


def is_scenario(value: Any) -> bool:
    return callable(value) and hasattr(value, _ATTRIBUTE)


def requirements(function: Callable) -> Requirements:
    """The `Requirements` declared by `scenario`; a plain function is refused."""
    if not is_scenario(function):
        raise TypeError(f"{function!r} is not a conformance scenario: decorate it with @unified.testing.scenario "
                        "(docs/certify-a-backend.md)")
    return getattr(function, _ATTRIBUTE)


def reference(function: Callable) -> str:
    """``"module:function"``: how the worker process finds the scenario."""
    requirements(function)
    return f"{function.__module__}:{function.__qualname__}"


def missing_requirements(backend: str, functions: Sequence[Callable]) -> Dict[str, str]:
    """Scenario name -> why ``backend`` cannot run it, for those it cannot run."""
    have = backend_features(backend)
    out = {}
    for function in functions:
        needs = requirements(function)
        lacking = [c for c in needs.capabilities if c not in have]
        if lacking:
            out[function.__name__] = (f"backend {backend!r} lacks {', '.join(map(_declared, lacking))} "
                                      f"(needed by scenario {function.__name__})")
            continue
        parts = [part for part in needs.kit if getattr(kit_of(backend), part) is None]
        if parts:
            out[function.__name__] = (f"the testing kit of backend {backend!r} has no {', '.join(parts)} "
                                      f"(needed by scenario {function.__name__})")
    return out


def _declared(capability: str) -> str:
    """A requirement as the contract declares it: a class of `unified.backend` (a capability,
    or `HealthChannel`, what ``Backend.health_channel()`` returns when the backend has one)."""
    if capability == HEALTH_CHANNEL:
        return f"{HEALTH_CHANNEL} (unified.backend.HealthChannel: its Backend.health_channel() returns None)"
    return f"{capability} (unified.backend.{capability})"
