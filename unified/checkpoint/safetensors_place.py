"""Where a verified read puts each array: memory the caller gives (a live tensor's bytes), a
hand-off through one staging buffer (a JAX array replaced one at a time) or through two taking
turns (`Overlapped`: a copy to a GPU runs while the next array is read), or fresh private
memory of its own, aligned and in ordinary pages (`private_array`).
"""
from __future__ import annotations

import contextlib
import functools
import math
import mmap
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .safetensors_format import _ALIGN, _in_file_order, _lay_out


class Placing:
    """Where `read_placed` and `read_stream_placed` put each array: the memory ``into`` gives for
    its name when that is a writable contiguous uint8 view of exactly its bytes, else fresh
    private memory (`private_array`). ``placed``: the names read into place.

    ``into`` may also give a callable ``hand_off(array)`` (a JAX load replaces each live array
    by a new one): such arrays are read one after another into one staging buffer of the largest
    one's size, and each is handed off as soon as its bytes are read and hashed (the file's
    checksum is compared after the last array); ``hand_off`` must copy what it keeps before it
    returns, since the next array overwrites the buffer. They count as placed. (Handing off on a
    thread of its own while the next array is read was measured slower: 2.3-2.7 s against
    1.5-1.8 s for a 1.5 GB JAX state on 2 cores.) A `KeepsHost` hand-off keeps the array itself
    (a JAX array on the CPU made over its memory): each such array gets fresh memory of its own,
    made just before its bytes are read, and is never written again. An `Overlapped` hand-off
    only starts a copy: such arrays take turns in two staging buffers, so that the next one is
    read and hashed while the last one's copy runs; a buffer is written again only once the copy
    from it was waited for, and the readers wait for every copy before they return
    (`copies_waited`)."""

    def __init__(self, into: Mapping[str, Any]) -> None:
        self.into = into
        self.placed: List[str] = []
        self._handed: Dict[int, Callable[[np.ndarray], None]] = {}  # id(staging view or own array) -> hand_off
        self.stages = False  # some array goes through a staging buffer: one array after another
        self._turns: List[np.ndarray] = []  # the two staging buffers of `Overlapped` arrays
        self._copying: List[Optional[Callable[[], None]]] = [None, None]  # each one's copy still to wait for
        self._next_turn = 0
        self._overlapped: Dict[int, Tuple[int, Overlapped]] = {}  # id(view) -> (its buffer, hand-off)

    def lay_out(self, header: str, data_size: int, path: str) -> Tuple[Dict[str, Any], List[Tuple[int, Any]]]:
        """The arrays of a file's entries (``header``: its text, as `_header_text` gives it; a
        `_Staged` for those made only when read: see `memory_for`) and the same in file order
        with their offsets."""
        arrays, starts = _lay_out(header, data_size, path, self._make)
        staged = {key: spec for key, spec in arrays.items() if isinstance(spec, _Staged) and spec.shares_one}
        overlapped = [spec for spec in arrays.values() if isinstance(spec, _Staged) and spec.overlapped]
        if overlapped:
            largest = max(spec.nbytes for spec in overlapped)
            self._turns = [_staging(overlapped[0].hand_off, largest) for _ in range(2)]
        if staged:
            buffer = private_array(np.dtype(np.uint8), (max(spec.nbytes for spec in staged.values()),))
            for key, spec in staged.items():
                view = buffer[:spec.nbytes].view(spec.dtype).reshape(spec.shape)
                arrays[key] = view
                self._handed[id(view)] = spec.hand_off
        return arrays, _in_file_order(arrays, starts)

    def memory_for(self, array: Any) -> np.ndarray:
        """The memory an entry of `lay_out` is read into: its own, made now, for a `KeepsHost`;
        the next of the two staging buffers for an `Overlapped` one, once the copy from it ran
        (the arrays of a file are read one after another: ``stages``)."""
        if not isinstance(array, _Staged):
            return array
        if array.overlapped:
            turn = self._next_turn
            self._next_turn = 1 - turn
            self._wait_for(turn)
            view = self._turns[turn][:array.nbytes].view(array.dtype).reshape(array.shape)
            self._overlapped[id(view)] = (turn, array.hand_off)
            return view
        own = private_array(array.dtype, array.shape)
        self._handed[id(own)] = array.hand_off
        return own

    def done(self, array: np.ndarray) -> None:
        """After ``array``'s last byte was read and hashed: hand it off if it is staged (an
        `Overlapped` one: its copy started, waited for before its buffer is written again)."""
        turn_and_hand_off = self._overlapped.pop(id(array), None)
        if turn_and_hand_off is not None:
            turn, hand_off = turn_and_hand_off
            self._copying[turn] = hand_off.replace_async(array)
            return
        hand_off = self._handed.get(id(array))
        if hand_off is not None:
            if isinstance(hand_off, KeepsHost):  # its memory is the new array's: no id of it is kept
                del self._handed[id(array)]
            hand_off(array)

    @contextlib.contextmanager
    def copies_waited(self) -> Iterator[None]:
        """Around a read: on the way out, wait for every copy still reading a staging buffer
        (`Overlapped`), also when the read fails (its error is raised then, not a copy's).

        Example:
            >>> with placing.copies_waited():
            ...     _stream_into(handle, spans, digest, path, size, chunk, placing.done, placing.memory_for)
        """
        try:
            yield
        except BaseException:
            for turn in range(2):
                with contextlib.suppress(Exception):
                    self._wait_for(turn)
            raise
        try:
            self._wait_for(0)
        finally:
            self._wait_for(1)

    def _wait_for(self, turn: int) -> None:
        wait, self._copying[turn] = self._copying[turn], None
        if wait is not None:
            wait()

    def _make(self, key: str, dtype: np.dtype, shape: Tuple[int, ...], start: int) -> Any:
        target = self.into.get(key)
        if callable(target):
            self.placed.append(key)
            staged = _Staged(dtype, tuple(shape), target)
            self.stages = self.stages or not staged.own
            return staged
        if (target is not None and target.dtype == np.uint8 and target.flags.c_contiguous and target.flags.writeable
                and target.nbytes == math.prod(shape) * dtype.itemsize):
            self.placed.append(key)
            return target
        return private_array(dtype, shape)

    def fresh(self, arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        placed = set(self.placed)
        return {key: array for key, array in arrays.items() if key not in placed}


class KeepsHost:
    """An ``into`` value of `read_placed` and `read_stream_placed`: ``hand_off(array)`` keeps
    ``array`` itself (JAX makes a CPU array over suitably aligned host memory without a copy),
    so the array is read into fresh memory of its own rather than the shared staging buffer,
    and that memory is never written again.

    Example:
        >>> arrays, placed = read_placed(path, size, checksum, {"w": KeepsHost(slot.replace)})
    """

    def __init__(self, hand_off: Callable[[np.ndarray], None]) -> None:
        self.hand_off = hand_off

    def __call__(self, array: np.ndarray) -> None:
        self.hand_off(array)


class Overlapped:
    """An ``into`` value of `read_placed` and `read_stream_placed` whose hand-off only starts a
    copy (a torch tensor on a GPU filled from pinned memory on a stream of its own):
    ``replace_async(array)`` returns a function that waits until ``array``'s memory is no longer
    read, or None when the copy is done already (`Replaceable.replace_async`). Such arrays take
    turns in two staging buffers, each of ``staging(nbytes)`` when it gives one (pinned memory),
    else of `private_array`; called as a plain hand-off, it waits for its copy.

    Example:
        >>> into = {"w": Overlapped(handle.replace_async, handle.staging_buffer)}
        >>> arrays, placed = read_placed(path, size, checksum, into)   # every copy waited for on return
    """

    def __init__(self, replace_async: Callable[[np.ndarray], Optional[Callable[[], None]]],
                 staging: Callable[[int], Optional[np.ndarray]] = lambda nbytes: None) -> None:
        self.replace_async, self.staging = replace_async, staging

    def __call__(self, array: np.ndarray) -> None:
        wait = self.replace_async(array)
        if wait is not None:
            wait()


def _staging(hand_off: Overlapped, nbytes: int) -> np.ndarray:
    """A staging buffer of ``nbytes`` for `Overlapped` arrays: the hand-off's own, else private memory."""
    buffer = hand_off.staging(nbytes)
    if buffer is None:
        return private_array(np.dtype(np.uint8), (nbytes,))
    return buffer.reshape(-1).view(np.uint8)[:nbytes]


class _Staged:
    """An array `Placing` reads into its staging buffer (``shares_one``), memory of its own
    (``own``: a `KeepsHost`) or one of two buffers taking turns (``overlapped``), and hands off."""

    def __init__(self, dtype: np.dtype, shape: Tuple[int, ...], hand_off: Callable[[np.ndarray], None]) -> None:
        self.dtype, self.shape, self.hand_off = dtype, shape, hand_off
        self.own = isinstance(hand_off, KeepsHost)
        self.overlapped = isinstance(hand_off, Overlapped)
        self.shares_one = not (self.own or self.overlapped)
        self.nbytes = math.prod(shape) * dtype.itemsize


def private_array(dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    """Fresh writable memory for one array, its first byte at a multiple of _ALIGN (XLA makes a
    CPU array over host memory without a copy only then; NumPy's own arrays are 16-byte aligned).
    From the process's heap, which reuses memory freed by the state this load replaces: on some
    machines (VMs above all) the first touch of memory new to the process costs several times the
    copy into it (docs/benchmarks/checkpoint.md). In ordinary pages, as torch's and XLA's own
    tensors are (`_without_numpys_huge_pages`).

    Example:
        >>> buffer = private_array(np.dtype(np.float32), (1024, 1024))   # then jax.device_put(buffer)
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # no byte to align or share: one array object, not two (a header may list a million)
        return np.empty(tuple(shape), dtype)
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    _without_numpys_huge_pages(raw)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


_PAGE = mmap.PAGESIZE
_MADV_NOHUGEPAGE = 15


@functools.lru_cache(maxsize=1)
def _madvise_where_huge_pages_are_asked_for() -> Optional[Callable[..., int]]:
    """The C library's ``madvise`` where the kernel gives transparent huge pages only to memory
    that asks for them (Linux's ``madvise`` policy, the usual default), else None. Looked up at
    the first large allocation, not at import."""
    import ctypes

    from ..runtime.libc import c_function

    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as handle:
            if "[madvise]" not in handle.read():
                return None
    except OSError:
        return None
    # the C library's (Linux: whenever the policy file exists)
    return c_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)


def _without_numpys_huge_pages(array: np.ndarray) -> None:
    """Take back NumPy's request for huge pages (it makes one for every array of 4 MiB or more)
    before the memory is first touched, so that a load's fresh memory gets the pages the
    framework's own tensors get (torch and XLA ask for none). Filling fresh huge pages once can
    cost more than it saves: a fault that must first compact memory stalls, and on some VMs a
    fresh huge page costs 3-6 times as much as ordinary ones (docs/benchmarks/checkpoint.md).
    Nothing where the system's policy is not ``madvise`` (``always``: the administrator's choice
    stands)."""
    madvise = _madvise_where_huge_pages_are_asked_for() if array.nbytes >= (4 << 20) else None
    if madvise is None:
        return
    first = -(-array.ctypes.data // _PAGE) * _PAGE
    last = (array.ctypes.data + array.nbytes) // _PAGE * _PAGE
    if last > first:
        madvise(first, last - first, _MADV_NOHUGEPAGE)
