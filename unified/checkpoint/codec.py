"""Turn a ``state_dict`` into JSON plus named arrays, and back, without pickle.

Allowed leaves: ``None``, bool, int, float, str, NumPy scalars, NumPy arrays and the backend's
arrays. Containers: dicts (any str/int/float/bool/None keys), lists and tuples. Anything else
is refused with the path of the offending value, because storing it would need pickle; so are
states nested deeper than `MAX_DEPTH` and two arrays whose paths coincide (a ``"a/b"`` key
beside ``"a": {"b": ...}``, or keys ``1`` and ``"1"``), which one array name cannot tell apart.

Batches sent from one process to the others (``dispatch_batches``, `unified.data.dispatch`) use
the same codec with two options: ``containers=True`` keeps the container classes (a
``BatchEncoding``, a named tuple; any ``Mapping``) and rebuilds them where their module is
already imported, never importing anything; ``objects=[...]`` takes every leaf that is not an
array out of the structure (kept by reference, in order), as Accelerate's dispatcher does. A
checkpoint's structure never holds either node, and `decode` refuses them unless asked.
"""
from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Mapping
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

import numpy as np

from ..errors import CheckpointError, see

_KEY_TYPES = (str, int, float, bool, type(None))
# JSON nesting of one object's structure, encoded (a tuple adds two levels, a dict with other
# than plain string keys three). Real states nest well under 20; the bound keeps encoding,
# decoding and the manifest's parsing far from Python's recursion limit.
MAX_DEPTH = 126


def _class_name(value: Any, plain: type) -> Optional[str]:
    kind = type(value)
    return None if kind is plain else f"{kind.__module__}:{kind.__qualname__}"


def loaded_class(name: Any, base: type) -> Optional[type]:
    """The class ``module:qualname`` when its module is already imported here and it is a
    ``base`` (nothing is imported, nothing else is called); None otherwise.

    Example:
        >>> loaded_class("collections:OrderedDict", Mapping)
        <class 'collections.OrderedDict'>
    """
    if not isinstance(name, str) or len(name) > 512:
        return None
    module, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, base) else None


def encode(tree: Any, is_array: Callable[[Any], bool], prefix: str, *, containers: bool = False,
           objects: Optional[List[Any]] = None) -> Tuple[Any, Dict[str, Any]]:
    """Return ``(structure, arrays)``: JSON-ready structure and ``{name: array}`` (in the
    depth-first order of ``tree``, dicts in their own key order).

    Raises `TypeError` naming the path of a value that cannot be stored. ``containers=True``
    records container classes other than ``dict``/``list``/``tuple`` (any ``Mapping`` is then a
    dict); ``objects``, a list, receives every leaf that is not an array (see the module's docstring).

    Example:
        >>> structure, arrays = encode({"step": 3, "w": np.zeros(2)}, lambda x: False, "opt")
        >>> structure
        {'step': 3, 'w': {'__array__': 'opt/w', 'kind': 'numpy'}}
        >>> leaves = []
        >>> encode((np.zeros(2), "text"), lambda x: False, "b", containers=True, objects=leaves)[0]
        {'__tuple__': [{'__array__': 'b/0', 'kind': 'numpy'}, {'__object__': 0}]}
    """
    arrays: Dict[str, Any] = {}
    dicts = Mapping if containers else dict

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
        if objects is not None and not isinstance(value, (dicts, list, tuple)):
            objects.append(value)
            return {"__object__": len(objects) - 1}
        if containers and type(value) not in (dict, list, tuple) and isinstance(value, (dicts, list, tuple)):
            plain = dict if isinstance(value, dicts) else tuple if isinstance(value, tuple) else list
            node = walk(plain(value.items()) if plain is dict else plain(value), path, depth + 1)
            return {"__class__": _class_name(value, plain), "value": node,
                    "named": isinstance(value, tuple) and hasattr(value, "_fields")}
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


def _rebuilt(node: Dict[str, Any], value: Any) -> Any:
    """A container `encode` recorded with its class (``containers=True``), rebuilt as Accelerate
    rebuilds a batch's containers (``type(x)(...)``) where the class is already imported."""
    plain = dict if isinstance(value, dict) else tuple if isinstance(value, tuple) else list
    if not isinstance(value, (dict, list, tuple)):
        raise _invalid_structure(f"container {_shown(node)}")
    kind = loaded_class(node["__class__"], Mapping if plain is dict else plain)
    if kind is None:
        return value
    return kind(*value) if node.get("named") else kind(value)


def decode(structure: Any, arrays: Dict[str, Any], to_framework: Callable[[Any], Any],
           ready: Collection[str] = (), named: Optional[Callable[[Any, str], Any]] = None, *,
           containers: bool = False, objects: Optional[List[Any]] = None) -> Any:
    """Rebuild what `encode` took apart; ``to_framework`` converts the framework arrays, except
    those named in ``ready`` (already framework arrays, e.g. restored sharded); ``named``, when
    given, converts them instead and is also told each array's name. ``containers`` and
    ``objects``: as given to `encode` (a recorded class not imported here gives a plain
    dict, list or tuple).

    ``structure`` comes from a manifest and may be hostile: anything `encode` cannot have
    written (wrong node types, containers nested deeper than `MAX_DEPTH`, the nodes of the two
    options unless asked for) raises `CheckpointError`.

    Example:
        >>> structure, arrays = encode({"w": np.zeros(2)}, lambda x: False, "opt")
        >>> decode(structure, arrays, lambda a: a)
        {'w': array([0., 0.])}
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
        if "__object__" in node and objects is not None:
            index = node["__object__"]
            if not (isinstance(index, int) and 0 <= index < len(objects)):
                raise _invalid_structure(f"object {_shown(index)}")
            return objects[index]
        if "__class__" in node and containers:
            return _rebuilt(node, walk(node.get("value"), depth + 1))
        if "__object__" in node or "__class__" in node:
            raise _invalid_structure(f"a node of an option this structure was not decoded with: {_shown(node)}")
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
