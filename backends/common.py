"""Helpers that every backend package uses, written once (framework-free)."""
from __future__ import annotations

import ctypes
import itertools
from typing import Any, Optional, Sequence

from unified.errors import BarrierTimeout, first_line

# Processes create their Accelerators in the same order, so numbering the backends of one
# process keeps two Accelerators' rendezvous keys apart and equal across processes.
_INSTANCES = itertools.count()


def next_instance() -> int:
    """A number for a new backend object, the same on every process for the n-th Accelerator."""
    return next(_INSTANCES)


def keep_alive_forever(*handles: Any) -> None:
    """Never let ``handles`` be destroyed: their destructors would wait for a peer that is gone
    (a failed collective, a coordination service that left) and hang this process at exit."""
    for handle in handles:
        if handle is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(handle))


def timeout_error(backend: Any, key: str, timeout: float, cause: BaseException,
                  missing: Optional[Sequence[int]], source: str) -> BarrierTimeout:
    """The `BarrierTimeout` a backend raises for collective ``key``, quoting ``source``'s error."""
    return BarrierTimeout(key, timeout, missing, process_index=backend.process_index,
                          num_processes=backend.num_processes, detail=f"{source}: {first_line(cause)}")
