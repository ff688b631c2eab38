"""Write safetensors files while hashing them (one pass), and read them back verified.

The files are standard safetensors (readable by ``safetensors.safe_open``). Writing streams
each array's own buffer to the file and feeds the same buffer to xxh3, so the checksum costs
no extra pass; reading loads the bytes once, checks size and checksum, then makes zero-copy
NumPy views into them.
"""
from __future__ import annotations

import concurrent.futures
import json
import mmap
import os
import queue
import struct
from typing import Any, Dict, Mapping, Sequence, Tuple

import numpy as np
import xxhash

from ..errors import CheckpointError, see

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
_PARALLEL_FROM = 256 << 20  # bytes of data from which writing is split over threads
_LIVE_CHUNK = 8 << 20  # bounce buffers of a write from memory that may change meanwhile...
_LIVE_BUFFERS = 4      # ...and how many of them at most (32 MiB)


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
        raise TypeError(f"arrays of dtype {name} cannot be stored in safetensors" + see("dtype-not-storable"))
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
    header: Dict[str, object] = {}
    offset = 0
    for name, (dtype, shape, raw) in arrays.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the spec's 8-byte alignment of the data section
    digest = xxhash.xxh3_64()
    prefix = struct.pack("<Q", len(blob)) + blob
    digest.update(prefix)
    chunk_size = _LIVE_CHUNK if live else _CHUNK
    chunks, position = [], len(prefix)
    for _, _, raw in arrays.values():
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


def read(path: str, size: int, checksum: str) -> Dict[str, np.ndarray]:
    """Map and verify one file; returns read-only NumPy arrays viewing the mapping.

    The page cache is mapped rather than copied into a fresh buffer: the only copy of the data
    is the one into the objects being restored. Raises `CheckpointError` naming the file when
    it is missing, a link, of another size, fails its checksum, or is not well-formed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        raise CheckpointError(f"{path}: cannot open checkpoint file ({err.strerror})" + see("cannot-open-file")) from err
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CheckpointError(f"{path}: size is {actual} bytes; the manifest says {size}. The file is truncated or replaced."
                                  + see("size-mismatch"))
        if size == 0:
            raise CheckpointError(f"{path}: empty file" + see("empty-file"))
        buffer = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    if xxhash.xxh3_64_hexdigest(buffer) != checksum:
        raise CheckpointError(f"{path}: checksum mismatch - the file is corrupted or was modified" + see("checksum-mismatch"))
    return parse(buffer, path)


def verify_file(path: str, size, checksum) -> Dict[str, object]:
    """Hash one file in chunks (not following links); compare with ``size``/``checksum`` when
    given (raising `CheckpointError`), and return its ``{"size", "xxh3"}``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        raise CheckpointError(f"{path}: cannot open checkpoint file ({err.strerror})" + see("cannot-open-file")) from err
    digest, total = xxhash.xxh3_64(), 0
    with os.fdopen(fd, "rb", buffering=0) as handle:
        actual = os.fstat(handle.fileno()).st_size
        if size is not None and actual != size:
            raise CheckpointError(f"{path}: size is {actual} bytes; the manifest says {size}. The file is truncated or replaced."
                                  + see("size-mismatch"))
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
            total += len(chunk)
    if checksum is not None and digest.hexdigest() != checksum:
        raise CheckpointError(f"{path}: checksum mismatch - the file is corrupted or was modified" + see("checksum-mismatch"))
    return {"size": total, "xxh3": digest.hexdigest()}


def parse(buffer: Any, name: str) -> Dict[str, np.ndarray]:
    """Zero-copy NumPy views of the arrays in a safetensors buffer, with strict validation."""
    try:
        (length,) = struct.unpack_from("<Q", buffer, 0)
        if length > len(buffer) - 8:
            raise ValueError("header longer than the file")
        header = json.loads(bytes(buffer[8:8 + length]))
        data = memoryview(buffer)[8 + length:]
        arrays: Dict[str, np.ndarray] = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            dtype = numpy_dtype(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            if not 0 <= start <= end <= len(data) or (end - start) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise ValueError(f"array {key!r} has inconsistent offsets/shape")
            arrays[key] = np.frombuffer(data[start:end], dtype=dtype).reshape(shape)
        return arrays
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, struct.error) as err:
        raise CheckpointError(f"{name}: not a valid safetensors file ({err})" + see("invalid-safetensors")) from err
