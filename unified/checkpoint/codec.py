"""Turn a ``state_dict`` into JSON plus named arrays, and back, without pickle.

Allowed leaves: ``None``, bool, int, float, str, NumPy scalars, NumPy arrays and the backend's
arrays. Containers: dicts (any str/int/float/bool/None keys), lists and tuples. Anything else
is refused with the path of the offending value, because storing it would need pickle.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Collection, Dict, Tuple

import numpy as np

from ..errors import CheckpointError, see

_KEY_TYPES = (str, int, float, bool, type(None))


def encode(tree: Any, is_array: Callable[[Any], bool], prefix: str) -> Tuple[Any, Dict[str, Any]]:
    """Return ``(structure, arrays)``: JSON-ready structure and ``{name: array}``.

    Example:
        >>> structure, arrays = encode({"step": 3, "w": np.zeros(2)}, lambda x: False, "opt")
        >>> structure
        {'step': 3, 'w': {'__array__': 'opt/w', 'kind': 'numpy'}}
    """
    arrays: Dict[str, Any] = {}

    def walk(value: Any, path: str) -> Any:
        if is_array(value):
            arrays[path] = value
            return {"__array__": path, "kind": "framework"}
        if isinstance(value, np.ndarray):
            arrays[path] = value
            return {"__array__": path, "kind": "numpy"}
        if isinstance(value, np.generic):
            return {"__numpy_scalar__": value.dtype.str, "value": value.item()}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real):
            f = float(value)
            return f if math.isfinite(f) else {"__float__": repr(f)}
        if isinstance(value, dict):
            bad = [k for k in value if not isinstance(k, _KEY_TYPES)]
            if bad:
                raise TypeError(f"{path}: dict key {bad[0]!r} of type {type(bad[0]).__name__} cannot be stored without pickle.")
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: walk(v, f"{path}/{k}") for k, v in value.items()}
            return {"__dict__": [[walk(k, path), walk(v, f"{path}/{k}")] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__tuple__": [walk(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
        raise TypeError(
            f"{path}: a value of type {type(value).__module__}.{type(value).__qualname__} cannot be stored "
            "without pickle. Make state_dict() return only tensors/arrays, numbers, strings, None, "
            "lists, tuples and dicts (convert this value, or drop it and rebuild it in load_state_dict())."
        )

    return walk(tree, prefix), arrays


def decode(structure: Any, arrays: Dict[str, Any], to_framework: Callable[[Any], Any],
           ready: Collection[str] = ()) -> Any:
    """Rebuild what `encode` took apart; ``to_framework`` converts the framework arrays, except
    those named in ``ready`` (already framework arrays, e.g. restored sharded)."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "__array__" in node:
            name = node["__array__"]
            if name not in arrays:
                raise CheckpointError(f"the checkpoint's structure names array {name!r}, which no file holds" + see("missing-array"))
            return to_framework(arrays[name]) if node.get("kind") == "framework" and name not in ready else arrays[name]
        if "__numpy_scalar__" in node:
            return np.dtype(node["__numpy_scalar__"]).type(node["value"])
        if "__float__" in node:
            return float(node["__float__"])
        if "__tuple__" in node:
            return tuple(walk(v) for v in node["__tuple__"])
        if "__dict__" in node:
            return {walk(k): walk(v) for k, v in node["__dict__"]}
        return {k: walk(v) for k, v in node.items()}

    return walk(structure)
