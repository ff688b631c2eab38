"""Plain weight files (``save_model``): one safetensors file with the model's own parameter names."""
from __future__ import annotations

from typing import Any, Dict

import numpy as np

from . import safetensors_io


def flat_names(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """``{"layer.weight": array}`` from a flat or nested dict of arrays."""
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_names(value, f"{name}."))
        else:
            out[name] = value
    return out


def save_arrays(path: str, backend: Any, state: Any) -> Dict[str, object]:
    """Write ``state``'s arrays to ``path`` as safetensors; returns size and checksum."""
    exported = {}
    for name, value in flat_names(state).items():
        exported[name] = safetensors_io.export_numpy(value) if isinstance(value, np.ndarray) else backend.export_array(value)
    return safetensors_io.write(path, exported)
