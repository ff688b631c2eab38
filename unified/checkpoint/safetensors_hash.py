"""Hashing checkpoint files: `verify_file` (size and xxh3 of a regular file, through a ring of
reused buffers), `verify_for_reader` and `changed_since` (a file another reader opens after it was
verified), `hash_entries` (the whole file and each entry, in one pass).
"""
from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Dict, Mapping, Tuple

import xxhash

from .safetensors_format import _ended, _open_for_reading, checksum_mismatch, size_mismatch

_HASH_CHUNK = 16 << 20  # hash_entries' buffer
_READERS = max(1, min(4, os.cpu_count() or 1))  # threads filling the ring
# verifying: a ring of buffers this size (4 MiB verified 1.5 GB in 0.18-0.20 s in a fresh process on
# 2 cores; 16 MiB in 0.32-0.33 s, most of the difference being the ring's own fresh memory)
_VERIFY_CHUNK = 4 << 20



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
    whole, buffer = xxhash.xxh3_64(), bytearray(min(_HASH_CHUNK, max(size, 1)))
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
