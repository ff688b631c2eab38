"""`unified env`: versions, devices and the backend that would be chosen, for bug reports."""
from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import List


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    """A multi-line report like ``accelerate env``: our dependencies' versions, then each
    registered backend's distributions and (when installed) its own device lines.

    Example:
        >>> print(unified.report.report())   # doctest: +SKIP
    """
    from .registry import available_backends, backend_names, backend_spec, load_object, resolve_backend_name

    lines: List[str] = [
        f"- Python: {sys.version.split()[0]} ({platform.platform()})",
        f"- unified: {_version('unified')}",
    ]
    specs = [backend_spec(name) for name in backend_names()]
    for dist in ("numpy", *(d for spec in specs for d in spec.distributions), "safetensors"):
        lines.append(f"- {dist}: {_version(dist)}")
    try:
        lines.append(f"- backend that would be chosen: {resolve_backend_name()}")
    except (ValueError, ImportError) as err:
        lines.append(f"- backend that would be chosen: none ({err})")
    installed = available_backends()
    for spec in specs:
        if spec.report and spec.name in installed:
            lines.extend(load_object(spec.report)())
    return "\n".join(lines)
