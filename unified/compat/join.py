"""Accelerate's ``accelerator.join_uneven_inputs``: with ``even_batches=False`` the processes may
get different numbers of batches, and torch's ``Join`` lets the processes that ran out shadow the
data-parallel collectives of those still training (`uneven_inputs`)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, ContextManager, Iterator, List, Optional, Tuple

from ..config import DistributedType

__all__ = ["uneven_inputs"]


@contextlib.contextmanager
def uneven_inputs(joinables: Any, even_batches: Optional[bool], default: bool, loaders: List[Any],
                  distributed_type: DistributedType, join: Callable[[Any], ContextManager[Any]]) -> Iterator[None]:
    """Accelerate 1.15's ``join_uneven_inputs``: on a data-parallel group (``MULTI_*``), the prepared
    map-style ``loaders`` take ``even_batches`` for the block when it is given (a warning names the
    others, which keep theirs) and, when the batches are uneven, torch's ``Join`` runs over
    ``joinables`` (the prepared models), through ``join`` (the backend loop's
    `unified.backend.TrainingLoop.join_uneven_inputs`). Elsewhere it does nothing (with Accelerate's warning, except
    with one process or on JAX, whose batches are always even).

    Example:
        >>> with uneven_inputs([model], False, True, loaders, DistributedType.MULTI_CPU,
        ...                    loop.join_uneven_inputs):  # doctest: +SKIP
        ...     train()
    """
    if not distributed_type.name.startswith("MULTI_"):
        if distributed_type not in (DistributedType.NO, DistributedType.JAX):  # (JAX: batches are always even)
            warnings.warn("Joining uneven inputs is only supported for multi-GPU training, as a result "
                          "`join_uneven_inputs` will have no effect.", stacklevel=3)
        yield
        return
    overridden: List[Tuple[Any, bool]] = []
    if even_batches is not None:
        others = False
        for loader in loaders:
            if not isinstance(getattr(loader, "even_batches", None), bool):
                others = True  # iterable data or a dispatched loader: as Accelerate's dispatcher
                continue
            overridden.append((loader, loader.even_batches))
            loader.even_batches = even_batches
        if others:
            warnings.warn("Overriding even_batches is only supported for map-style datasets, yet some dataloaders "
                          "given were iterable", stacklevel=3)
    else:
        even_batches = default
    try:
        if even_batches:
            yield
        else:
            with join(joinables):  # the backend's (torch's Join)
                yield
    finally:
        for loader, value in overridden:
            loader.even_batches = value
