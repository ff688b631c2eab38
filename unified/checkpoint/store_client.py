"""Reaching an object store through its fsspec client (s3fs, gcsfs...): the client for a URL
(`filesystem`), what its errors become (`StoreError` while saving, `CheckpointError` while
loading: `reaching`), and an object of known size read by ranged requests alone (`Ranges`).
`unified.checkpoint.object_store.ObjectStore` is built on these.
"""
from __future__ import annotations

import contextlib
import io
from typing import Any, Iterator, Tuple

from ..errors import CheckpointError, see

# the extras that bring each protocol's fsspec client
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class StoreError(OSError):
    """An object store could not be reached or refused a request once its client's retries were
    spent; an `OSError`, so that a save reports it from every process like a full disk."""


@contextlib.contextmanager
def reaching(url: str, doing: str, error: type = StoreError) -> Iterator[None]:
    """Turn whatever the store's client raises (botocore, aiohttp, google-api errors...) into an
    ``error`` naming ``url``: a `StoreError` while saving (the save path shares an `OSError` of
    any process with every other), a `CheckpointError` while loading (what a failed load raises).
    An exception they did not expect on one process would leave the others waiting at the next
    collective."""
    try:
        yield
    except (CheckpointError, FileNotFoundError, StoreError):
        raise
    except Exception as err:
        raise error(f"{url}: {doing} failed after the storage client's retries ({type(err).__name__}: {err}). "
                    "Check the endpoint, credentials and network; no checkpoint was changed."
                    + see("object-storage-unreachable")) from err


class Ranges(io.RawIOBase):
    """An object of a known ``size`` read in order, each read one ranged GET (``cat_file``, with
    the client's retries) and no metadata request. Reads stop at ``size`` bytes; an object that
    ends before reads as ended there (the caller reports it, as it would a short file)."""

    def __init__(self, fs: Any, path: str, size: int) -> None:
        super().__init__()
        self._fs, self._name, self._size, self._at = fs, path, size, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = min(len(view), self._size - self._at)
        if count <= 0:
            return 0
        data = self._fs.cat_file(self._name, start=self._at, end=self._at + count)
        view[:len(data)] = data
        self._at += len(data)
        if len(data) < count:  # the object ended early: nothing more to read
            self._size = self._at
        return len(data)


def filesystem(url: str) -> Tuple[Any, str]:
    """The fsspec file system of ``url`` (fsspec keeps one per set of arguments) and the path in
    it; an `ImportError` saying what to install where fsspec or its client is missing."""
    protocol = url.split("://", 1)[0].lower()
    extra = EXTRAS.get(protocol)
    hint = f"pip install 'unified[{extra}]'" if extra else f"install the fsspec client of {protocol}://"
    try:
        import fsspec
    except ImportError as err:
        raise ImportError(f"checkpoints at {url} need fsspec and its client for {protocol}://: {hint}."
                          + see("object-storage-client")) from err
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:
        raise ImportError(f"checkpoints at {url} need the fsspec client for {protocol}:// ({err}): {hint}."
                          + see("object-storage-client")) from err
