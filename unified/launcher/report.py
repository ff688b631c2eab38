"""`unified env`: versions, devices and the backend that would be chosen, for bug reports."""
from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import List, Optional, Tuple

from packaging.version import InvalidVersion, Version


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _release(version: str) -> Tuple[int, ...]:
    """The release numbers without trailing zeros (2.6 == 2.6.0; local tags such as +cpu dropped)."""
    release = list(Version(version).release)
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    return tuple(release)


def version_range_note(installed: str, oldest: str, newest: str) -> Tuple[bool, str]:
    """Whether ``installed`` lies in the tested ``[oldest, newest]`` range (release numbers
    only: ``2.13.0+cpu`` is 2.13.0), and the note ``unified env`` prints after the version.

    Example:
        >>> version_range_note("0.9.0", "0.8.2", "0.10.2")
        (True, 'tested: 0.8.2 to 0.10.2')
        >>> version_range_note("0.7.1", "0.8.2", "0.10.2")
        (False, 'OLDER than the oldest tested 0.8.2 (tested: 0.8.2 to 0.10.2)')
    """
    tested = f"tested: {oldest} to {newest}"
    try:
        release = _release(installed)
    except InvalidVersion:
        return False, f"unknown version ({tested})"
    if release < _release(oldest):
        return False, f"OLDER than the oldest tested {oldest} ({tested})"
    if release > _release(newest):
        return False, f"newer than the newest tested {newest} ({tested})"
    return True, tested


def _tested_ranges(specs: List[object]) -> dict:
    ranges = {}
    for spec in specs:
        for dist, oldest, newest in getattr(spec, "tested_versions", ()):
            ranges[dist] = (oldest, newest)
    return ranges


def report() -> str:
    """A multi-line report like ``accelerate env``: our dependencies' versions, then each
    registered backend's distributions (with the range CI tested, and whether the installed
    version lies in it) and (when installed) its own device lines.

    Example:
        >>> print(unified.launcher.report.report())   # doctest: +SKIP
    """
    from ..backend.registry import available_backends, backend_names, backend_spec, load_object, resolve_backend_name

    lines: List[str] = [
        f"- Python: {sys.version.split()[0]} ({platform.platform()})",
        f"- unified: {_version('unified')}",
    ]
    specs = [backend_spec(name) for name in backend_names()]
    ranges = _tested_ranges(specs)
    outside: List[str] = []
    for dist in ("numpy", *(d for spec in specs for d in spec.distributions), "safetensors"):
        version = _version(dist)
        note: Optional[str] = None
        if dist in ranges and version != "not installed":
            inside, note = version_range_note(version, *ranges[dist])
            if not inside:
                outside.append(f"{dist} {version}")
        lines.append(f"- {dist}: {version}" + (f" ({note})" if note else ""))
    lines.append("- installed versions inside the tested ranges: "
                 + (f"no ({', '.join(outside)}; see the README's support table)" if outside else "yes"))
    try:
        lines.append(f"- backend that would be chosen: {resolve_backend_name()}")
    except (ValueError, ImportError) as err:
        lines.append(f"- backend that would be chosen: none ({err})")
    installed = available_backends()
    for spec in specs:
        if spec.report and spec.name in installed:
            lines.extend(load_object(spec.report)())
    return "\n".join(lines)
