"""Write safetensors files while hashing them (one pass), and read them back verified.

The files are standard safetensors (readable by ``safetensors.safe_open``). Writing streams
each array's own buffer to the file and feeds the same buffer to xxh3, so the checksum costs
no extra pass; reading copies the bytes once, into private memory of each array, hashing each
chunk as it arrives. No checkpoint file is ever mapped.
"""
from __future__ import annotations

import array as stdarray
import concurrent.futures
import functools
import io
import json
import math
import mmap
import os
import queue
import re
import struct
from json.decoder import scanstring
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import xxhash

from ..errors import CheckpointError, see
from .manifest import open_regular_file

# safetensors dtype names <-> NumPy dtypes (bfloat16 and float8 come from ml_dtypes when present)
_DTYPES: Dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
_BY_NUMPY = {v: k for k, v in _DTYPES.items()}
# safetensors dtype name -> NumPy dtype name: backends derive their own tables from it
DTYPE_NAMES: Mapping[str, str] = dict(_DTYPES)
_CHUNK = 64 << 20
_READ_CHUNK = 16 << 20  # reading: each chunk is hashed right after it was read, while cache-warm
_READERS = max(1, min(4, os.cpu_count() or 1))  # threads reading one file's chunks
_READ_AHEAD = 64 << 20  # how far those threads read ahead of the hashing
# verifying: a ring of buffers this size (4 MiB verified 1.5 GB in 0.18-0.20 s in a fresh process on
# 2 cores; 16 MiB in 0.32-0.33 s, most of the difference being the ring's own fresh memory)
_VERIFY_CHUNK = 4 << 20
_MAX_IOV = 512  # buffers per preadv (IOV_MAX is 1024 on Linux)
_ALIGN = 64  # where the writer puts the data section and the arrays of whole multiples of it
_PARALLEL_FROM = 256 << 20  # bytes of data from which writing is split over threads
_LIVE_CHUNK = 8 << 20  # bounce buffers of a write from memory that may change meanwhile...
_LIVE_BUFFERS = 4      # ...and how many of them at most (32 MiB)
# Our writer spends ~70 bytes plus the name on each array; the largest state we know of (Adam on
# a model of ~47k tensors: ~141k arrays named like optimizer_0/state/12345/exp_avg_sq) needs
# ~16 MB. 64 MiB leaves four times that, below the safetensors crate's own 100 MB limit.
MAX_HEADER_BYTES = 64 << 20
MAX_METADATA_ENTRIES = 1024  # the format allows a str -> str mapping (torch DCP's shard files hold 3)
MAX_RANK = 64  # NumPy's limit on dimensions


def numpy_dtype(name: str) -> np.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"unknown safetensors dtype {name!r}" + see("invalid-safetensors"))
    try:
        return np.dtype(_DTYPES[name])
    except TypeError:
        import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with NumPy)

        return np.dtype(getattr(ml_dtypes, _DTYPES[name]))


def safetensors_dtype(dtype: np.dtype) -> str:
    name = np.dtype(dtype).name
    if name not in _BY_NUMPY:
        raise TypeError(f"arrays of dtype {name} cannot be stored in safetensors." + see("dtype-not-storable"))
    return _BY_NUMPY[name]


from ..backend import Exported  # noqa: E402  (safetensors dtype, shape, contiguous uint8 view of its bytes)


def export_numpy(array: np.ndarray) -> Exported:
    array = np.asarray(array)
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        array = array.copy(order="C")
    return safetensors_dtype(array.dtype), tuple(array.shape), array.reshape(-1).view(np.uint8)


def write(path: str, arrays: Mapping[str, Exported], metadata: Mapping[str, str] = (),
          live: bool = False) -> Dict[str, object]:
    """Write ``arrays`` to ``path``; returns ``{"size": bytes, "xxh3": hex}``.

    ``live``: the arrays may change while they are written (an async save writing from the
    training's own memory). Each chunk is then copied once into a small bounce buffer that is
    both hashed and written, so the checksum always describes exactly the bytes in the file.
    """
    ordered, prefix = _layout({name: (dtype, shape, raw.nbytes) for name, (dtype, shape, raw) in arrays.items()},
                              metadata)
    digest = xxhash.xxh3_64()
    digest.update(prefix)
    ordered = [(name, arrays[name]) for name in ordered]
    chunk_size = _LIVE_CHUNK if live else _CHUNK
    chunks, position = [], len(prefix)
    for _, (_, _, raw) in ordered:
        view = memoryview(raw)
        for start in range(0, len(view), chunk_size):
            chunks.append((position + start, view[start:start + chunk_size]))
        position += len(view)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, prefix, 0)
        if live:
            _write_through_bounce_buffers(fd, chunks, digest)
        elif position - len(prefix) < _PARALLEL_FROM:
            for at, chunk in chunks:
                digest.update(chunk)
                _pwrite_all(fd, chunk, at)
        else:  # xxhash and pwrite release the GIL: hash in order while two threads write
            os.ftruncate(fd, position)
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                hashing = pool.submit(lambda: [digest.update(chunk) for _, chunk in chunks])
                writes = [pool.submit(lambda part: [_pwrite_all(fd, c, at) for at, c in part], chunks[i::2])
                          for i in range(2)]
                for future in (hashing, *writes):
                    future.result()
    finally:
        os.close(fd)
    return {"size": position, "xxh3": digest.hexdigest()}


def write_stream(handle: Any, arrays: Mapping[str, Exported], chunk: int = _LIVE_CHUNK,
                 metadata: Mapping[str, str] = ()) -> Dict[str, object]:
    """Write ``arrays`` as one safetensors file to the binary file object ``handle`` in order
    (an object store's upload: no seek, no offset), hashing each chunk as it is written; returns
    ``{"size", "xxh3"}``. The bytes equal `write`'s for the same arrays.

    Example:
        >>> with open("model.safetensors", "wb") as out:
        ...     write_stream(out, {"w": export_numpy(np.ones(3, np.float32))})
    """
    ordered, prefix = _layout({name: (dtype, shape, raw.nbytes) for name, (dtype, shape, raw) in arrays.items()},
                              metadata)
    digest = xxhash.xxh3_64(prefix)
    handle.write(prefix)
    size = len(prefix)
    for name in ordered:
        view = memoryview(arrays[name][2])
        for start in range(0, len(view), chunk):
            part = view[start:start + chunk]
            digest.update(part)
            handle.write(part)
        size += len(view)
    return {"size": size, "xxh3": digest.hexdigest()}


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
    """`describe` of a regular file (never a link, FIFO or device)."""
    fd = _open_for_reading(path)
    try:
        return describe(lambda at, count: os.pread(fd, count, at), path, size)
    finally:
        os.close(fd)


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
    made just before its bytes are read, and is never written again."""

    def __init__(self, into: Mapping[str, Any]) -> None:
        self.into = into
        self.placed: List[str] = []
        self._handed: Dict[int, Callable[[np.ndarray], None]] = {}  # id(staging view or own array) -> hand_off
        self.stages = False  # some array goes through the staging buffer: one array after another

    def lay_out(self, header: str, data_size: int, path: str) -> Tuple[Dict[str, Any], List[Tuple[int, Any]]]:
        """The arrays of a file's entries (``header``: its text, as `_header_text` gives it; a
        `_Staged` for those made only when read: see `memory_for`) and the same in file order
        with their offsets."""
        arrays, starts = _lay_out(header, data_size, path, self._make)
        staged = {key: spec for key, spec in arrays.items() if isinstance(spec, _Staged) and not spec.own}
        if staged:
            buffer = private_array(np.dtype(np.uint8), (max(spec.nbytes for spec in staged.values()),))
            for key, spec in staged.items():
                view = buffer[:spec.nbytes].view(spec.dtype).reshape(spec.shape)
                arrays[key] = view
                self._handed[id(view)] = spec.hand_off
        return arrays, _in_file_order(arrays, starts)

    def memory_for(self, array: Any) -> np.ndarray:
        """The memory an entry of `lay_out` is read into: its own, made now, for a `KeepsHost`."""
        if not isinstance(array, _Staged):
            return array
        own = private_array(array.dtype, array.shape)
        self._handed[id(own)] = array.hand_off
        return own

    def done(self, array: np.ndarray) -> None:
        """After ``array``'s last byte was read and hashed: hand it off if it is staged."""
        hand_off = self._handed.get(id(array))
        if hand_off is not None:
            if isinstance(hand_off, KeepsHost):  # its memory is the new array's: no id of it is kept
                del self._handed[id(array)]
            hand_off(array)

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


class _Staged:
    """An array `Placing` reads into its staging buffer (or, ``own``, memory of its own) and hands off."""

    def __init__(self, dtype: np.dtype, shape: Tuple[int, ...], hand_off: Callable[[np.ndarray], None]) -> None:
        self.dtype, self.shape, self.hand_off = dtype, shape, hand_off
        self.own = isinstance(hand_off, KeepsHost)
        self.nbytes = math.prod(shape) * dtype.itemsize


def _layout(specs: Mapping[str, Tuple[str, Sequence[int], int]], metadata: Mapping[str, str] = ()
            ) -> Tuple[list, bytes]:
    """The order of the arrays in the file and its prefix (length + JSON header + padding), from
    ``name -> (dtype, shape, nbytes)``.

    Arrays whose size is a multiple of _ALIGN first, then the others by decreasing item size,
    from a data section that starts at a multiple of _ALIGN: a reader's arrays are then aligned,
    so that a JAX array can take over their memory without a copy (it needs 64 bytes) and every
    array's items are naturally aligned."""
    ordered = sorted(specs, key=lambda name: (specs[name][2] % _ALIGN != 0, -numpy_dtype(specs[name][0]).itemsize))
    header: Dict[str, object] = {}
    offset = 0
    for name in ordered:
        dtype, shape, nbytes = specs[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % _ALIGN)  # padding the spec allows (it asks for 8)
    return ordered, struct.pack("<Q", len(blob)) + blob


def write_one_by_one(path: Optional[str], specs: Mapping[str, Tuple[str, Sequence[int]]],
                     produce: Callable[[str], Any], metadata: Mapping[str, str] = ()) -> Optional[Dict[str, object]]:
    """Write a safetensors file whose arrays come one at a time: ``produce(name)`` returns one
    array (NumPy, of the dtype and shape in ``specs``), called once per name in file order, so
    that only one array is held at a time (`save_model` of a sharded model gathers each).

    ``path=None`` calls ``produce`` in the same order without writing (the processes that only
    take part in the gathers). Returns ``{"size", "xxh3"}`` of the file, or ``None``.
    """
    sizes = {name: (dtype, tuple(shape), int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize)
             for name, (dtype, shape) in specs.items()}
    ordered, prefix = _layout(sizes, metadata)
    if path is None:
        for name in ordered:
            produce(name)
        return None
    digest = xxhash.xxh3_64()
    digest.update(prefix)
    done = 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(fd, memoryview(prefix), 0)
            position = len(prefix)
            for name in ordered:
                value = produce(name)
                done += 1
                dtype, shape, raw = export_numpy(np.asarray(value))
                if (dtype, tuple(shape)) != sizes[name][:2]:
                    raise ValueError(f"{name}: expected {sizes[name][0]} {list(sizes[name][1])}, "
                                     f"got {dtype} {list(shape)}" + see("save-model-failed"))
                view = memoryview(raw)
                digest.update(view)
                _pwrite_all(fd, view, position)
                position += len(view)
        finally:
            os.close(fd)
    except (OSError, ValueError):
        for name in ordered[done:]:  # the other processes still wait for these gathers
            produce(name)
        raise
    return {"size": position, "xxh3": digest.hexdigest()}


def _write_through_bounce_buffers(fd: int, chunks: Sequence[Tuple[int, memoryview]], digest: Any) -> None:
    """Copy each chunk into a free buffer, hash the buffer in order, and write it from a pool
    of two writers; a buffer is reused once its write finished (at most _LIVE_BUFFERS live)."""
    free: "queue.Queue[bytearray]" = queue.Queue()
    largest = max((len(chunk) for _, chunk in chunks), default=0)
    for _ in range(min(_LIVE_BUFFERS, len(chunks))):
        free.put(bytearray(largest))

    def write_and_free(buffer: bytearray, data: memoryview, at: int) -> None:
        try:
            _pwrite_all(fd, data, at)
        finally:
            free.put(buffer)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = []
        for at, chunk in chunks:
            buffer = free.get()
            data = memoryview(buffer)[:len(chunk)]
            data[:] = chunk
            digest.update(data)
            futures.append(pool.submit(write_and_free, buffer, data, at))
        for future in futures:
            future.result()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _open_for_reading(path: str) -> int:
    try:
        return open_regular_file(path)
    except OSError as err:
        raise cannot_open(path, err) from err


def cannot_open(path: str, err: OSError) -> CheckpointError:
    return CheckpointError(f"{path}: cannot open checkpoint file ({err.strerror})." + see("cannot-open-file"))


def size_mismatch(path: str, actual: int, size: int) -> CheckpointError:
    return CheckpointError(f"{path}: size is {actual} bytes; the manifest says {size}. The file is truncated or "
                           "replaced." + see("size-mismatch"))


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
            with io.FileIO(fd, "rb", closefd=False) as handle:
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


def hash_entries(path: str, size: int, data_start: int, entries: Mapping[str, Tuple[str, Tuple[int, ...], int, int]]
                 ) -> Tuple[Dict[str, object], Dict[str, str], Tuple[int, ...]]:
    """One pass over the regular file ``path`` through a bounded buffer: its ``{"size", "xxh3"}``
    (for the manifest's), the xxh3 of each entry's bytes (``entries`` and ``data_start`` as
    `header_of` gives them), and the file's identity before the pass (`identity`). A sharded
    load's first pass over a file it later reads into the live tensors entry by entry, checking
    each against these.

    Example:
        >>> start, entries, _ = header_of(read_at, path, size)
        >>> whole, per_entry, seen = hash_entries(path, size, start, entries)
    """
    spans = sorted((data_start + begin, data_start + end, key) for key, (_, _, begin, end) in entries.items())
    digests = {key: xxhash.xxh3_64() for key in entries}
    whole, buffer = xxhash.xxh3_64(), bytearray(min(_READ_CHUNK, max(size, 1)))
    fd = _open_for_reading(path)
    try:
        seen = identity(os.fstat(fd))
        view, at, first = memoryview(buffer), 0, 0
        while at < size:
            count = os.preadv(fd, [view[:min(len(view), size - at)]], at)
            if not count:
                raise _ended(fd, path, size)
            chunk = view[:count]
            whole.update(chunk)
            while first < len(spans) and spans[first][1] <= at:
                first += 1
            for begin, end, key in spans[first:]:
                if begin >= at + count:
                    break
                digests[key].update(chunk[max(begin - at, 0):min(end - at, count)])
            at += count
        total = at + len(os.pread(fd, 1, at))  # a file longer than ``size``: its size differs
    finally:
        os.close(fd)
    return {"size": total, "xxh3": whole.hexdigest()}, {key: d.hexdigest() for key, d in digests.items()}, seen


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


def checksum_mismatch(path: str) -> CheckpointError:
    return CheckpointError(f"{path}: checksum mismatch - the file is corrupted or was modified."
                           + see("checksum-mismatch"))


def _ended(fd: int, path: str, size: int) -> CheckpointError:
    return CheckpointError(f"{path}: file ended after {os.fstat(fd).st_size} of {size} bytes (it shrank while it was "
                           "read); nothing was restored." + see("file-ended"))


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


def _in_file_order(arrays: Dict[str, np.ndarray], starts: List[int]) -> List[Tuple[int, np.ndarray]]:
    """``(offset in the data section, array)`` of `_lay_out`'s result, in file order."""
    return sorted(zip(starts, arrays.values()), key=lambda span: span[0])


def _lay_out(header: str, data_size: int, name: str,
             make: Callable[[str, np.dtype, Tuple[int, ...], int], Any],
             metadata: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, Any], List[int]]:
    """``{key: make(key, dtype, shape, start)}`` for the entries of a header (its text, as
    `_header_text` gives it) whose arrays tile the data section of ``data_size`` bytes exactly,
    and their starts (in the header's order); anything else raises `CheckpointError` naming
    ``name``. ``make`` is never asked for more than ``data_size`` bytes in all. ``metadata``,
    when given, gets the header's ``__metadata__``."""
    arrays: Dict[str, np.ndarray] = {}
    starts, ends = stdarray.array("q"), stdarray.array("q")
    total = 0
    try:
        for key, dtype, shape, start, end in _entries(header, data_size, name, metadata):
            if key in arrays:
                raise _not_safetensors(name, f"entry {_shown(key)} appears twice")
            total += end - start
            if total > data_size:
                raise _not_safetensors(name, f"its arrays overlap or leave bytes of the {data_size}-byte data "
                                             "section unused")
            arrays[key] = make(key, dtype, shape, start)
            starts.append(start)
            ends.append(end)
    except CheckpointError:
        raise
    except ValueError as err:  # malformed strings or numbers, which the shape checks let through
        raise _not_safetensors(name, str(err)) from err
    _check_tiling(np.frombuffer(starts, np.int64), np.frombuffer(ends, np.int64), data_size, name)
    return arrays, list(starts)


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


def verify_file(path: str, size, checksum) -> Dict[str, object]:
    """Hash one regular file in chunks (never a link, FIFO or device); compare with
    ``size``/``checksum`` when given (raising `CheckpointError`), and return its ``{"size", "xxh3"}``."""
    return _hash_file(path, size, checksum)[0]


def verify_for_reader(path: str, size: int, checksum: str) -> Tuple[int, ...]:
    """`verify_file` for a file that another reader (Orbax) opens afterwards; returns the file's
    identity right after it was hashed, for `changed_since`."""
    return _hash_file(path, size, checksum)[1]


def changed_since(path: str, seen: Tuple[int, ...]) -> bool:
    """Whether ``path`` may have changed since `verify_for_reader` (or `identity`) returned
    ``seen``: replaced, resized, written or touched (each moves its change time), or gone."""
    try:
        return identity(os.lstat(path)) != seen
    except OSError:
        return True


def identity(st: os.stat_result) -> Tuple[int, ...]:
    """What `changed_since` compares: device, inode, size, modification and change times."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _hash_file(path: str, size, checksum) -> Tuple[Dict[str, object], Tuple[int, ...]]:
    fd = _open_for_reading(path)
    digest = xxhash.xxh3_64()
    try:
        actual = os.fstat(fd).st_size
        if size is not None and actual != size:
            raise size_mismatch(path, actual, size)
        total = _hash_through_ring(fd, actual, digest)
        seen = identity(os.fstat(fd))
    finally:
        os.close(fd)
    if checksum is not None and digest.hexdigest() != checksum:
        raise checksum_mismatch(path)
    return {"size": total, "xxh3": digest.hexdigest()}, seen


def _hash_through_ring(fd: int, size: int, digest: Any) -> int:
    """Hash the open file to its end (``size`` bytes expected; more if it grew), in order,
    through a ring of _READERS + 1 reused buffers of _VERIFY_CHUNK bytes that up to _READERS
    threads fill ahead of the hashing (``preadv`` and xxhash release the GIL): bounded memory,
    and the copy out of the page cache in parallel. Returns the bytes hashed."""
    chunk = min(_VERIFY_CHUNK, max(size, 1))
    offsets = list(range(0, size, chunk))

    def fill(buffer: memoryview, at: int) -> int:
        got = 0
        while got < len(buffer):
            more = os.preadv(fd, [buffer[got:]], at + got)
            if not more:
                break
            got += more
        return got

    total = 0
    if len(offsets) > 1 and _READERS > 1:
        ring = [memoryview(bytearray(chunk)) for _ in range(min(_READERS + 1, len(offsets)))]
        pool = concurrent.futures.ThreadPoolExecutor(_READERS, thread_name_prefix="unified-hash")
        try:
            pending = [pool.submit(fill, ring[i], offsets[i]) for i in range(len(ring))]
            for i in range(len(offsets)):
                slot = ring[i % len(ring)]
                got = pending[i].result()
                digest.update(slot[:got])
                total += got
                if got < len(slot[:min(chunk, size - offsets[i])]):
                    return total  # the file shrank: the caller's size check says so
                if i + len(ring) < len(offsets):
                    pending.append(pool.submit(fill, slot, offsets[i + len(ring)]))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    else:
        buffer = memoryview(bytearray(chunk))
        while total < size:
            got = fill(buffer[:min(chunk, size - total)], total)
            digest.update(buffer[:got])
            total += got
            if not got:
                return total
    buffer = memoryview(bytearray(1 << 16))
    while True:  # past the size it had: a file that grew is hashed whole, and fails its checks
        got = fill(buffer, total)
        if not got:
            return total
        digest.update(buffer[:got])
        total += got


# -- parsing a header that may be hostile ----------------------------------------------------------
#
# A header is one JSON object of entries ``name: {"dtype", "shape", "data_offsets"}`` (and an
# optional ``"__metadata__": {str: str}``). Before anything is built from an entry its text must
# have exactly that shape (below), so a hostile header cannot make json build the deep or dense
# structures that cost 20-30 times their size; each entry is then parsed alone, checked, and
# turned into an array view (or `header_of`'s tuple), so the header is never held as Python
# objects in whole, and every reader parses it once, holding only its text (`_header_text`:
# the bytes read are dropped once decoded). Every reader stays within 10 times the header's
# size, hostile or not (tests/unit/test_parse_memory_bounds.py measures each one): peak RSS
# growth at 63 MiB, as our writer makes it (720k arrays) 4.7x for `header_of`, 5.9x for `read`;
# with 1.3M tiny arrays 5.7x and 7.9x, `parse` 8.1x. json.loads of the whole header took 10-28
# times; `header_of` parsed it twice, the second time whole (13-17x), until 2026-12.

_W = r"[ \t\n\r]*"
# Flat character classes only, whose matching needs no memory per character (a repeated group
# would: some 300 bytes per repetition); json.loads checks the exact syntax of each entry after.
_INTS = r"\[[-0-9, \t\n\r]*\]"
_FIELD = rf'(?:"dtype"{_W}:{_W}"[A-Z0-9_]{{1,16}}"|"(?:shape|data_offsets)"{_W}:{_W}{_INTS})'
_INFO = re.compile(rf"\{{{_W}{_FIELD}{_W},{_W}{_FIELD}{_W},{_W}{_FIELD}{_W}\}}")
_SPACE = re.compile(_W)
_INFO_KEYS = {"dtype", "shape", "data_offsets"}


def _not_safetensors(name: str, detail: str) -> CheckpointError:
    return CheckpointError(f"{name}: not a valid safetensors file ({detail})." + see("invalid-safetensors"))


def _after(text: str, at: int, token: str, name: str) -> int:
    """The position after ``token`` (and the spaces around it), which must come next."""
    at = _SPACE.match(text, at).end()
    if not text.startswith(token, at):
        raise _not_safetensors(name, f"expected {token!r} at byte {at} of the header")
    return _SPACE.match(text, at + len(token)).end()


def _header_entries(text: str, name: str, metadata: Optional[Dict[str, str]] = None) -> Iterator[Tuple[str, str]]:
    """``(array name, entry JSON)`` for each entry of the header ``text``, in order, each
    entry's text checked to have the only shape a header allows; ``metadata``, when given, gets
    the pairs of ``__metadata__`` (else nothing of it is kept)."""
    at = _after(text, 0, "{", name)
    more = not text.startswith("}", at)
    while more:
        if not text.startswith('"', at):
            raise _not_safetensors(name, f"expected an array name at byte {at} of the header")
        key, at = scanstring(text, at + 1)
        at = _after(text, at, ":", name)
        if key == "__metadata__":
            end = _metadata_end(text, at, name, metadata)
            yield key, ""
        else:
            match = _INFO.match(text, at)
            if match is None:
                raise _not_safetensors(name, f"entry {_shown(key)} at byte {at} of the header is not "
                                             "{'dtype': name, 'shape': [integers], 'data_offsets': [integers]}")
            end = match.end()
            yield key, match.group()
        at = _SPACE.match(text, end).end()
        more = text.startswith(",", at)
        if more:
            at = _SPACE.match(text, at + 1).end()
    if _after(text, at, "}", name) != len(text):
        raise _not_safetensors(name, "data after the header's closing brace")


def _metadata_end(text: str, at: int, name: str, keep: Optional[Dict[str, str]] = None) -> int:
    """The end of the ``__metadata__`` mapping starting at ``at``: at most MAX_METADATA_ENTRIES
    pairs of strings (escapes allowed: torch's DCP stores JSON there), each string scanned by
    json's C scanner and dropped, so nothing grows with the entries, unless ``keep`` is given:
    then it gets the pairs (at most the header's size in strings; a key given twice keeps its
    last value, as json.loads does)."""
    at = _after(text, at, "{", name)
    if text.startswith("}", at):
        return at + 1
    for _ in range(MAX_METADATA_ENTRIES):
        pair = []
        for token in (":", None):
            if not text.startswith('"', at):
                raise _not_safetensors(name, f"the __metadata__ entry at byte {at} of the header is not a string")
            value, at = scanstring(text, at + 1)
            if keep is not None:
                pair.append(value)
            if token:
                at = _after(text, at, token, name)
        if keep is not None:
            keep[pair[0]] = pair[1]
        at = _SPACE.match(text, at).end()
        if text.startswith("}", at):
            return at + 1
        at = _after(text, at, ",", name)
    raise _not_safetensors(name, f"__metadata__ holds more than {MAX_METADATA_ENTRIES} entries")


def _shown(key: str) -> str:
    text = repr(key)
    return text if len(text) <= 80 else text[:77] + "..."


def _entry(key: str, entry: str, data_size: int, name: str) -> Tuple[np.dtype, List[int], int, int]:
    """``(dtype, shape, start, end)`` of header entry ``entry``, once checked against a data
    section of ``data_size`` bytes."""
    if entry.count(",") > MAX_RANK + 2:  # two between the fields, one in data_offsets
        raise _not_safetensors(name, f"array {_shown(key)} has more than {MAX_RANK} dimensions")
    info = json.loads(entry)
    if set(info) != _INFO_KEYS:
        raise _not_safetensors(name, f"array {_shown(key)} needs 'dtype', 'shape' and 'data_offsets' once each")
    if info["dtype"] not in _DTYPES:
        raise _not_safetensors(name, f"array {_shown(key)} has the unknown dtype {info['dtype']!r}")
    dtype = numpy_dtype(info["dtype"])
    shape, offsets = info["shape"], info["data_offsets"]
    if len(offsets) != 2 or not all(0 <= d < 1 << 63 for d in shape) or len(shape) > MAX_RANK:
        raise _not_safetensors(name, f"array {_shown(key)} needs at most {MAX_RANK} dimensions in [0, 2**63) and "
                                     "two data offsets")
    if math.prod(d for d in shape if d) * dtype.itemsize >= 1 << 63:  # even with a dimension of 0, as NumPy
        raise _not_safetensors(name, f"array {_shown(key)} has dimensions whose product, times its item size, is "
                                     "2**63 or more (NumPy cannot make it)")
    start, end = offsets
    if not 0 <= start <= end <= data_size or end - start != math.prod(shape) * dtype.itemsize:
        raise _not_safetensors(name, f"array {_shown(key)} has inconsistent offsets/shape")
    return dtype, shape, start, end


def _header_length(prefix: bytes, most: int, name: str) -> int:
    """The header length that the file's first 8 bytes state, if the file can hold it."""
    if len(prefix) < 8:
        raise _not_safetensors(name, f"{len(prefix)} bytes, fewer than the 8 of the header length")
    (length,) = struct.unpack_from("<Q", prefix, 0)
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(f"{name}: the safetensors header is {length} bytes; unified reads headers of at most "
                              f"{MAX_HEADER_BYTES} bytes. The file is damaged or hostile: load another checkpoint."
                              + see("header-too-large"))
    if length > most:
        raise _not_safetensors(name, f"header of {length} bytes in a file of {most + 8}")
    return length


def _header_text(header: Any, name: str) -> str:
    """The text of a header (its bytes, or a buffer of them: decoded without a copy), which must
    be ASCII, as JSON can always be written. The readers keep only this text while they parse:
    one copy of the header, whatever held its bytes is dropped first."""
    try:
        return str(header, "ascii")
    except UnicodeDecodeError:
        raise _not_safetensors(name, "the header is not ASCII JSON; unified writes names with \\u escapes") from None


def _entries(header: str, data_size: int, name: str, metadata: Optional[Dict[str, str]] = None
             ) -> Iterator[Tuple[str, np.dtype, List[int], int, int]]:
    """``(name, dtype, shape, start, end)`` of each array of the header text ``header``, checked
    one by one (the caller refuses names seen twice and checks that the arrays tile the data
    section); ``metadata``, when given, gets its ``__metadata__``."""
    has_metadata = False
    for key, entry in _header_entries(header, name, metadata):
        if key == "__metadata__":
            if has_metadata:
                raise _not_safetensors(name, f"entry {_shown(key)} appears twice")
            has_metadata = True
        else:
            yield (key, *_entry(key, entry, data_size, name))


def parse(buffer: Any, name: str) -> Dict[str, np.ndarray]:
    """Zero-copy NumPy views of the arrays in a safetensors buffer, with strict validation:
    anything else than a well-formed header of at most `MAX_HEADER_BYTES` whose arrays tile the
    data section raises `CheckpointError` naming ``name``."""
    length = _header_length(bytes(buffer[:8]), len(buffer) - 8, name)
    data_start, data_size = 8 + length, len(buffer) - 8 - length
    text = _header_text(memoryview(buffer)[8:data_start], name)  # decoded from the buffer itself: no copy
    return _lay_out(text, data_size, name, lambda key, dtype, shape, start: np.frombuffer(
        buffer, dtype=dtype, count=math.prod(shape), offset=data_start + start).reshape(shape))[0]


def _check_tiling(starts: np.ndarray, ends: np.ndarray, size: int, name: str) -> None:
    """The arrays cover the data section exactly, as the format requires: no byte of it unused
    and none in two arrays (restored objects keep their arrays' memory, so none may share it)."""
    order = np.lexsort((ends, starts))
    starts, ends = starts[order], ends[order]
    tiled = size == 0 if not len(starts) else \
        starts[0] == 0 and ends[-1] == size and np.array_equal(starts[1:], ends[:-1])
    if not tiled:
        raise _not_safetensors(name, f"its arrays overlap or leave bytes of the {size}-byte data section unused")
