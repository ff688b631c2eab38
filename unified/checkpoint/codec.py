"""Turn a ``state_dict`` into JSON plus named arrays, and back, without pickle.

Allowed leaves: ``None``, bool, int, float, str, NumPy scalars, NumPy arrays and the backend's
arrays. Containers: dicts (any str/int/float/bool/None keys), lists and tuples. Anything else
is refused with the path of the offending value, because storing it would need pickle; so are
states nested deeper than `MAX_DEPTH` and two arrays whose paths coincide (a ``"a/b"`` key
beside ``"a": {"b": ...}``, or keys ``1`` and ``"1"``), which one array name cannot tell apart.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Collection, Dict, Optional, Tuple

import numpy as np

from ..errors import CheckpointError, see

_KEY_TYPES = (str, int, float, bool, type(None))
# JSON nesting of one object's structure, encoded (a tuple adds two levels, a dict with other
# than plain string keys three). Real states nest well under 20; the bound keeps encoding,
# decoding and the manifest's parsing far from Python's recursion limit.
MAX_DEPTH = 126


def encode(tree: Any, is_array: Callable[[Any], bool], prefix: str) -> Tuple[Any, Dict[str, Any]]:
    """Return ``(structure, arrays)``: JSON-ready structure and ``{name: array}``.

    Raises `TypeError` naming the path of a value that cannot be stored.

    Example:
        >>> structure, arrays = encode({"step": 3, "w": np.zeros(2)}, lambda x: False, "opt")
        >>> structure
        {'step': 3, 'w': {'__array__': 'opt/w', 'kind': 'numpy'}}
    """
    arrays: Dict[str, Any] = {}

    def array(value: Any, path: str, kind: str) -> Dict[str, str]:
        if path in arrays:
            raise TypeError(f"{path}: two arrays of this state would be saved under this one name (keys such as "
                            "'a/b' beside 'a' -> 'b', or 1 beside '1', give the same path). Rename one of the keys.")
        arrays[path] = value
        return {"__array__": path, "kind": kind}

    def walk(value: Any, path: str, depth: int) -> Any:
        if depth >= MAX_DEPTH:
            raise TypeError(f"{path}: nested more than {MAX_DEPTH} levels deep (a container that contains itself?). "
                            "Flatten this part of state_dict().")
        if is_array(value):
            return array(value, path, "framework")
        if isinstance(value, np.ndarray):
            return array(value, path, "numpy")
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
                raise TypeError(f"{path}: dict key {bad[0]!r} of type {type(bad[0]).__name__} cannot be stored "
                                "without pickle.")
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: walk(v, f"{path}/{k}", depth + 1) for k, v in value.items()}
            return {"__dict__": [[walk(k, path, depth + 3), walk(v, f"{path}/{k}", depth + 3)]
                                 for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__tuple__": [walk(v, f"{path}/{i}", depth + 2) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}/{i}", depth + 1) for i, v in enumerate(value)]
        raise TypeError(
            f"{path}: a value of type {type(value).__module__}.{type(value).__qualname__} cannot be stored "
            "without pickle. Make state_dict() return only tensors/arrays, numbers, strings, None, "
            "lists, tuples and dicts (convert this value, or drop it and rebuild it in load_state_dict())."
        )

    try:
        return walk(tree, prefix, 0), arrays
    finally:
        # `walk` calls itself through its closure: that cycle would keep ``arrays`` (the state's
        # arrays) alive until the garbage collector runs, and a load could not free the arrays
        # it replaces one at a time (`TrainingObjects.replaceable_arrays`).
        walk = None  # noqa: F841


def _invalid_structure(detail: str) -> CheckpointError:
    return CheckpointError(f"manifest.json: an object's structure is damaged or hostile ({detail}); load another "
                           "checkpoint." + see("invalid-structure"))


def _shown(node: Any) -> str:
    text = repr(node)
    return text if len(text) <= 80 else text[:77] + "..."


def _numpy_scalar(node: Dict[str, Any]) -> Any:
    spec = node["__numpy_scalar__"]
    if not (isinstance(spec, str) and len(spec) <= 32):
        raise _invalid_structure(f"NumPy scalar type {_shown(spec)}")
    try:
        return np.dtype(spec).type(node.get("value"))
    except (TypeError, ValueError, OverflowError) as err:
        raise _invalid_structure(f"NumPy scalar {_shown(node)}: {err}") from err


def _special_float(node: Dict[str, Any]) -> float:
    text = node["__float__"]
    if isinstance(text, str):
        try:
            return float(text)
        except ValueError:
            pass
    raise _invalid_structure(f"float {_shown(text)}")


def _items(node: Dict[str, Any], key: str, size: int = 0) -> list:
    """``node[key]``, which must be a list (of ``size``-item lists when ``size``)."""
    items = node[key]
    if not isinstance(items, list) or (size and not all(isinstance(i, list) and len(i) == size for i in items)):
        raise _invalid_structure(f"{key} must be a list{f' of {size}-item lists' if size else ''}, "
                                 f"found {_shown(items)}")
    return items


def decode(structure: Any, arrays: Dict[str, Any], to_framework: Callable[[Any], Any],
           ready: Collection[str] = (), named: Optional[Callable[[Any, str], Any]] = None) -> Any:
    """Rebuild what `encode` took apart; ``to_framework`` converts the framework arrays, except
    those named in ``ready`` (already framework arrays, e.g. restored sharded); ``named``, when
    given, converts them instead and is also told each array's name.

    ``structure`` comes from a manifest and may be hostile: anything `encode` cannot have
    written (wrong node types, containers nested deeper than `MAX_DEPTH`) raises `CheckpointError`.
    """

    used = set()

    def array(node: Dict[str, Any]) -> Any:
        name = node["__array__"]
        if not isinstance(name, str):
            raise _invalid_structure(f"array name {_shown(name)}")
        if name not in arrays:
            raise CheckpointError(f"the checkpoint's structure names array {name!r}, which no file holds."
                                  + see("missing-array"))
        if name in used:  # `encode` names each array once; restored objects never share memory
            raise _invalid_structure(f"array {_shown(name)} is named twice")
        used.add(name)
        if node.get("kind") != "framework" or name in ready:
            return arrays[name]
        return named(arrays[name], name) if named is not None else to_framework(arrays[name])

    def key(node: Any, depth: int) -> Any:
        value = walk(node, depth)
        if not isinstance(value, _KEY_TYPES):
            raise _invalid_structure(f"dict key {_shown(value)}")
        return value

    def walk(node: Any, depth: int) -> Any:
        if not isinstance(node, (list, dict)):
            return node
        if depth >= MAX_DEPTH:
            raise _invalid_structure(f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, list):
            return [walk(v, depth + 1) for v in node]
        if "__array__" in node:
            return array(node)
        if "__numpy_scalar__" in node:
            return _numpy_scalar(node)
        if "__float__" in node:
            return _special_float(node)
        if "__tuple__" in node:
            return tuple(walk(v, depth + 2) for v in _items(node, "__tuple__"))
        if "__dict__" in node:
            return {key(k, depth + 3): walk(v, depth + 3) for k, v in _items(node, "__dict__", 2)}
        return {k: walk(v, depth + 1) for k, v in node.items()}

    try:
        return walk(structure, 0)
    finally:
        walk = None  # noqa: F841 - the same cycle as in `encode`: it would keep ``arrays`` alive
