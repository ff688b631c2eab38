"""Accelerate's function forms of the collectives (``accelerate.utils.gather_object``,
``broadcast_object_list``, ``gather``, ``reduce``, ``broadcast``, ``pad_across_processes``) and
its memory helpers (``release_memory``, ``find_executable_batch_size``). The collectives act
through the process's live `Accelerator` (the newest one not ended), as Accelerate's act
through its process-wide state; objects travel as JSON, never pickled. The Accelerator registers
itself here when it is made, with the parts these functions use (`unified.compat.host.HostParts`),
and says when it has ended."""
from __future__ import annotations

import functools
import gc
import inspect
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

from ..errors import see

if TYPE_CHECKING:
    from ..accelerator import Accelerator
    from .host import HostParts

__all__ = ["current", "current_or_none", "set_current", "set_ended", "gather_object", "broadcast_object_list",
           "gather", "reduce", "broadcast", "pad_across_processes", "release_memory", "find_executable_batch_size"]

# (the Accelerator, its parts), both weakly: a registered Accelerator may still be collected
_Live = Tuple["weakref.ReferenceType[Accelerator]", "weakref.ReferenceType[HostParts]"]
_current: Optional[_Live] = None
# the Accelerator a thread made itself comes first (the in-memory test groups run one per thread)
_made_here = threading.local()
_ended: "weakref.WeakSet[Accelerator]" = weakref.WeakSet()


def set_current(accelerator: Optional["Accelerator"], parts: Optional["HostParts"] = None) -> None:
    """Called by `Accelerator` when it is made: ``accelerator`` and the ``parts`` it is composed
    of become this thread's (and the process's) live ones; ``None`` (or no parts) forgets them."""
    global _current
    live = accelerator is not None and parts is not None
    _current = _made_here.ref = (weakref.ref(accelerator), weakref.ref(parts)) if live else None


def set_ended(accelerator: "Accelerator") -> None:
    """Called by `Accelerator.end_training`: ``accelerator`` is no longer live."""
    _ended.add(accelerator)


def _live() -> Optional[Tuple["Accelerator", "HostParts"]]:
    """The live Accelerator (see `current_or_none`) and its parts."""
    ref = getattr(_made_here, "ref", _current)
    accelerator, parts = (ref[0](), ref[1]()) if ref is not None else (None, None)
    if accelerator is None or parts is None or accelerator in _ended:
        return None
    return accelerator, parts


def current_or_none() -> Optional["Accelerator"]:
    """The newest Accelerator this thread made (if it made one), else the process's newest;
    None once that one has ended."""
    live = _live()
    return live[0] if live is not None else None


def current() -> "Accelerator":
    """The process's live `Accelerator`; a clear error before one is made."""
    return _current_live()[0]


def _current_live() -> Tuple["Accelerator", "HostParts"]:
    live = _live()
    if live is None:
        raise RuntimeError("unified.utils collectives need a live Accelerator in this process: create "
                           "Accelerator(...) first (and do not call them after end_training())."
                           + see("no-accelerator"))
    return live


def gather_object(object: Any) -> Any:
    """Accelerate's ``gather_object``: one process: ``object`` as it is; several: every process's
    list (or tuple) concatenated in process order. JSON-serialisable values only.

    Example:
        >>> gather_object([accelerator.process_index])      # two processes: [0, 1]
    """
    accelerator = current()
    if accelerator.num_processes == 1:
        return object
    return [item for part in accelerator.gather_object(list(object)) for item in part]


def broadcast_object_list(object_list: List[Any], from_process: int = 0) -> List[Any]:
    """Accelerate's ``broadcast_object_list``: ``object_list``'s items replaced in place by
    process ``from_process``'s; returns the list. JSON-serialisable values only.

    Example:
        >>> broadcast_object_list([accelerator.process_index])   # [0] on every process
    """
    accelerator, parts = _current_live()
    if accelerator.num_processes > 1:
        mine = list(object_list) if accelerator.process_index == from_process else None
        object_list[:] = parts.collectives.broadcast_json(mine, src=from_process, operation="broadcast_object_list")
    return object_list


def gather(tensor: Any) -> Any:
    """`Accelerator.gather` of the live Accelerator.

    Example:
        >>> gather(loss)
    """
    return current().gather(tensor)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """`Accelerator.reduce` of the live Accelerator; ``"mean"`` by default, as Accelerate's function.

    Example:
        >>> reduce(loss)
    """
    return current().reduce(tensor, reduction, scale)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """`Accelerator.broadcast` of the live Accelerator.

    Example:
        >>> broadcast(weights, from_process=0)
    """
    return current().broadcast(tensor, from_process)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """`Accelerator.pad_across_processes` of the live Accelerator.

    Example:
        >>> pad_across_processes(predictions, dim=1, pad_index=-100)
    """
    return current().pad_across_processes(tensor, dim, pad_index, pad_first)


def release_memory(*objects: Any) -> List[None]:
    """``None`` for each object, after a garbage collection and, with a live Accelerator, handing
    the device's cached memory back (Accelerate's ``release_memory``).

    Example:
        >>> a, b = release_memory(a, b)
    """
    gc.collect()
    live = _live()
    if live is not None:
        live[1].backend.release_device_memory()
    return [None] * len(objects)


# What torch's and JAX's out-of-memory errors say (Accelerate's list, and XLA's)
_OUT_OF_MEMORY = (" out of memory.", "MPS backend out of memory", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                  "DefaultCPUAllocator: can't allocate memory", "RESOURCE_EXHAUSTED: Out of memory")


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error of the device (a smaller batch may fit).

    Example:
        >>> should_reduce_batch_size(RuntimeError("CUDA out of memory."))
        True
    """
    text = exception.args[0] if isinstance(exception, RuntimeError) and len(exception.args) == 1 else None
    return isinstance(text, str) and any(marker in text for marker in _OUT_OF_MEMORY)


def find_executable_batch_size(function: Optional[Callable[..., Any]] = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Optional[Callable[[], int]] = None) -> Any:
    """Accelerate's decorator: call ``function(batch_size, *args)`` from ``starting_batch_size``,
    and after each out-of-memory error again with ``int(0.9 * batch_size)`` (or what
    ``reduce_batch_size_fn()`` returns) until it fits; `RuntimeError` once the size reaches 0.

    Example:
        >>> @find_executable_batch_size(starting_batch_size=64)
        ... def train(batch_size, model):
        ...     ...
        >>> train(model)   # no batch size: the decorator passes it
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size

    def smaller() -> int:
        nonlocal batch_size
        batch_size = int(batch_size * 0.9)
        return batch_size

    reduce_size = reduce_batch_size_fn or smaller

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            passed = ", ".join(f"{name}={value}" for name, value in zip(params[1:], args[1:]))
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first argument when called. "
                            f"Remove it, as the decorator passes it: `{function.__name__}({passed})`."
                            + see("batch-size-search"))
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero." + see("batch-size-search"))
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - only out-of-memory errors are retried
                if not should_reduce_batch_size(err):
                    raise
                release_memory()
                batch_size = reduce_size()

    return decorator
