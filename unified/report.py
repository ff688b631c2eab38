"""`unified env`: versions, devices and the backend that would be chosen, for bug reports."""
from __future__ import annotations

import importlib
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
    """A multi-line report like ``accelerate env``.

    Example:
        >>> print(unified.env.report())   # doctest: +SKIP
    """
    from .backend import available_backends, resolve_backend_name

    lines: List[str] = [
        f"- Python: {sys.version.split()[0]} ({platform.platform()})",
        f"- unified: {_version('unified')}",
    ]
    for dist in ("numpy", "torch", "jax", "jaxlib", "flax", "orbax-checkpoint", "safetensors"):
        lines.append(f"- {dist}: {_version(dist)}")
    try:
        lines.append(f"- backend that would be chosen: {resolve_backend_name()}")
    except (ValueError, ImportError) as err:
        lines.append(f"- backend that would be chosen: none ({err})")
    installed = available_backends()
    if "torch" in installed:
        torch = importlib.import_module("torch")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        lines.append(f"- torch devices: cpu, {gpus} CUDA GPU(s)")
    if "jax" in installed:
        jax = importlib.import_module("jax")
        lines.append(f"- jax devices: {', '.join(str(d) for d in jax.local_devices())}")
    return "\n".join(lines)
