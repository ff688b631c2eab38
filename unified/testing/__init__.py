"""The conformance suite, shipped with `unified`: every promise of the contract as scenarios run
in real process groups of 2 and 3 processes, on any registered backend.

Certify a backend from any folder, with `unified` and the backend installed::

    python -m pytest --pyargs unified.testing --unified-backend NAME

The backend supplies a `Kit` (tiny training setups in its framework, named by its
``BackendSpec.testing_kit``); everything else the suite learns from the backend's capabilities,
and the scenarios a backend lacks a capability for are reported as skipped, naming it. See
``docs/certify-a-backend.md``.

Parts: `scenario` (declaring a scenario and what it requires), `harness.run_group` (one group
of fresh processes), `worker` (one process of it), `plugin` (the pytest plugin), `suite/` (the
tests), and the scenario modules (``*scenarios.py``).

This package imports no framework; the scenarios import theirs when they run.
"""
from .kit import Kit
from .scenario import requirements, scenario

__all__ = ["Kit", "scenario", "requirements"]
