"""Checkpoints in an object store named by an fsspec URL (``s3://``, ``gs://``...): `ObjectStore`,
the `Location` of a URL (`unified.checkpoint.store.location_of`).

There is no rename, so the files go straight to the checkpoint's prefix and the manifest,
written last in one request, is the commit. A prefix without its manifest is never listed,
loaded or counted by retention; what a crashed save left there is deleted after a later commit
of a run that holds the prefix's lease (`lease`; without one it may be another live run's save,
and is left alone). A checkpoint is deleted manifest first; a damaged one that an automatic load
skipped is set aside by moving its manifest to ``manifest.json.damaged``
(`ObjectStore.set_aside_damaged`). Files are streamed (multipart uploads) and hashed in the same
pass; nothing is staged whole on local disk. A load verifies each object as it downloads it,
into a private local copy when the local disk has room (the load's `Placement._copy_for`), from
which the live arrays are then filled. The client and its errors: `store_client`.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np
import xxhash

from ..errors import CheckpointError, see
from . import layout, safetensors_io
from .manifest import MANIFEST, MAX_MANIFEST_BYTES, check_manifest, manifest_bytes, parse_manifest_json
from .store_client import Ranges, StoreError, filesystem, reaching

_HEAD_BYTES = 1 << 20  # what `ObjectStore.verify` keeps of an object's first bytes: its header, usually
PART_BYTES = 32 << 20  # one multipart upload part (S3's least is 5 MiB): the memory a file's upload holds
# the metadata of an object that changes when it is written again, as fsspec clients name it: s3fs
# (ETag, VersionId, LastModified), gcsfs (generation, etag, updated), adlfs (etag, last_modified)
_IDENTITY_KEYS = ("ETag", "VersionId", "LastModified", "generation", "etag", "updated", "last_modified", "mtime")
_AUTO_NAME = layout._AUTO_NAME  # checkpoint_N: one pattern for folders and stores
# A damaged checkpoint set aside on a store (no rename): its manifest, moved here (`ObjectStore.set_aside_damaged`).
DAMAGED_MANIFEST = MANIFEST + layout.DAMAGED_MARK
_MISSING = "missing from the store; the checkpoint is incomplete or was partly deleted."


class ObjectStore:
    """Checkpoints under an fsspec URL. Credentials and endpoint come from where the client
    library looks (for S3: ``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``~/.aws/config``...).
    Transient errors are retried by the client (s3fs and botocore: with backoff); what is left
    is raised as a `StoreError` naming the object."""

    atomic_replace = False

    def __init__(self, url: str) -> None:
        self.fs, _ = filesystem(url)
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
            with reaching(url, "looking up"):
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
            with reaching(marker, "setting the damaged checkpoint aside (copying its manifest)"):
                self.fs.copy(self._path(manifest), self._path(marker))
            with reaching(manifest, "setting the damaged checkpoint aside (deleting its manifest)"):
                self.fs.rm_file(self._path(manifest))
        except FileNotFoundError:  # its manifest is gone already: it is listed no more
            pass
        return marker

    def _names(self, folder: str) -> List[str]:
        path = self._path(folder)
        self.fs.invalidate_cache(path)  # other processes and runs write here: never a cached listing
        try:
            with reaching(folder, "listing"):
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
        with reaching(path, "writing"), self.fs.open(self._path(path), "wb", block_size=PART_BYTES) as handle:
            return safetensors_io.write_stream(handle, arrays, metadata=metadata)

    # -- for a backend's sharded reader (torch DCP): what it needs of the objects under a prefix
    def files(self, folder: str) -> List[str]:
        """Every object below ``folder``, named relative to it, sorted."""
        root = self._path(folder).rstrip("/")
        self.fs.invalidate_cache(root)
        try:
            with reaching(folder, "listing", CheckpointError):
                found = self.fs.find(root)
        except FileNotFoundError:
            return []
        return sorted(path[len(root) + 1:] for path in found if path.startswith(root + "/"))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object ``path``."""
        with reaching(path, "reading", CheckpointError):
            data = self.fs.cat_file(self._path(path), start=start, end=end)
        if len(data) != end - start:
            raise CheckpointError(f"{path}: ended before byte {end}; nothing was restored." + see("file-ended"))
        return data

    def size_of(self, path: str) -> int:
        return int(self._info(path)["size"])

    @contextlib.contextmanager
    def reading(self, path: str, size: Optional[int] = None) -> Iterator[Any]:
        """``path`` opened for reading in order, one request per `PART_BYTES` (or per larger read);
        ``size``: as `_open` (then no metadata request)."""
        with reaching(path, "reading", CheckpointError), self._open(path, size) as raw:
            yield io.BufferedReader(raw, buffer_size=PART_BYTES)

    def commit(self, staging: str, final: str, token: str, body: Dict[str, Any]) -> None:
        url = f"{final.rstrip('/')}/{MANIFEST}"
        with reaching(url, "writing the manifest (the commit)"):
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
            with reaching(folder, "listing unfinished uploads"):
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
        with reaching(url, "looking up"):
            return bool(self.fs.exists(self._path(url)))

    def read_manifest(self, directory: str) -> Dict[str, Any]:
        url = f"{directory.rstrip('/')}/{MANIFEST}"
        try:
            with reaching(url, "reading", CheckpointError):
                size = self.fs.size(self._path(url))
        except FileNotFoundError as err:
            raise CheckpointError(f"{url}: missing; this prefix holds no complete checkpoint."
                                  + see("manifest-missing")) from err
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{url}: larger than {MAX_MANIFEST_BYTES} bytes; refusing to parse it."
                                  + see("manifest-too-large"))
        with reaching(url, "reading", CheckpointError):
            text = self.fs.cat_file(self._path(url))
        return check_manifest(parse_manifest_json(text, url), directory)

    def read(self, path: str, size: int, checksum: str) -> Dict[str, np.ndarray]:
        """Stream one file from the store into private arrays, verified (see `safetensors_io.read_stream`)."""
        return self.read_placed(path, size, checksum, {})[0]

    def read_placed(self, path: str, size: int, checksum: str, into: Mapping[str, np.ndarray]
                    ) -> Tuple[Dict[str, np.ndarray], List[str]]:
        """`read`, with the arrays named in ``into`` streamed into that memory (`safetensors_io.read_stream_placed`).

        No metadata request (HEAD) of its own, and none by the client (`_open` with the
        manifest's ``size``: ranged reads alone): in a one-pass load `describe` asked for the
        object's metadata once already and compared its size before anything was restored, and
        what this read places is checked by the stream itself, as a folder's file is. An object
        changed since (or meanwhile: no ETag pins the reads) is refused here all the same: one
        that ends before ``size`` bytes by the stream's length ("ended before its ... bytes"),
        any other whose first ``size`` bytes differ by their xxh3, compared with the manifest's
        at the end; a missing one raises the `CheckpointError` `identity` would. Bytes past
        ``size`` are never read or placed: what is placed is exactly the bytes the manifest
        hashed. (`read`, of an object not described, makes no metadata request at all.)"""
        try:
            with self.reading(path, size) as handle:  # one request per part or large array, not one per small array
                return safetensors_io.read_stream_placed(handle, path, size, checksum, into, chunk=PART_BYTES)
        except FileNotFoundError as err:
            raise CheckpointError(f"{path}: {_MISSING}" + see("cannot-open-file")) from err

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
        identity = self.identity(path, size)  # its one metadata request: then read by ranges alone (`_open`)
        got = self._stream(path, min(PART_BYTES, max(size, 1)), each, size)
        if got["size"] != size:
            raise safetensors_io.size_mismatch(path, got["size"], size)
        if got["xxh3"] != checksum:
            raise safetensors_io.checksum_mismatch(path)
        return identity

    def _stream(self, path: str, buffer_bytes: int, each: Any, size: Optional[int] = None) -> Dict[str, object]:
        """Stream the object through one bounded buffer, hashing it and handing each chunk to
        ``each(offset, chunk)``; its size and xxh3. ``size``: as `_open`."""
        digest, buffer = xxhash.xxh3_64(), bytearray(buffer_bytes)
        view, total = memoryview(buffer), 0
        with reaching(path, "reading", CheckpointError), self._open(path, size) as handle:
            while True:
                count = handle.readinto(view)
                if not count:
                    break
                each(total, view[:count])
                digest.update(view[:count])
                total += count
        return {"size": total, "xxh3": digest.hexdigest()}

    def describe(self, path: str, size: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        """Each entry's dtype and shape, from the object's header. Not streamed by `verify` (a
        one-pass load): its size is compared with the manifest's first, before anything is
        restored; that is the object's one metadata request in the load (`read_placed` asks none,
        and says why none is needed)."""
        head = self._heads.get(path, b"")
        if not head:  # not streamed by `verify`: its size is compared first (one request)
            self.identity(path, size)

        def read_at(at: int, count: int) -> bytes:
            if at + count <= len(head):  # read by `verify`, which checked it against the manifest
                return head[at:at + count]
            return self.fs.cat_file(self._path(path), start=at, end=at + count)

        with reaching(path, "reading", CheckpointError):
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
            with reaching(path, "reading", CheckpointError):
                return self.fs.info(self._path(path), refresh=True)
        except FileNotFoundError as err:
            raise CheckpointError(f"{path}: {_MISSING}" + see("cannot-open-file")) from err

    def _open(self, path: str, size: Optional[int] = None) -> Any:
        """``path`` opened for reading. ``size``: its size, compared already (or checked by the
        caller as it reads): then read by ranged requests alone (`Ranges`), with no metadata
        request (s3fs's and gcsfs's files ask for the object's metadata when opened or first read)."""
        if size is not None:
            return Ranges(self.fs, self._path(path), size)
        return self.fs.open(self._path(path), "rb", block_size=PART_BYTES, cache_type="none")

    # -- an async save's part reports: small objects beside the files, deleted once read
    report_poll_seconds = 0.1  # a look is one request

    def post_report(self, path: str, report: Dict[str, Any]) -> None:
        with reaching(path, "writing"):
            self.fs.pipe_file(self._path(path), json.dumps(report).encode())

    def take_report(self, path: str) -> Optional[Dict[str, Any]]:
        try:
            with reaching(path, "reading"):
                text = self.fs.cat_file(self._path(path))
        except FileNotFoundError:
            return None
        with reaching(path, "deleting"):
            self.fs.rm_file(self._path(path))
        return json.loads(text)

    # -- files that save-state hooks write into a local folder (user code writes with open())
    def upload(self, local: str, url: str) -> Dict[str, object]:
        """Stream the local file ``local`` to ``url``, hashed in the same pass; its size and xxh3."""
        digest, buffer, size = xxhash.xxh3_64(), bytearray(PART_BYTES), 0
        view = memoryview(buffer)
        with open(local, "rb") as source, reaching(url, "writing"), \
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
