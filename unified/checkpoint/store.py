"""Where checkpoints live: a folder of the file system, or an object store named by an fsspec URL.

The checkpoint manager does the same steps everywhere (write each process's files, write the
manifest last, apply retention); a `Location` is the part that differs, with the commit as its
own step, as Orbax's atomicity strategies are:

* `Folder`: files go into a temporary folder beside the checkpoint; the commit writes the
  manifest, fsyncs every file and folder, and renames the folder into place (atomic).
* `ObjectStore` (``s3://``, ``gs://``, any fsspec URL): there is no rename, so the files go
  straight to the checkpoint's prefix and the manifest, written last in one request, is the
  commit. A prefix without its manifest is never listed, loaded or counted by retention; what a
  crashed save left there is deleted after a later commit of a run that holds the prefix's lease
  (`lease`; without one it may be another live run's save, and is left alone). A checkpoint is
  deleted manifest first; a damaged one that an automatic load skipped is set aside by moving its
  manifest to ``manifest.json.damaged`` (`ObjectStore.set_aside_damaged`). Files are streamed (multipart
  uploads) and hashed in the same pass; nothing is staged whole on local disk. A load verifies
  each object as it downloads it, into a private local copy when the local disk has room (the
  load's `Placement._copy_for`), from which the live arrays are then filled.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import shutil
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import xxhash

from ..config import is_url
from ..errors import CheckpointError, see
from . import layout, safetensors_io
from .manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    check_manifest,
    manifest_bytes,
    parse_manifest_json,
    read_manifest,
    write_manifest,
)
from .types import Location

_HEAD_BYTES = 1 << 20  # what `ObjectStore.verify` keeps of an object's first bytes: its header, usually
PART_BYTES = 32 << 20  # one multipart upload part (S3's least is 5 MiB): the memory a file's upload holds
# the metadata of an object that changes when it is written again, as fsspec clients name it: s3fs
# (ETag, VersionId, LastModified), gcsfs (generation, etag, updated), adlfs (etag, last_modified)
_IDENTITY_KEYS = ("ETag", "VersionId", "LastModified", "generation", "etag", "updated", "last_modified", "mtime")
# the extras that bring each protocol's fsspec client
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_AUTO_NAME = layout._AUTO_NAME  # checkpoint_N: one pattern for folders and stores
# A damaged checkpoint set aside on a store (no rename): its manifest, moved here (`ObjectStore.set_aside_damaged`).
DAMAGED_MANIFEST = MANIFEST + layout.DAMAGED_MARK


class Folder:
    """Checkpoints in a folder of the file system (shared by every machine of a multi-host job)."""

    atomic_replace = True

    def numbered(self, folder: str) -> List[Tuple[int, str]]:
        return layout.numbered_checkpoints(folder)

    def highest_number(self, folder: str) -> Optional[int]:
        return layout.highest_number(folder)

    def taken(self, folder: str, number: int) -> bool:
        return layout.number_taken(folder, number)

    def damaged(self, folder: str) -> List[Tuple[int, str]]:
        return layout.damaged_checkpoints(folder)

    def set_aside_damaged(self, checkpoint: str) -> str:
        """Rename the damaged ``checkpoint`` to ``checkpoint_N.damaged`` (see `layout.set_aside_damaged`)."""
        return layout.set_aside_damaged(checkpoint)

    def refusal(self, target: str) -> Optional[str]:
        foreign = layout.foreign_entries(target)
        if foreign:
            return (f"the directory holds {', '.join(foreign[:5])}, which no checkpoint wrote, and saving replaces the "
                    "directory whole. Pass another output_dir or use automatic naming.")
        return None

    def staging(self, final: str, token: str) -> str:
        return layout.temporary_dir(final, token)

    def write(self, path: str, arrays: Mapping[str, Any], live: bool, metadata: Mapping[str, str] = ()
              ) -> Dict[str, object]:
        return safetensors_io.write(path, arrays, metadata, live=live)

    def prepare(self, staging: str) -> None:
        # the folders a first save creates above the checkpoint (project_dir/checkpoints...) are made
        # durable here; the temporary folder itself is, with its contents, by the commit (`fsync_tree`)
        layout.make_dirs(os.path.dirname(os.path.abspath(staging)))
        os.makedirs(staging, exist_ok=True)

    def commit(self, staging: str, final: str, token: str, body: Dict[str, Any]) -> None:
        write_manifest(staging, body)
        layout.fsync_tree(staging)  # contents before the name: a power loss never leaves a torn checkpoint
        layout.commit(staging, final, token)

    def discard(self, staging: str) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def after_commit(self, final: str, automatic: bool, total_limit: Optional[int], leased: bool = True) -> None:
        """Delete what crashed saves left beside ``final``, then (automatic naming) the oldest
        checkpoints beyond ``total_limit``; raises `OSError` when a retention delete fails.
        ``leased`` is for stores: a folder's main process holds its lock (`lock`) throughout."""
        parent = os.path.dirname(os.path.abspath(final))
        layout.remove_stale_temporaries(parent)
        if automatic:
            layout.apply_retention(parent, total_limit, keep=final)

    def has_manifest(self, directory: str) -> bool:
        return os.path.isfile(os.path.join(directory, MANIFEST))

    def read_manifest(self, directory: str) -> Dict[str, Any]:
        return read_manifest(directory)

    def read(self, path: str, size: int, checksum: str) -> Dict[str, np.ndarray]:
        return safetensors_io.read(path, size, checksum)

    # -- loads in bounded memory: verify first, then read into the live arrays (see the manager)
    def verify(self, path: str, size: int, checksum: str, copy_to: Optional[str] = None) -> Any:
        """Hash the file in a bounded buffer and compare; returns its identity for `changed`.
        (``copy_to`` is for stores: a file here is read again from where it is.)"""
        return safetensors_io.verify_for_reader(path, size, checksum)

    def describe(self, path: str, size: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        return safetensors_io.describe_file(path, size)

    def changed(self, path: str, identity: Any) -> bool:
        return safetensors_io.changed_since(path, identity)

    def read_placed(self, path: str, size: int, checksum: str, into: Mapping[str, np.ndarray]
                    ) -> Tuple[Dict[str, np.ndarray], List[str]]:
        return safetensors_io.read_placed(path, size, checksum, into)

    # -- an async save's part reports: each process's, for the main process that commits
    report_poll_seconds = 0.01

    def post_report(self, path: str, report: Dict[str, Any]) -> None:
        """Leave ``report`` at ``path`` atomically (the main process polls with `take_report`)."""
        with open(path + ".partial", "w") as handle:
            json.dump(report, handle)
        os.replace(path + ".partial", path)

    def take_report(self, path: str) -> Optional[Dict[str, Any]]:
        """The report at ``path``, removed; None while there is none."""
        if not os.path.exists(path):
            return None
        with open(path) as handle:
            report = json.load(handle)
        os.remove(path)
        return report


class StoreError(OSError):
    """An object store could not be reached or refused a request once its client's retries were
    spent; an `OSError`, so that a save reports it from every process like a full disk."""


@contextlib.contextmanager
def _reaching(url: str, doing: str, error: type = StoreError) -> Iterator[None]:
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


class ObjectStore:
    """Checkpoints under an fsspec URL. Credentials and endpoint come from where the client
    library looks (for S3: ``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``~/.aws/config``...).
    Transient errors are retried by the client (s3fs and botocore: with backoff); what is left
    is raised as a `StoreError` naming the object."""

    atomic_replace = False

    def __init__(self, url: str) -> None:
        self.fs, _ = _filesystem(url)
        self._heads: Dict[str, bytes] = {}  # each verified object's first bytes (its header)

    def _path(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    def numbered(self, folder: str) -> List[Tuple[int, str]]:
        """Committed ``checkpoint_N`` prefixes (their manifest exists), by N."""
        return self._committed(folder, self._names(folder))

    def _committed(self, folder: str, names: List[str]) -> List[Tuple[int, str]]:
        """The committed ones among the entries ``names`` of ``folder``, by N."""
        found = []
        for name in names:
            match = _AUTO_NAME.match(name)
            path = f"{folder.rstrip('/')}/{name}"
            if match and self.has_manifest(path):
                found.append((int(match.group(1)), path))
        return sorted(found)

    def highest_number(self, folder: str) -> Optional[int]:
        """The highest N of any ``checkpoint_N`` prefix, committed or not, or set aside as damaged."""
        numbers = [int(m.group(1)) for m in map(_AUTO_NAME.match, self._names(folder)) if m]
        return max(numbers) if numbers else None

    def taken(self, folder: str, number: int) -> bool:
        """Whether ``checkpoint_{number}`` of ``folder`` holds a commit (its manifest) or a damaged
        checkpoint set aside: asked of the store object by object (never a listing, which may be
        stale), so that automatic naming never writes over either.

        Example:
            >>> ObjectStore("s3://bucket/run").taken("s3://bucket/run/checkpoints", 3)
            False
        """
        prefix = f"{folder.rstrip('/')}/checkpoint_{number}"
        return self._exists_now(f"{prefix}/{MANIFEST}") or self._exists_now(f"{prefix}/{DAMAGED_MANIFEST}")

    def _exists_now(self, url: str) -> bool:
        """Whether the object ``url`` exists, asked of the store (never a cached listing)."""
        try:
            with _reaching(url, "looking up"):
                self.fs.info(self._path(url), refresh=True)
        except FileNotFoundError:
            return False
        return True

    def damaged(self, folder: str) -> List[Tuple[int, str]]:
        """The ``checkpoint_N`` prefixes of ``folder`` set aside as damaged (`set_aside_damaged`), by N."""
        found = []
        for name in self._names(folder):
            match = _AUTO_NAME.match(name)
            path = f"{folder.rstrip('/')}/{name}"
            if match and not self.has_manifest(path) and self._exists_now(f"{path}/{DAMAGED_MANIFEST}"):
                found.append((int(match.group(1)), path))
        return sorted(found)

    def set_aside_damaged(self, checkpoint: str) -> str:
        """Set the damaged ``checkpoint`` aside: a store has no rename, so its manifest is copied to
        ``manifest.json.damaged`` (on the store: no download), then deleted. From then on the prefix
        is never listed, loaded or counted by retention, and no cleanup deletes it (the marker
        says why it has no manifest); its files are kept. Returns the marker's URL. Raises
        `StoreError` when the store refuses; a crash in between leaves both objects, and the next
        automatic load sets it aside again.

        Example:
            >>> ObjectStore("s3://b/run").set_aside_damaged("s3://b/run/checkpoints/checkpoint_2")
            's3://b/run/checkpoints/checkpoint_2/manifest.json.damaged'
        """
        manifest, marker = f"{checkpoint.rstrip('/')}/{MANIFEST}", f"{checkpoint.rstrip('/')}/{DAMAGED_MANIFEST}"
        try:
            with _reaching(marker, "setting the damaged checkpoint aside (copying its manifest)"):
                self.fs.copy(self._path(manifest), self._path(marker))
            with _reaching(manifest, "setting the damaged checkpoint aside (deleting its manifest)"):
                self.fs.rm_file(self._path(manifest))
        except FileNotFoundError:  # its manifest is gone already: it is listed no more
            pass
        return marker

    def _names(self, folder: str) -> List[str]:
        path = self._path(folder)
        self.fs.invalidate_cache(path)  # other processes and runs write here: never a cached listing
        try:
            with _reaching(folder, "listing"):
                entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def refusal(self, target: str) -> Optional[str]:
        names = self._names(target)
        if MANIFEST in names:
            return ("it holds a checkpoint, and an object store cannot replace one atomically (there is no rename): "
                    "save to a new URL, delete the old checkpoint first, or use automatic naming.")
        if names:
            return (f"the prefix holds {', '.join(sorted(names)[:5])}, which no checkpoint wrote. Pass another "
                    "output_dir or use automatic naming.")
        return None

    def staging(self, final: str, token: str) -> str:
        return final  # no rename: the manifest, written last, commits the files where they are

    def prepare(self, staging: str) -> None:
        pass  # prefixes need no creating

    def write(self, path: str, arrays: Mapping[str, Any], live: bool, metadata: Mapping[str, str] = ()
              ) -> Dict[str, object]:
        """Stream one file to the store (a multipart upload of `PART_BYTES` parts), hashed as it goes."""
        del live  # every chunk is hashed and then written from the same bytes: what is hashed is what is sent
        with _reaching(path, "writing"), self.fs.open(self._path(path), "wb", block_size=PART_BYTES) as handle:
            return safetensors_io.write_stream(handle, arrays, metadata=metadata)

    # -- for a backend's sharded reader (torch DCP): what it needs of the objects under a prefix
    def files(self, folder: str) -> List[str]:
        """Every object below ``folder``, named relative to it, sorted."""
        root = self._path(folder).rstrip("/")
        self.fs.invalidate_cache(root)
        try:
            with _reaching(folder, "listing", CheckpointError):
                found = self.fs.find(root)
        except FileNotFoundError:
            return []
        return sorted(path[len(root) + 1:] for path in found if path.startswith(root + "/"))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object ``path``."""
        with _reaching(path, "reading", CheckpointError):
            data = self.fs.cat_file(self._path(path), start=start, end=end)
        if len(data) != end - start:
            raise CheckpointError(f"{path}: ended before byte {end}; nothing was restored." + see("file-ended"))
        return data

    def size_of(self, path: str) -> int:
        return int(self._info(path)["size"])

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[Any]:
        """``path`` opened for reading in order, one request per `PART_BYTES` (or per larger read)."""
        with _reaching(path, "reading", CheckpointError), self._open(path) as raw:
            yield io.BufferedReader(raw, buffer_size=PART_BYTES)

    def commit(self, staging: str, final: str, token: str, body: Dict[str, Any]) -> None:
        url = f"{final.rstrip('/')}/{MANIFEST}"
        with _reaching(url, "writing the manifest (the commit)"):
            self.fs.pipe_file(self._path(url), manifest_bytes(body))

    def delete(self, prefix: str) -> None:
        """Delete the checkpoint ``prefix``: its manifest first (the commit: from then on it is
        never listed or loaded, so a delete that fails half-way never leaves a manifest whose
        objects are gone), then every other object. Raises `StoreError` saying what is left when
        the store refuses either.

        Example:
            >>> ObjectStore("s3://b/run").delete("s3://b/run/checkpoints/checkpoint_0")
        """
        manifest = f"{prefix.rstrip('/')}/{MANIFEST}"
        for url, what, left in ((manifest, "its manifest",
                                 "nothing was deleted: the checkpoint is intact and still listed"),
                                (prefix, "its files", "its manifest is deleted, so it is never listed or loaded again; "
                                 "its remaining objects are deleted by a later save of a run that holds this prefix's "
                                 "lease, or delete the prefix with your store's tools")):
            try:
                if url == manifest:
                    self.fs.rm_file(self._path(url))
                else:
                    self.fs.rm(self._path(url), recursive=True)
            except FileNotFoundError:
                continue
            except Exception as err:  # noqa: BLE001 - whatever the client raises: say what is left
                raise StoreError(f"{prefix}: deleting {what} failed after the storage client's retries "
                                 f"({type(err).__name__}: {err}); {left}." + see("retention-delete-failed")) from err

    def discard(self, staging: str) -> None:
        """Delete what a failed save wrote under ``staging`` (no manifest: never loaded), as far as
        the store lets it: best effort, so that the save's own error is the one raised; what is
        left is deleted by a later save of a run that holds the prefix's lease."""
        try:
            self.delete(staging)
        except StoreError:
            pass

    def after_commit(self, final: str, automatic: bool, total_limit: Optional[int], leased: bool = True) -> None:
        """With automatic naming: the prefixes of crashed saves (a ``checkpoint_N`` below the new
        one without a manifest, and not set aside as damaged) and their unfinished uploads, only
        when this run holds the prefix's lease (``leased``: without one such a prefix may be
        another live run's save in progress); then retention. Every delete is tried; the first
        that failed is raised (`StoreError`) once all were."""
        if not automatic:
            return
        folder, name = final.rstrip("/").rsplit("/", 1)
        newest = int(_AUTO_NAME.match(name).group(1))  # type: ignore[union-attr]
        names = self._names(folder)  # one listing for both: nothing else writes here meanwhile (one run per prefix)
        committed = self._committed(folder, names)
        complete = {n for n, _ in committed}
        failed: List[StoreError] = []

        def delete(prefix: str) -> None:
            try:
                self.delete(prefix)
            except StoreError as err:
                failed.append(err)

        if leased:
            for n in [int(m.group(1)) for m in map(_AUTO_NAME.match, names) if m]:
                prefix = f"{folder}/checkpoint_{n}"
                if n < newest and n not in complete and not self._exists_now(f"{prefix}/{DAMAGED_MANIFEST}"):
                    delete(prefix)
            self._abort_abandoned_uploads(folder, newest)
        excess = len(committed) - (total_limit or len(committed))
        for n, path in committed:
            if excess <= 0:
                break
            if n != newest:
                delete(path)
                excess -= 1
        if failed:
            raise failed[0]

    def _abort_abandoned_uploads(self, folder: str, newest: int) -> None:
        """Abort the multipart uploads a crashed save began under ``checkpoint_N`` (N up to
        ``newest``: a crash that left no object lets the next save take its number) and never
        completed: they hold no object, so no listing shows them, but the store keeps (and
        bills) their parts until they are aborted. Every upload of this run's saves is complete
        by now (saves to a store are synchronous; one run per prefix). Only where the client can
        list them (S3); best effort: a later save tries again."""
        call = getattr(self.fs, "call_s3", None)
        if call is None:
            return
        bucket, _, prefix = self._path(folder).rstrip("/").partition("/")
        prefix = f"{prefix}/" if prefix else ""
        try:
            with _reaching(folder, "listing unfinished uploads"):
                page: Dict[str, Any] = {}
                while True:
                    listed = call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **page)
                    for upload in listed.get("Uploads", []):
                        match = _AUTO_NAME.match(upload["Key"][len(prefix):].split("/", 1)[0])
                        if match and int(match.group(1)) <= newest:
                            call("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                 UploadId=upload["UploadId"])
                    if not listed.get("IsTruncated"):
                        return
                    page = {"KeyMarker": listed["NextKeyMarker"], "UploadIdMarker": listed["NextUploadIdMarker"]}
        except StoreError:
            pass

    def has_manifest(self, directory: str) -> bool:
        url = f"{directory.rstrip('/')}/{MANIFEST}"
        with _reaching(url, "looking up"):
            return bool(self.fs.exists(self._path(url)))

    def read_manifest(self, directory: str) -> Dict[str, Any]:
        url = f"{directory.rstrip('/')}/{MANIFEST}"
        try:
            with _reaching(url, "reading", CheckpointError):
                size = self.fs.size(self._path(url))
        except FileNotFoundError as err:
            raise CheckpointError(f"{url}: missing; this prefix holds no complete checkpoint."
                                  + see("manifest-missing")) from err
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{url}: larger than {MAX_MANIFEST_BYTES} bytes; refusing to parse it."
                                  + see("manifest-too-large"))
        with _reaching(url, "reading", CheckpointError):
            text = self.fs.cat_file(self._path(url))
        return check_manifest(parse_manifest_json(text, url), directory)

    def read(self, path: str, size: int, checksum: str) -> Dict[str, np.ndarray]:
        """Stream one file from the store into private arrays, verified (see `safetensors_io.read_stream`)."""
        return self.read_placed(path, size, checksum, {})[0]

    def read_placed(self, path: str, size: int, checksum: str, into: Mapping[str, np.ndarray]
                    ) -> Tuple[Dict[str, np.ndarray], List[str]]:
        """`read`, with the arrays named in ``into`` streamed into that memory (`safetensors_io.read_stream_placed`)."""
        self.identity(path, size)
        with self.reading(path) as handle:  # one request per part or large array, not one per small array
            return safetensors_io.read_stream_placed(handle, path, size, checksum, into, chunk=PART_BYTES)

    def verify(self, path: str, size: int, checksum: str, copy_to: Optional[str] = None) -> Any:
        """Stream the object through a bounded buffer, hashing it, and compare; returns its ETag.
        ``copy_to``: also write what streams by into that new local file (the load's second pass
        then reads the verified copy from the local disk instead of downloading it again); a
        copy the local disk could not take (full) is removed, and the object is verified still."""
        copy = open(copy_to, "xb") if copy_to else None

        def keep(at: int, chunk: memoryview) -> None:
            nonlocal copy
            if not at:  # the header, for `describe` (no request of its own)
                self._heads[path] = bytes(chunk[:_HEAD_BYTES])
            if copy is not None:
                try:
                    copy.write(chunk)
                except OSError:
                    copy.close()
                    copy = None
                    os.remove(copy_to)

        try:
            return self._stream_verified(path, size, checksum, keep)
        finally:
            if copy is not None:
                copy.close()

    def _stream_verified(self, path: str, size: int, checksum: str, each: Any) -> Any:
        """`_stream`, then compares size and xxh3 with the manifest's; returns the ETag."""
        identity = self.identity(path, size)
        got = self._stream(path, min(PART_BYTES, max(size, 1)), each)
        if got["size"] != size:
            raise safetensors_io.size_mismatch(path, got["size"], size)
        if got["xxh3"] != checksum:
            raise safetensors_io.checksum_mismatch(path)
        return identity

    def _stream(self, path: str, buffer_bytes: int, each: Any) -> Dict[str, object]:
        """Stream the object through one bounded buffer, hashing it and handing each chunk to
        ``each(offset, chunk)``; its size and xxh3."""
        digest, buffer = xxhash.xxh3_64(), bytearray(buffer_bytes)
        view, total = memoryview(buffer), 0
        with _reaching(path, "reading", CheckpointError), self._open(path) as handle:
            while True:
                count = handle.readinto(view)
                if not count:
                    break
                each(total, view[:count])
                digest.update(view[:count])
                total += count
        return {"size": total, "xxh3": digest.hexdigest()}

    def describe(self, path: str, size: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        head = self._heads.get(path, b"")
        if not head:  # not streamed by `verify`: its size is compared first (one request)
            self.identity(path, size)

        def read_at(at: int, count: int) -> bytes:
            if at + count <= len(head):  # read by `verify`, which checked it against the manifest
                return head[at:at + count]
            return self.fs.cat_file(self._path(path), start=at, end=at + count)

        with _reaching(path, "reading", CheckpointError):
            return safetensors_io.describe(read_at, path, size)

    def changed(self, path: str, identity: Any) -> bool:
        try:
            return self.identity(path, None) != identity
        except CheckpointError:
            return True

    def identity(self, path: str, size: Optional[int]) -> Any:
        """What changes with every write of the object (S3's ETag, GCS's generation...: each
        client names them its own way), after its size was compared with ``size``."""
        info = self._info(path)
        if size is not None and info["size"] != size:
            raise safetensors_io.size_mismatch(path, info["size"], size)
        return (info["size"],) + tuple((key, str(info[key])) for key in _IDENTITY_KEYS if info.get(key) is not None)

    def _info(self, path: str) -> Dict[str, Any]:
        """The object's metadata, asked of the store (never a cached listing)."""
        try:
            with _reaching(path, "reading", CheckpointError):
                return self.fs.info(self._path(path), refresh=True)
        except FileNotFoundError as err:
            raise CheckpointError(f"{path}: missing from the store; the checkpoint is incomplete or was partly deleted."
                                  + see("cannot-open-file")) from err

    def _open(self, path: str) -> Any:
        return self.fs.open(self._path(path), "rb", block_size=PART_BYTES, cache_type="none")

    # -- an async save's part reports: small objects beside the files, deleted once read
    report_poll_seconds = 0.1  # a look is one request

    def post_report(self, path: str, report: Dict[str, Any]) -> None:
        with _reaching(path, "writing"):
            self.fs.pipe_file(self._path(path), json.dumps(report).encode())

    def take_report(self, path: str) -> Optional[Dict[str, Any]]:
        try:
            with _reaching(path, "reading"):
                text = self.fs.cat_file(self._path(path))
        except FileNotFoundError:
            return None
        with _reaching(path, "deleting"):
            self.fs.rm_file(self._path(path))
        return json.loads(text)

    # -- files that save-state hooks write into a local folder (user code writes with open())
    def upload(self, local: str, url: str) -> Dict[str, object]:
        """Stream the local file ``local`` to ``url``, hashed in the same pass; its size and xxh3."""
        digest, buffer, size = xxhash.xxh3_64(), bytearray(PART_BYTES), 0
        view = memoryview(buffer)
        with open(local, "rb") as source, _reaching(url, "writing"), \
                self.fs.open(self._path(url), "wb", block_size=PART_BYTES) as handle:
            while True:
                count = source.readinto(view)
                if not count:
                    break
                digest.update(view[:count])
                handle.write(view[:count])
                size += count
        return {"size": size, "xxh3": digest.hexdigest()}

    def download(self, url: str, local: str, size: int, checksum: str) -> None:
        """Stream ``url`` into the new local file ``local``, verified (size and xxh3) as it comes."""
        with open(local, "xb") as target:
            self._stream_verified(url, size, checksum, lambda at, chunk: target.write(chunk))

    def copy(self, url: str, local: str) -> Dict[str, object]:
        """Stream ``url`` into the new local file ``local`` through one bounded buffer, hashing it
        in the same pass; its size and xxh3, for the caller to compare.

        Example:
            >>> ObjectStore("s3://bucket/run").copy("s3://bucket/run/x.safetensors", "/tmp/copy/x.safetensors")
            {'size': 4200, 'xxh3': '...'}
        """
        with open(local, "xb") as target:
            return self._stream(url, PART_BYTES, lambda at, chunk: target.write(chunk))


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


def _filesystem(url: str) -> Tuple[Any, str]:
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


def location_of(path: str) -> Location:
    """The `Location` of a checkpoint path: an `ObjectStore` for a URL, else a `Folder`."""
    return ObjectStore(path) if is_url(path) else Folder()
