"""Reading safetensors files back verified: every byte hashed as it is read, into private memory
of each array (`read`), into memory the caller gives (`read_placed`, `read_into`, see
`safetensors_place`), from a stream (`read_stream*`: an object store), or only the header
(`header_of`, `describe`). No checkpoint file is ever mapped.
"""
from __future__ import annotations

import concurrent.futures
import io
import math
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import xxhash

from ..errors import CheckpointError, see
from .safetensors_format import (
    _ended,
    _header_length,
    _header_text,
    _in_file_order,
    _lay_out,
    _open_for_reading,
    _shown,
    checksum_mismatch,
    safetensors_dtype,
    size_mismatch,
)
from .safetensors_place import KeepsHost, Placing

_READ_CHUNK = 16 << 20  # reading: each chunk is hashed right after it was read, while cache-warm
_READERS = max(1, min(4, os.cpu_count() or 1))  # threads reading one file's chunks
_READ_AHEAD = 64 << 20  # how far those threads read ahead of the hashing
_MAX_IOV = 512  # buffers per preadv (IOV_MAX is 1024 on Linux)



def read_stream(handle: Any, path: str, size: int, checksum: str, chunk: int = _READ_CHUNK) -> Dict[str, np.ndarray]:
    """`read_stream_placed` without places: every array in fresh memory."""
    return read_stream_placed(handle, path, size, checksum, {}, chunk)[0]


def read_stream_placed(handle: Any, path: str, size: int, checksum: str, into: Mapping[str, Any],
                       chunk: int = _READ_CHUNK) -> Tuple[Dict[str, np.ndarray], List[str]]:
    """`read` from a binary file object read in order (an object store's download): the header,
    then each array's bytes straight into its private memory, every chunk hashed as it arrives;
    ``size`` is the object's size, already compared with the manifest's. Raises `CheckpointError`
    naming ``path`` when the stream ends early, the file is not well-formed or its checksum differs.
    The arrays named in ``into`` are read into the memory given there, as `read_placed` does.

    Example:
        >>> with open("model.safetensors", "rb") as f:
        ...     arrays, placed = read_stream_placed(f, "model.safetensors", 140, "0123456789abcdef", {})
    """
    digest = xxhash.xxh3_64()
    placing = Placing(into)
    length, header = _stream_header(handle, path, size, digest)
    arrays, spans = placing.lay_out(header, size - 8 - length, path)
    with placing.copies_waited():
        _stream_into(handle, spans, digest, path, size, chunk, placing.done, placing.memory_for)
    if digest.hexdigest() != checksum:
        raise checksum_mismatch(path)
    return placing.fresh(arrays), placing.placed


def read_stream_into(handle: Any, path: str, size: int,
                     destination: Callable[[str, str, Tuple[int, ...]], Optional[np.ndarray]],
                     chunk: int = _READ_CHUNK) -> Optional[Dict[str, object]]:
    """`read_into` from a binary file object read in order (an object store's download) of
    ``size`` bytes: every array straight into the memory ``destination`` gives, every byte
    hashed; ``{"size", "xxh3"}`` for the caller to compare, or ``None`` (only the header was
    read) when ``destination`` has no memory for an entry.

    Example:
        >>> out = np.empty(3, np.float32)
        >>> with open("model.safetensors", "rb") as f:
        ...     read_stream_into(f, "model.safetensors", 140, lambda key, dtype, shape: out)
    """
    digest = xxhash.xxh3_64()
    length, header = _stream_header(handle, path, size, digest)
    arrays, starts = _lay_out(header, size - 8 - length, path, _checked_destination(destination))
    if any(array is None for array in arrays.values()):
        return None
    _stream_into(handle, _in_file_order(arrays, starts), digest, path, size, chunk)
    return {"size": size, "xxh3": digest.hexdigest()}


def read_stream_handed(handle: Any, path: str, size: int, hand_offs: Mapping[str, Callable[[np.ndarray], None]],
                       chunk: int = _READ_CHUNK) -> Dict[str, object]:
    """Stream a file of ``size`` bytes once, in file order, handing each array named in
    ``hand_offs`` over as soon as its bytes are read and hashed: each is read into fresh memory
    of its own, made just before its bytes (`KeepsHost`), so a caller that puts every array in
    place as it comes holds one array beyond the live state, not a copy of the file. Returns
    ``{"size", "xxh3"}`` for the caller to compare once the file ended (a hand-off may have run
    before a mismatch is known). Raises `CheckpointError` naming ``path`` when the stream ends
    early or the file is not well-formed; an entry not named is read into fresh memory and dropped.

    Example:
        >>> with open("shard-00000.safetensors", "rb") as f:
        ...     read_stream_handed(f, "shard-00000.safetensors", 4200, {"w@0,0": put_in_place})
        {'size': 4200, 'xxh3': '...'}
    """
    digest = xxhash.xxh3_64()
    placing = Placing({key: KeepsHost(hand_off) for key, hand_off in hand_offs.items()})
    length, header = _stream_header(handle, path, size, digest)
    _, spans = placing.lay_out(header, size - 8 - length, path)
    _stream_into(handle, spans, digest, path, size, chunk, placing.done, placing.memory_for)
    return {"size": size, "xxh3": digest.hexdigest()}


def _stream_header(handle: Any, path: str, size: int, digest: Any) -> Tuple[int, str]:
    """The header's length and text (`_header_text`), read from the start of a stream of ``size``
    bytes and hashed."""
    def exact(count: int) -> bytes:
        data = handle.read(count)
        if len(data) != count:
            raise CheckpointError(f"{path}: the object ended after fewer bytes than the {size} it has; nothing was "
                                  "restored." + see("file-ended"))
        digest.update(data)
        return data

    length = _header_length(exact(min(8, size)), size - 8, path)
    return length, _header_text(exact(length), path)


def _stream_into(handle: Any, spans: Sequence[Tuple[int, Any]], digest: Any, path: str, size: int,
                 chunk: int, done: Callable[[np.ndarray], None] = lambda array: None,
                 memory_for: Callable[[Any], np.ndarray] = lambda array: array) -> None:
    """Read the data section from ``handle`` into ``spans`` (the arrays in file order, tiling it;
    ``memory_for`` gives each one's memory just before it is read), hashing each chunk;
    ``done(array)`` once each array is read and hashed."""
    for _, planned in spans:
        array = memory_for(planned)
        view = memoryview(array.reshape(-1).view(np.uint8)) if array.nbytes else memoryview(b"")
        for start in range(0, len(view), chunk):
            part = view[start:start + chunk]
            got = handle.readinto(part)
            while got is not None and got < len(part):
                more = handle.readinto(part[got:])
                if not more:
                    break
                got += more
            if got != len(part):
                raise CheckpointError(f"{path}: the object ended before its {size} bytes were read; nothing was "
                                      "restored." + see("file-ended"))
            digest.update(part)
        done(array)


def _checked_destination(destination: Callable[[str, str, Tuple[int, ...]], Optional[np.ndarray]]
                         ) -> Callable[[str, np.dtype, Tuple[int, ...], int], Optional[np.ndarray]]:
    """``destination`` as `_lay_out` calls it, refusing memory that is not exactly the entry's
    bytes, writable and contiguous."""
    def make(key: str, dtype: np.dtype, shape: Tuple[int, ...], start: int) -> Optional[np.ndarray]:
        target = destination(key, safetensors_dtype(dtype), tuple(shape))
        if target is not None and (not target.flags.c_contiguous or not target.flags.writeable
                                   or target.nbytes != math.prod(shape) * dtype.itemsize):
            raise ValueError(f"the destination of {_shown(key)} is not {math.prod(shape) * dtype.itemsize} "
                             "writable contiguous bytes")
        return target

    return make


def header_of(read_at: Callable[[int, int], bytes], path: str, size: int
              ) -> Tuple[int, Dict[str, Tuple[str, Tuple[int, ...], int, int]], Dict[str, str]]:
    """A safetensors file's data start, ``{name: (safetensors dtype, shape, start, end)}`` (offsets
    within the data section) and ``__metadata__``, from its header alone (checked as `read`
    checks it, parsed once, within 10 times its size in memory); ``read_at(offset, count)``
    returns the file's bytes there.

    Example:
        >>> with open("model.safetensors", "rb") as f:
        ...     header_of(lambda at, count: os.pread(f.fileno(), count, at), "model.safetensors", 140)
        (80, {'w': ('F32', (3,), 0, 12)}, {})
    """
    metadata: Dict[str, str] = {}  # the header is parsed once, by the bounded parser (`_header_entries`)
    start, entries = _header_at(read_at, path, size, _span, metadata)
    return start, entries, metadata


def _span(key: str, dtype: np.dtype, shape: Tuple[int, ...], start: int) -> Tuple[str, Tuple[int, ...], int, int]:
    """An entry as `header_of` gives it: ``(safetensors dtype, shape, start, end)``."""
    return safetensors_dtype(dtype), tuple(shape), start, start + math.prod(shape) * dtype.itemsize


# The first request for a header asks for this much: one request for the header of any file with
# up to a few hundred arrays (each request to an object store costs its latency; Hugging Face's
# safetensors metadata reader asks for 100 kB first for the same reason), a second one beyond.
_FIRST_HEADER_READ = 64 << 10


def _header_at(read_at: Callable[[int, int], bytes], path: str, size: int,
               make: Callable[[str, np.dtype, Tuple[int, ...], int], Any],
               metadata: Optional[Dict[str, str]] = None) -> Tuple[int, Dict[str, Any]]:
    """The data start and ``{name: make(name, dtype, shape, start)}`` of a safetensors file read
    with ``read_at`` (checked as `read` checks it); ``metadata`` gets its ``__metadata__``."""
    asked = min(_FIRST_HEADER_READ, size)
    first = read_at(0, asked)
    length = _header_length(first[:8], size - 8, path)
    header = first[8:8 + length]
    del first
    if len(header) < length and len(header) == asked - 8:  # a header longer than the first read
        header += read_at(asked, 8 + length - asked)
    if len(header) != length:
        raise CheckpointError(f"{path}: ended inside its header; nothing was restored." + see("file-ended"))
    text = _header_text(header, path)
    del header  # from here on only the text: the entries are built while one copy of the header is held
    return 8 + length, _lay_out(text, size - 8 - length, path, make, metadata)[0]


def describe(read_at: Callable[[int, int], bytes], path: str, size: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """``{name: (safetensors dtype, shape)}`` of every array of a safetensors file of ``size``
    bytes, from its header alone (checked as `read` checks it); ``read_at(offset, count)``
    returns the file's bytes there.

    Example:
        >>> with open("model.safetensors", "rb") as f:
        ...     describe(lambda at, count: os.pread(f.fileno(), count, at), "model.safetensors", 140)
        {'w': ('F32', (3,))}
    """
    return _header_at(read_at, path, size, lambda key, dtype, shape, start: (safetensors_dtype(dtype), tuple(shape)))[1]


def header_of_file(path: str,
                   name: Optional[str] = None) -> Tuple[int, int, Dict[str, Tuple[str, Tuple[int, ...], int, int]]]:
    """A regular file's size, then `header_of`'s data start and entries (never a link, FIFO or
    device); ``name``: what its errors call the file (a local copy's object), else ``path``.

    Example:
        >>> header_of_file("model.safetensors")
        (140, 80, {'w': ('F32', (3,), 0, 12)})
    """
    fd = _open_for_reading(path)
    try:
        size = os.fstat(fd).st_size
        start, entries, _ = header_of(lambda at, count: os.pread(fd, count, at), name or path, size)
    finally:
        os.close(fd)
    return size, start, entries


def describe_file(path: str, size: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """`describe` of a regular file (never a link, FIFO or device) of ``size`` bytes (another
    size is refused: a file cut short is found before any of it is read)."""
    fd = _open_for_reading(path)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise size_mismatch(path, actual, size)
        return describe(lambda at, count: os.pread(fd, count, at), path, size)
    finally:
        os.close(fd)


def read(path: str, size: int, checksum: str) -> Dict[str, np.ndarray]:
    """Read and verify one file; returns writable NumPy arrays, each in private memory of its own
    (`read_placed` without places).

    One pass over the bytes: the header is read and checked first, then every array gets fresh
    memory of this process (`private_array`) and the data is read straight into it, each chunk
    hashed right after it was read, while it is still in the CPU's cache. The arrays hold nothing
    but their own bytes, so the objects may keep them without a copy, what they get is exactly
    what was verified, and a file that changes afterwards (or meanwhile: a short read, another
    checksum) changes nothing they hold. No checkpoint file is ever mapped. Raises
    `CheckpointError` naming the file when it is missing, not a regular file (a link, FIFO,
    device...), of another size, ends while it is read, fails its checksum, or is not well-formed.
    """
    return read_placed(path, size, checksum, {})[0]


def read_placed(path: str, size: int, checksum: str, into: Mapping[str, Any]
                ) -> Tuple[Dict[str, np.ndarray], List[str]]:
    """`read`, with the arrays named in ``into`` read straight into the memory given there (a
    writable contiguous uint8 view of exactly the entry's bytes, such as a live tensor's), or
    handed off one by one through a staging buffer (a callable: see `Placing`); returns the
    other arrays (fresh memory) and the names read into place. The checksum is compared once
    the whole file is read: when it fails, the places hold bytes that were not verified, and
    the caller must say so.

    Example:
        >>> weight = np.zeros(12, np.uint8)      # the memory of a float32 [3] tensor
        >>> arrays, placed = read_placed("model.safetensors", 140, "0123456789abcdef", {"w": weight})
    """
    placing = Placing(into)
    fd = _open_for_reading(path)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise size_mismatch(path, actual, size)
        if size == 0:
            raise CheckpointError(f"{path}: empty file." + see("empty-file"))
        digest = xxhash.xxh3_64()
        try:
            length, header = _read_header(fd, path, size, digest)
            arrays, spans = placing.lay_out(header, size - 8 - length, path)
        except CheckpointError as err:  # a damaged file is a checksum mismatch rather than a bad header
            if "file ended" not in str(err) and _whole_file_checksum(fd, size) != checksum:
                raise checksum_mismatch(path) from err
            raise
        if placing.stages:  # one array after another through the staging buffer
            os.lseek(fd, 8 + length, os.SEEK_SET)
            with io.FileIO(fd, "rb", closefd=False) as handle, placing.copies_waited():
                _stream_into(handle, spans, digest, path, size, _READ_CHUNK, placing.done, placing.memory_for)
        else:
            _read_into(fd, 8 + length, spans, digest, path, size, placing.memory_for, placing.done)
    finally:
        os.close(fd)
    if digest.hexdigest() != checksum:
        raise checksum_mismatch(path)
    return placing.fresh(arrays), placing.placed


def read_into(path: str, destination: Callable[[str, str, Tuple[int, ...]], Optional[np.ndarray]]
              ) -> Optional[Dict[str, object]]:
    """Read a whole safetensors file straight into arrays the caller gives, hashing every byte
    in the same pass, as `read` does; returns ``{"size", "xxh3"}`` of the file for the caller to
    compare with what it expects (nothing is compared here: the arrays must be fresh memory
    that nobody uses until the caller has). ``destination(key, safetensors dtype, shape)``
    gives a writable C-contiguous array of exactly that entry's bytes, or ``None``: then no data
    is read and the result is ``None`` (the file is left to another reader). Raises
    `CheckpointError` naming the file when it cannot be opened, is not well-formed, or ends
    while it is read.

    Example:
        >>> out = np.empty(3, np.float32)
        >>> read_into("model.safetensors", lambda key, dtype, shape: out if key == "w" else None)
    """
    fd = _open_for_reading(path)
    try:
        size = os.fstat(fd).st_size
        digest = xxhash.xxh3_64()
        length, header = _read_header(fd, path, size, digest)

        arrays, starts = _lay_out(header, size - 8 - length, path, _checked_destination(destination))
        if any(array is None for array in arrays.values()):
            return None
        _read_into(fd, 8 + length, _in_file_order(arrays, starts), digest, path, size)
    finally:
        os.close(fd)
    return {"size": size, "xxh3": digest.hexdigest()}


def read_range_into(path: str, start: int, out: np.ndarray) -> None:
    """``out.nbytes`` bytes of the file ``path`` from byte ``start`` into ``out`` (contiguous),
    without a copy: a sharded load's second pass over its verified private copy.

    Example:
        >>> out = private_array(np.dtype(np.float32), (1024,))
        >>> read_range_into("/tmp/unified-load-x/0.safetensors", 80, out)
    """
    view, got = memoryview(out.reshape(-1).view(np.uint8)), 0
    fd = _open_for_reading(path)
    try:
        while got < len(view):
            count = os.preadv(fd, [view[got:]], start + got)
            if not count:
                raise CheckpointError(f"{path}: ended before byte {start + len(view)}." + see("file-ended"))
            got += count
    finally:
        os.close(fd)


def _read_header(fd: int, path: str, size: int, digest: Any) -> Tuple[int, str]:
    """The header's length and text (`_header_text`) of the open safetensors file ``fd`` of
    ``size`` bytes, hashed (its bytes are dropped once decoded)."""
    length = _header_length(_read_exact(fd, 0, min(8, size), path, size, digest), size - 8, path)
    return length, _header_text(_read_exact(fd, 8, length, path, size, digest), path)


def _read_exact(fd: int, offset: int, count: int, path: str, size: int, digest: Any) -> bytes:
    data = b""
    while len(data) < count:
        more = os.pread(fd, count - len(data), offset + len(data))
        if not more:
            raise _ended(fd, path, size)
        data += more
    digest.update(data)
    return data


def _whole_file_checksum(fd: int, size: int) -> str:
    digest, at = xxhash.xxh3_64(), 0
    while at < size:
        chunk = os.pread(fd, min(_READ_CHUNK, size - at), at)
        if not chunk:
            break
        digest.update(chunk)
        at += len(chunk)
    return digest.hexdigest()


def _read_into(fd: int, data_start: int, spans: Sequence[Tuple[int, Any]], digest: Any, path: str, size: int,
               memory_for: Callable[[Any], np.ndarray] = lambda array: array,
               done: Callable[[np.ndarray], None] = lambda array: None) -> None:
    """Read the data section into the arrays (``spans``: data offset and array, in file order;
    ``memory_for`` gives each one's memory just before its bytes are asked for), in batches of
    at most _READ_CHUNK bytes read by up to _READERS threads (``preadv`` and xxhash release the
    GIL) and hashed in order by this one as they arrive; ``done(array)`` once an array's last
    byte is hashed. The readers run at most _READ_AHEAD bytes ahead of the hashing, so arrays
    made by ``memory_for`` exist at most that far ahead of their hand-off."""
    pool = (concurrent.futures.ThreadPoolExecutor(_READERS, thread_name_prefix="unified-read")
            if _READERS > 1 and size - data_start > _READ_CHUNK else None)
    submitted: List[Tuple[Any, int, List[np.ndarray]]] = []  # (job, bytes, arrays that end in it), in order
    parts: List[memoryview] = []
    ending: List[np.ndarray] = []
    batch_at = filled = ahead = 0

    def fill(batch: Tuple[int, List[memoryview]]) -> List[memoryview]:
        at, buffers = batch
        todo, first = list(buffers), 0
        while first < len(todo):  # one call, unless the kernel returns less
            got = os.preadv(fd, todo[first:], at)
            if got == 0:
                raise _ended(fd, path, size)
            at += got
            while first < len(todo) and got >= len(todo[first]):
                got -= len(todo[first])
                first += 1
            if got:
                todo[first] = todo[first][got:]
        return buffers

    def submit() -> None:
        nonlocal parts, ending, filled, ahead
        batch = (batch_at, parts)
        submitted.append((pool.submit(fill, batch) if pool is not None else batch, filled, ending))
        ahead += filled
        parts, ending, filled = [], [], 0

    def hash_oldest() -> None:
        nonlocal ahead
        job, nbytes, ended = submitted.pop(0)
        for buffer in (job.result() if pool is not None else fill(job)):
            digest.update(buffer)
        ahead -= nbytes
        for array in ended:
            done(array)

    try:
        for offset, planned in spans:
            array = memory_for(planned)
            view = memoryview(array.reshape(-1).view(np.uint8)) if array.nbytes else None
            for at in range(0, array.nbytes, _READ_CHUNK):
                part = view[at:at + _READ_CHUNK]
                if not parts:
                    batch_at = data_start + offset + at
                parts.append(part)
                filled += len(part)
                if filled >= _READ_CHUNK or len(parts) >= _MAX_IOV:
                    if at + len(part) >= array.nbytes:
                        ending.append(array)
                    submit()
                    while ahead > _READ_AHEAD and len(submitted) > 1:
                        hash_oldest()
            if parts or array.nbytes == 0:
                ending.append(array)  # it ends in the batch being gathered
        if parts or ending:
            submit()
        while submitted:
            hash_oldest()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
