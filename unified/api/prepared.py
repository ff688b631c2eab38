"""What ``prepare`` returned (`unified.Accelerator`'s part): `PreparedObjects` keeps the prepared
models, optimizers, LR schedulers and gradient scalers by kind, and the prepared data loaders,
in the order they were prepared; the Accelerator owns one, checkpointing guards what it holds,
Accelerate's names read it (``prepare_model``, ``accelerator._models``) and ``free_memory``
forgets it. ``PREPARED_KINDS`` names the kinds."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

__all__ = ["PREPARED_KINDS", "PreparedObjects"]

# The kinds of objects `prepare` tracks, which `free_memory` forgets (registered objects stay, as
# in Accelerate).
PREPARED_KINDS = ("model", "optimizer", "scheduler", "scaler", "dataloader")


class PreparedObjects:
    """What ``prepare`` returned, by kind (``"model"``, ``"optimizer"``, ``"scheduler"``,
    ``"scaler"``, ``"dataloader"``), each object once, matched by identity.

    Args:
        untrack: called by `forget` first: stop saving what was prepared (the Accelerator drops
            their checkpoint entries).

    Example:
        >>> prepared = PreparedObjects()
        >>> prepared.add("model", model)
        >>> prepared.of("model") == [model], prepared.kind_of(model)
        (True, 'model')
    """

    def __init__(self, untrack: Callable[[], None] = lambda: None) -> None:
        self._objects: List[Tuple[str, Any]] = []
        self._loaders: List[Any] = []
        self._untrack = untrack

    def add(self, kind: str, obj: Any) -> None:
        """Remember ``obj``, prepared as a ``kind`` (not a data loader: see `add_loader`)."""
        self._objects.append((kind, obj))

    def add_loader(self, loader: Any) -> None:
        """Remember a prepared data loader."""
        self._loaders.append(loader)

    def kind_of(self, obj: Any) -> Optional[str]:
        """The kind ``obj`` was prepared as (``"dataloader"`` for a loader); None when ``prepare``
        did not return it."""
        if any(obj is loader for loader in self._loaders):
            return "dataloader"
        return next((kind for kind, mine in self._objects if mine is obj), None)

    def __contains__(self, obj: Any) -> bool:
        return self.kind_of(obj) is not None

    def of(self, kind: str) -> List[Any]:
        """The prepared objects of ``kind``, in the order they were prepared (a new list)."""
        if kind == "dataloader":
            return list(self._loaders)
        return [obj for mine, obj in self._objects if mine == kind]

    def pairs(self) -> List[Tuple[str, Any]]:
        """``(kind, object)`` for each prepared object but the data loaders, in order (what a
        backend's ``guard_writes`` takes)."""
        return list(self._objects)

    def forget(self) -> None:
        """``free_memory``: what ``prepare`` returned is no longer saved, guarded or listed."""
        self._untrack()
        self._objects.clear()
        self._loaders.clear()
