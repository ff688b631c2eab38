"""The C library's calls that unified and its backends make (glibc on Linux), each looked up
once, at its first use, never at import: `c_function`, and `return_free_heap`.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable, Optional, Tuple

__all__ = ["c_function", "return_free_heap"]


@functools.lru_cache(maxsize=None)
def c_function(name: str, argtypes: Optional[Tuple[Any, ...]] = None,
               restype: Any = None) -> Optional[Callable[..., Any]]:
    """The C library's function ``name`` with these ctypes signatures, or None where the process's
    C library has none.

    Example:
        >>> madvise = c_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)
    """
    try:
        call = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    if argtypes is not None:
        call.argtypes, call.restype = argtypes, restype
    return call


def return_free_heap() -> None:
    """glibc's ``malloc_trim(0)``: the heap's free memory goes back to the system; nothing where
    the C library has no such call.

    Example:
        >>> return_free_heap()
    """
    trim = c_function("malloc_trim")
    if trim is not None:
        trim(0)
