"""Flatten and rebuild nested dicts, lists and tuples (namedtuples too) of leaves."""
from __future__ import annotations

from typing import Any, Callable, List, Tuple

from ..errors import see

Rebuild = Callable[[List[Any]], Any]


def flatten(tree: Any, is_leaf: Callable[[Any], bool]) -> Tuple[List[Any], Rebuild]:
    """Return the leaves of ``tree`` in a fixed order and a function that rebuilds the tree.

    Dict keys are visited in sorted order so that every process flattens the same way.

    Example:
        >>> leaves, rebuild = flatten({"b": [1, 2], "a": 3}, lambda x: isinstance(x, int))
        >>> leaves
        [3, 1, 2]
        >>> rebuild([30, 10, 20])
        {'a': 30, 'b': [10, 20]}
    """
    leaves: List[Any] = []

    def walk(node: Any) -> Callable[[List[Any]], Any]:
        if is_leaf(node):
            index = len(leaves)
            leaves.append(node)
            return lambda values: values[index]
        if isinstance(node, dict):
            keys = sorted(node, key=str)
            parts = [walk(node[k]) for k in keys]
            kind = type(node)
            return lambda values: kind((k, p(values)) for k, p in zip(keys, parts))
        if isinstance(node, (list, tuple)):
            parts = [walk(item) for item in node]
            if isinstance(node, tuple) and hasattr(node, "_fields"):
                kind = type(node)
                return lambda values: kind(*(p(values) for p in parts))
            kind = type(node)
            return lambda values: kind(p(values) for p in parts)
        raise TypeError(
            f"Expected a framework array or a dict/list/tuple of them; received {type(node).__name__}."
            + see("unsupported-leaf")
        )

    rebuild = walk(tree)
    return leaves, rebuild
