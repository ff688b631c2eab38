"""What a backend's sharded reader needs of a store's objects (torch DCP's and JAX's readers,
`backends/*/storage.py`): every file's header asked for at once (`headers_of`), and an object
needed whole streamed into a private local copy, hashed (`private_copy`).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import CheckpointError, see
from . import safetensors_io
from .object_store import ObjectStore

Header = Tuple[int, Dict[str, Tuple[str, Tuple[int, ...], int, int]], Dict[str, str]]  # safetensors_io.header_of


def private_copy(store: ObjectStore, url: str, local: str, size: int,
                 planned: Tuple[int, Mapping[str, Tuple[str, Tuple[int, ...], int, int]]]
                 ) -> Optional[Dict[str, object]]:
    """A sharded reader's first pass over an object it needs whole: streamed into the new file
    ``local`` of a private folder through one bounded buffer, hashed (the caller compares the
    size and xxh3 returned with the manifest's before anything is restored; the copy, private,
    cannot change after). None where the local disk took no more (the copy is removed: the
    caller reads the object into memory instead). ``planned``: the data start and entries of the
    header the caller planned its reads from (`safetensors_io.header_of`); a copy laid out
    otherwise is refused (the object changed in between).

    Example:
        >>> start, entries, _ = header      # as `headers_of` gave it
        >>> private_copy(store, url, "/tmp/unified-load-x/0.safetensors", size, (start, entries))
        {'size': 8400, 'xxh3': '...'}
    """
    try:
        got = store.copy(url, local)
    except CheckpointError:
        raise
    except OSError:  # the local disk's (full), not the store's: those are CheckpointErrors
        with contextlib.suppress(OSError):
            os.remove(local)
        return None
    if got["size"] == size and safetensors_io.header_of_file(local, url)[1:] == (planned[0], dict(planned[1])):
        return got
    changed = CheckpointError(f"{url}: changed while it was read (its entries are not those its header listed "
                              "before); nothing was restored." + see("file-ended"))
    changed.damage = False  # type: ignore[attr-defined] # something wrote into it: no damage to fall back from
    raise changed


def headers_of(paths: Sequence[str], size_of: Callable[[str], int],
               read_range: Callable[[str, int, int], bytes]) -> List[Tuple[int, Header]]:
    """Each file's size and `safetensors_io.header_of`, all asked for at once (on a store every
    request waits its latency: one round trip for all the files instead of one per file); a
    failure raises the first failing file's error, in the order of ``paths``.

    Example:
        >>> store = ObjectStore("s3://bucket/run")
        >>> headers_of(urls, store.size_of, store.read_range)  # [(size, (data_start, entries, metadata)), ...]
    """
    def one(path: str) -> Tuple[int, Header]:
        size = size_of(path)
        return size, safetensors_io.header_of(lambda at, count: read_range(path, at, at + count), path, size)

    if len(paths) < 2:
        return [one(path) for path in paths]
    with concurrent.futures.ThreadPoolExecutor(min(8, len(paths)), thread_name_prefix="unified-headers") as pool:
        asked = [pool.submit(one, path) for path in paths]
    return [done.result() for done in asked]
