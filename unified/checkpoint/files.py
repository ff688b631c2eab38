"""Plain weight files (``save_model``): one safetensors file with the model's own parameter names."""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

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


def save_arrays(path: str, backend: Any, state: Any, metadata: Mapping[str, str] = ()) -> Dict[str, object]:
    """Write ``state``'s arrays to ``path`` as safetensors (with ``metadata`` in its header);
    returns size and checksum."""
    exported = {}
    for name, value in flat_names(state).items():
        exported[name] = (safetensors_io.export_numpy(value) if isinstance(value, np.ndarray)
                          else backend.export_array(value))
    return safetensors_io.write(path, exported, metadata)


def save_arrays_gathered(path: Optional[str], backend: Any, state: Any, whole: Callable[[Any, str], Any],
                         metadata: Mapping[str, str] = ()) -> Optional[Dict[str, object]]:
    """`save_arrays` for a model split across processes, run on every process: ``whole(value,
    name)`` (a collective) gives each array whole, one at a time in file order, so that no
    process holds more than one gathered array; only the process given a ``path`` writes."""
    arrays = flat_names(state)
    specs = {}
    for name, value in arrays.items():
        if isinstance(value, np.ndarray):
            specs[name] = (safetensors_io.safetensors_dtype(value.dtype), tuple(value.shape))
        else:
            specs[name] = backend.describe_array(value)
    return safetensors_io.write_one_by_one(path, specs, lambda name: whole(arrays[name], name), metadata)
