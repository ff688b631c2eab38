"""Writing safetensors files while hashing them, in one pass: each array's own buffer goes to the
file and to xxh3 (`write`; `write_stream` for an upload; `write_one_by_one` for arrays made one
at a time). The layout aligns the data section and the arrays, so that readers' arrays are aligned.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import struct
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import xxhash

from ..errors import see
from .safetensors_format import _ALIGN, Exported, export_numpy, numpy_dtype

_CHUNK = 64 << 20

_PARALLEL_FROM = 256 << 20  # bytes of data from which writing is split over threads
_LIVE_CHUNK = 8 << 20  # bounce buffers of a write from memory that may change meanwhile...
_LIVE_BUFFERS = 4      # ...and how many of them at most (32 MiB)



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
