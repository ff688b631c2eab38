"""The stable toolkit for backend authors: every helper a backend package may import from
`unified`, in one place, kept stable across versions (the rest of `unified` may move).

What a backend implements is declared in `unified.backend` (the contract); what helps it
implement it is here: its place in the group (`ProcessEnvironment`), how its group is started
(`Launcher`, `LaunchPlan`, `Worker`), arrays as checkpoint bytes (`export_numpy`,
`numpy_dtype`, `DTYPE_NAMES`), the errors it raises (`timeout_error` builds the
`BarrierTimeout` of a collective that timed out; `see` links a message to its troubleshooting
section), the numbering that keeps two Accelerators' keys apart (`next_instance`), and handles
that must outlive a broken group (`keep_alive_forever`). See docs/adding-a-backend.md.

Example:
    >>> from unified.backend.toolkit import ProcessEnvironment, export_numpy, next_instance
    >>> export_numpy(np.ones(2, np.float32))[:2]
    ('F32', (2,))
"""
from __future__ import annotations

import ctypes
import itertools
from typing import Any, Optional, Sequence

from ..checkpoint.safetensors_io import DTYPE_NAMES, export_numpy, numpy_dtype, safetensors_dtype
from ..errors import BackendUnavailable, BarrierTimeout, CheckpointError, DistributedError, first_line, see
from ..launcher.parent_watch import PARENT_VARIABLE, watched
from ..launcher.plan import Launcher, LaunchPlan
from ..launcher.processes import Worker
from ..runtime.environment import ProcessEnvironment
from ..runtime.libc import return_free_heap
from ..runtime.network import route_to
from ..runtime.watchdog import CHANNEL_KINDS
from .registry import BackendSpec

__all__ = ["BackendSpec", "ProcessEnvironment", "Launcher", "LaunchPlan", "Worker", "PARENT_VARIABLE", "watched",
           "DTYPE_NAMES", "export_numpy", "numpy_dtype", "safetensors_dtype", "CHANNEL_KINDS", "route_to",
           "return_free_heap", "next_instance", "keep_alive_forever", "timeout_error", "BackendUnavailable",
           "BarrierTimeout", "CheckpointError", "DistributedError", "first_line", "see"]

# Processes create their Accelerators in the same order, so numbering the backends of one
# process keeps two Accelerators' rendezvous keys apart and equal across processes.
_INSTANCES = itertools.count()


def next_instance() -> int:
    """A number for a new backend object, the same on every process for the n-th Accelerator.

    Example:
        >>> self._prefix = f"torch-{next_instance()}/"   # doctest: +SKIP
    """
    return next(_INSTANCES)


def keep_alive_forever(*handles: Any) -> None:
    """Never let ``handles`` be destroyed: their destructors would wait for a peer that is gone
    (a failed collective, a coordination service that left) and hang this process at exit.

    Example:
        >>> keep_alive_forever(store)   # doctest: +SKIP
    """
    for handle in handles:
        if handle is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(handle))


def timeout_error(backend: Any, key: str, timeout: float, cause: BaseException,
                  missing: Optional[Sequence[int]], source: str) -> BarrierTimeout:
    """The `BarrierTimeout` a backend raises for collective ``key``, quoting ``source``'s error.

    Example:
        >>> raise timeout_error(self, key, timeout, err, missing=None, source="gloo")   # doctest: +SKIP
    """
    return BarrierTimeout(key, timeout, missing, process_index=backend.process_index,
                          num_processes=backend.num_processes, detail=f"{source}: {first_line(cause)}")
