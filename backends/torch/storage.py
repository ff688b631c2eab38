"""torch DCP storage that writes and reads its safetensors files through `unified`'s own
safetensors I/O, so that every byte is hashed in the pass that writes or reads it.

torch's ``HuggingFaceStorageWriter`` builds each process's whole file as one ``bytes`` object
before writing it (2x the process's own shards at the peak) and its reader maps every file;
`unified` then hashed each file in a pass of its own. These two keep DCP's planning (which file
holds which slice: the same files, names and ``DCP_SHARDING_INFO`` headers, so either reader
opens what the other wrote) and replace the file I/O:

- `HashingWriter` streams each process's shards from their tensors into its file
  (`safetensors_io.write`: no copy of the whole file, xxh3 in the same pass) and keeps the
  file's size and checksum in ``written``.
- `HashingReader` reads a file that this process needs whole (a restart on the same process
  count: each process its own file) straight into the fresh tensors DCP asks it to fill, hashing
  it in the same pass (``hashed``); a file it needs only slices of (a restart on another count)
  goes through torch's reader and is hashed by `unified` afterwards.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from unified.checkpoint import safetensors_io
from unified.checkpoint.store import headers_of, location_of, private_copy
from unified.config import is_url
from unified.errors import CheckpointError, see

from .tensors import SAFETENSORS_DTYPES, export_tensor

__all__ = ["HashingWriter", "HashingReader", "Fill", "fill"]

_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
# torch/distributed/checkpoint/_hf_utils.py: what its reader looks up in a file's __metadata__
_SHARDING_INFO = "DCP_SHARDING_INFO"
_SAVED_OFFSETS = "saved_offsets"


def _file_name(shard_index: int) -> str:
    """The name torch's writer gives process ``shard_index``'s file (``_hf_utils._gen_file_name``)."""
    return f"shard-{shard_index:05d}-model-00001-of-00001.safetensors"


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


# What a deferred load reads into one tensor: (file, byte offset, tensor, check). ``check`` is
# None for a verified private copy (it cannot change); for a file read where it is, the entry's
# xxh3 in the first pass and the file's identity then (`safetensors_io.identity`).
Fill = Tuple[str, int, torch.Tensor, Optional[Tuple[str, Tuple[int, ...]]]]


def fill(fills: List[Fill]) -> None:
    """Read each fill's bytes into its tensor, in place: the second pass of a deferred load. A
    file read where it is must be the one the first pass hashed (its identity), and each entry's
    bytes must hash as they did then; otherwise `CheckpointError` (what was filled before stays)."""
    for path, start, target, check in fills:
        raw = export_tensor(target)[2]
        if check is not None and safetensors_io.changed_since(path, check[1]):
            raise CheckpointError(f"{path}: changed after it was verified." + see("changed-while-placed"))
        safetensors_io.read_range_into(path, start, raw)
        if check is not None and xxhash.xxh3_64_hexdigest(raw) != check[0]:
            raise CheckpointError(f"{path}: changed while it was read into the live objects."
                                  + see("changed-while-placed"))


class HashingWriter(HuggingFaceStorageWriter):
    """``HuggingFaceStorageWriter(path, save_distributed=True)`` whose `write_data` streams.

    Example:
        >>> writer = HashingWriter("ckpt/sharded.dcp")
        >>> # dcp's planning as usual, then writer.write_data(plan, planner); writer.written
    """

    def __init__(self, path: str) -> None:
        super().__init__(path, save_distributed=True)
        self.target = path  # a folder or an object store's URL (DCP's Path would mangle "s3://")
        self.written: Dict[str, Dict[str, Any]] = {}

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if is_url(self.target):  # no folder to make, no DCP metadata to look for: the manifest is ours
            return plan
        return super().prepare_local_plan(plan)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        if not plan.items:
            return _done([])
        if any(item.type == WriteItemType.BYTE_IO for item in plan.items):
            raise CheckpointError("sharded state holds a non-tensor value, which the safetensors storage cannot "
                                  "write." + see("save-failed"))
        name = _file_name(plan.storage_data["shard_index"])
        arrays, offsets = {}, {}
        for item in plan.items:
            fqn = item.index.fqn
            arrays[fqn] = export_tensor(planner.resolve_data(item))
            offsets[fqn] = {_SAVED_OFFSETS: list(item.tensor_data.chunk.offsets)}
        path = os.path.join(self.target, name)  # a folder's path or an object's URL
        written = location_of(path).write(path, arrays, live=False, metadata={
            _SHARDING_INFO: json.dumps(offsets), "DCP_VERSION": "1.0", "format": "pt"})
        self.written[name] = written
        return _done([WriteResult(index=item.index, size_in_bytes=arrays[item.index.fqn][2].nbytes, storage_data=name)
                      for item in plan.items])


class HashingReader(HuggingFaceStorageReader):
    """``HuggingFaceStorageReader`` that reads the files it needs whole in one hashed pass.

    Example:
        >>> reader = HashingReader("ckpt/sharded.dcp")
        >>> dcp.load(fresh_tensors, storage_reader=reader); reader.hashed
    """

    def __init__(self, path: str, defer: bool = False,
                 copy_to: Optional[Callable[[str, int], Optional[str]]] = None,
                 hash_when_placed: bool = False) -> None:
        super().__init__(path)
        self.target = path  # a folder or an object store's URL (DCP's Path would mangle "s3://")
        self.store = location_of(path) if is_url(path) else None
        self.hashed: Dict[str, Dict[str, Any]] = {}
        # defer: nothing is read into a tensor here. The files this process needs whole are hashed
        # (a store's into private local copies, ``copy_to``), and `fills` says what to read from
        # them into which tensor, by the state dict's key, once the load has checked everything
        # (`Fill`). ``deferred`` is False when a file was needed otherwise: nothing was filled or
        # copied, read the usual way.
        if copy_to is not None and self.store is None:
            raise ValueError("HashingReader: copy_to is for an object store's URL." + see("sharded-load-failed"))
        self.defer = defer or copy_to is not None
        self.copy_to = copy_to
        self.fills: Dict[str, List[Fill]] = {}
        self.deferred = False
        # one pass (``hash_when_placed``, with ``defer``): the files needed whole are neither hashed
        # nor copied now; `fill_whole` reads each straight into its tensors, hashed in that pass,
        # when the first array that needs it is made. ``whole``: path -> its tensors by entry;
        # ``files_of``: the state dict's key -> the files its tensor is filled from
        self.hash_when_placed = hash_when_placed
        self.whole: Dict[str, Dict[str, Tuple[ReadItem, torch.Tensor]]] = {}
        self.files_of: Dict[str, List[str]] = {}
        self.hashed_later: Dict[str, Dict[str, Any]] = {}
        # on a store: each object's size and header (data start, entries), read by read_metadata
        self._headers: Dict[str, Tuple[int, int, Dict[str, Tuple[str, Tuple[int, ...], int, int]]]] = {}
        self._metadata: Optional[Metadata] = None

    def read_metadata(self) -> Metadata:
        if self.store is None:
            return super().read_metadata()
        if self._metadata is None:  # once per reader: a deferred load that falls back reads again with it
            self._metadata = self._store_metadata()
        self._metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: Dict[str, List[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if self.defer:
            self.deferred = self._defer_whole_files(per_file, planner)
            return _done(None)
        sliced = [item for path, items in per_file.items() if not self._read_whole(path, items, planner)
                  for item in items]
        if sliced and self.store is not None:
            self._read_slices_from_store(sliced, planner)
        elif sliced:  # torch's own reader, for the files needed only in slices
            return super().read_data(dataclasses.replace(plan, items=sliced), planner)
        return _done(None)

    def _store_metadata(self) -> Metadata:
        """What ``HuggingFaceStorageReader.read_metadata`` builds from the files' headers (each
        file's ``DCP_SHARDING_INFO``: where its slices sit in the whole arrays), from the objects'
        headers, all asked for at once (`headers_of`)."""
        assert self.store is not None
        arrays: Dict[str, TensorStorageMetadata] = {}
        storage: Dict[MetadataIndex, Any] = {}
        urls = [f"{self.target.rstrip('/')}/{name}" for name in self.store.files(self.target)
                if name.endswith(".safetensors") and "/" not in name]
        for url, (size, (start, entries, extra)) in zip(
                urls, headers_of(urls, self.store.size_of, self.store.read_range)):
            self._headers[url] = (size, start, entries)
            try:
                info = json.loads(extra[_SHARDING_INFO]) if _SHARDING_INFO in extra else {}
            except ValueError as err:
                raise CheckpointError(f"{url}: its {_SHARDING_INFO} is not JSON ({err})."
                                      + see("sharded-load-failed")) from err
            for key, (dtype, shape, _, _) in entries.items():
                offsets = list(info.get(key, {}).get(_SAVED_OFFSETS, [0] * len(shape)))
                torch_dtype = _TORCH_DTYPES[dtype]
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape))
                known = arrays.get(key)
                if known is None:
                    arrays[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch_dtype), chunks=[chunk],
                                                        size=torch.Size([s + o for s, o in zip(shape, offsets)]))
                else:
                    known.chunks.append(chunk)
                    known.size = torch.Size([max(a, s + o) for a, s, o in zip(known.size, shape, offsets)])
                storage[MetadataIndex(fqn=key, offset=offsets)] = _HFStorageInfo(
                    relative_path=url, shape=torch.Size(shape), dtype=torch_dtype)
        metadata = Metadata(state_dict_metadata=arrays, storage_data=storage)  # type: ignore[arg-type]
        metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_slices_from_store(self, items: List[ReadItem], planner: LoadPlanner) -> None:
        """The slices DCP asks for (a restart on another process count): each saved array they
        come from is downloaded once (one range request; memory: the largest such array) and its
        slices copied out. These files are hashed by `unified` afterwards."""
        assert self.store is not None
        by_array: Dict[Tuple[str, str], List[ReadItem]] = {}
        for item in items:
            by_array.setdefault(
                (self.storage_data[item.storage_index].relative_path, item.storage_index.fqn), []).append(item)
        for (url, key), wanted in by_array.items():
            _, start, entries = self._headers[url]
            dtype, shape, begin, end = entries[key]
            saved = torch.from_numpy(np.frombuffer(bytearray(self.store.read_range(url, start + begin, start + end)),
                                                   dtype=safetensors_io.numpy_dtype(dtype)).reshape(shape))
            for item in wanted:
                piece = saved[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))]
                target = planner.resolve_tensor(item).detach()
                if target.size() != piece.size():
                    raise CheckpointError(f"{url}: {key} holds a slice of shape {tuple(piece.size())} where "
                                          f"{tuple(target.size())} was planned." + see("sharded-load-failed"))
                target.copy_(piece)
                planner.commit_tensor(item, target)

    def _defer_whole_files(self, per_file: Dict[str, List[ReadItem]], planner: LoadPlanner) -> bool:
        """When this process needs every file the plan reads whole (a restart on the same process
        count): each is hashed in a first pass that fills no tensor, and `fills` noted. A store's
        object is streamed into a private local copy (`private_copy`); a folder's file is read
        where it is, each entry hashed as well (`safetensors_io.hash_entries`), so that the second
        pass checks every byte it puts in place. False, with nothing filled, otherwise (a file
        needed only in slices or not fitting its tensors, no room for a copy)."""
        plans = []
        for path, items in per_file.items():
            targets = self._whole_targets(path, items, planner)
            if targets is None:
                return False
            size, start, entries = (self._headers[path] if self.store is not None
                                    else safetensors_io.header_of_file(path))
            fits = all(key in targets or 0 in shape for key, (_, shape, _, _) in entries.items()) \
                and all(target.dtype in SAFETENSORS_DTYPES and key in entries
                        and export_tensor(target)[:2] == entries[key][:2] for key, (_, target) in targets.items())
            if not fits:
                return False
            plans.append((path, size, start, entries, targets))
        for path, size, start, entries, targets in plans:
            if self.hash_when_placed:  # read and hashed when placed (`fill_whole`)
                self.whole[path] = targets
                for item, _ in targets.values():
                    self.files_of.setdefault(item.dest_index.fqn, []).append(path)
                continue
            checks: Dict[str, Any] = {}
            local = path
            if self.store is not None:  # asked just before each copy: the disk's room after the ones before
                local = self.copy_to(path, size)  # type: ignore[misc]
                got = private_copy(self.store, path, local, size, (start, entries)) if local is not None else None
                if got is None:  # no room on the local disk: read the usual way
                    self.fills.clear()
                    self.hashed.clear()
                    return False
            else:
                got, digests, seen = safetensors_io.hash_entries(path, size, start, entries)
                checks = {key: (digest, seen) for key, digest in digests.items()}
            self.hashed[os.path.basename(path)] = got
            for key, (item, target) in targets.items():
                self.fills.setdefault(item.dest_index.fqn, []).append(
                    (local, start + entries[key][2], target, checks.get(key)))
        return True

    def _whole_targets(self, path: str, items: List[ReadItem], planner: LoadPlanner
                       ) -> Optional[Dict[str, Tuple[ReadItem, torch.Tensor]]]:
        """The tensors ``items`` ask to fill from ``path`` by entry, when each takes one entry
        whole into contiguous CPU memory; None otherwise."""
        targets: Dict[str, Tuple[ReadItem, torch.Tensor]] = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            whole = all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == tuple(info.shape)
            target = planner.resolve_tensor(item).detach()
            if (not whole or item.storage_index.fqn in targets or not target.is_contiguous()
                    or target.device.type != "cpu"):
                return None
            targets[item.storage_index.fqn] = (item, target)
        return targets

    def _read_whole(self, path: str, items: List[ReadItem], planner: LoadPlanner) -> bool:
        """Read ``path`` into the tensors ``items`` ask for when they take every entry of it
        whole (the file is hashed in the same pass); False (nothing read) otherwise."""
        targets = self._whole_targets(path, items, planner)
        if targets is None:
            return False
        hashed = self._read_into_targets(path, targets)
        if hashed is None:
            return False
        for item, target in targets.values():
            planner.commit_tensor(item, target)
        self.hashed[os.path.basename(path)] = hashed
        return True

    def fill_whole(self, paths: List[str]) -> None:
        """One pass: read each of ``paths`` (files of `whole`) straight into its tensors, hashing
        every byte as it goes, once (later calls skip a file already read); its size and xxh3
        go to `hashed_later` for the manager to compare."""
        for path in paths:
            name = os.path.basename(path)
            if name in self.hashed_later:
                continue
            hashed = self._read_into_targets(path, self.whole[path])
            if hashed is None:  # its header said otherwise when the load planned it
                raise CheckpointError(f"{path}: changed while it was read into the live objects; they now hold "
                                      "part of this checkpoint: load it (or another) again before training."
                                      + see("changed-while-placed"))
            self.hashed_later[name] = hashed

    def _read_into_targets(self, path: str, targets: Dict[str, Tuple[ReadItem, torch.Tensor]]
                           ) -> Optional[Dict[str, Any]]:
        """``path`` read whole into the tensors of ``targets`` (by entry), hashed in the same pass:
        its size and xxh3, or None (nothing read) when an entry does not fit its tensor."""
        filled = set()

        def destination(key: str, dtype: str, shape: Tuple[int, ...]) -> Optional[np.ndarray]:
            item_target = targets.get(key)
            if item_target is None:  # DCP asks for no empty tensor: nothing to read
                return np.empty(0, np.uint8) if 0 in shape else None
            if item_target[1].dtype not in SAFETENSORS_DTYPES:
                return None
            stored_as, target_shape, raw = export_tensor(item_target[1])  # a view: contiguous, on the CPU
            if (stored_as, target_shape) != (dtype, shape):
                return None
            filled.add(key)
            return raw

        if self.store is None:
            hashed = safetensors_io.read_into(path, destination)
        else:
            with self.store.reading(path) as handle:
                hashed = safetensors_io.read_stream_into(handle, path, self._headers[path][0], destination)
        if hashed is None:
            return None
        if filled != set(targets):  # the file lost entries since DCP read its header
            raise CheckpointError(f"{path}: holds no {sorted(set(targets) - filled)[0]!r} any more; it changed "
                                  "while it was read. Nothing was restored." + see("file-ended"))
        return hashed
