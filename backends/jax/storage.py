"""The storage JAX's sharded state is written through.

- In a folder: Orbax's own files, through its PyTree handler with uncompressed chunks
  (`uncompressed_pytree_handler`).
- On an object store, where Orbax cannot write (it makes ``s3://`` a local path and commits by
  renaming a folder): `write_shards` / `read_shards`, one safetensors file per process,
  ``shard-<process>.safetensors``, holding that process's own pieces of every sharded array (the
  pieces with ``replica_id == 0``, so that each piece is written once in the group). Each entry is
  named ``<array>@<offsets>`` and the file's ``__metadata__`` says, under ``UNIFIED_SHARDS``,
  which array each entry is a piece of, where it starts and the array's whole shape: any number
  of processes reads it back (each takes the pieces its devices need). The files are streamed to
  the store and hashed as they are written; a process that needs a file's every entry whole (a
  restart on the same process count) streams it into its buffers and hashes it in the same pass,
  and takes slices of the others with range requests (`unified` hashes those afterwards). The
  same files read from a folder (a store checkpoint copied down) load too.

Used by `backends.jax.sharding`, as torch's sharded state is written through its storage
(backends/torch/storage.py).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import os
import re
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Set, Tuple

import numpy as np

from unified.backend import DeferredArray, FileHashes
from unified.checkpoint import safetensors_io
from unified.checkpoint.store import ObjectStore, headers_of, location_of, private_copy
from unified.config import is_url
from unified.errors import CheckpointError, see

__all__ = ["uncompressed_pytree_handler", "SHARD_FILE", "holds_shard_files", "own_pieces", "write_shards",
           "read_shards", "ShardsRead", "OrbaxGroups"]

SHARD_FILE = re.compile(r"shard-(\d{5})\.safetensors")  # process i writes shard-0000i.safetensors
_SHARDS_INFO = "UNIFIED_SHARDS"  # __metadata__: {entry: {"array", "offsets", "global_shape"}}


def uncompressed_pytree_handler(ocp: Any) -> Any:
    """Orbax's PyTree handler without zstd where the installed Orbax offers the choice
    (``use_compression``, not in orbax-checkpoint 0.11.17); its default otherwise."""
    accepted = inspect.signature(ocp.PyTreeCheckpointHandler.__init__).parameters
    return ocp.PyTreeCheckpointHandler(**({"use_compression": False} if "use_compression" in accepted else {}))


# -- Orbax's files in a folder, restored a few arrays at a time --------------------------------------------
class OrbaxGroups:
    """Orbax's sharded files in ``directory``, restored in groups of consecutive arrays of
    ``like`` (about ``group_bytes`` of this process's part each: one Orbax call, a collective,
    per group) instead of all at once: `deferred` gives a `DeferredArray` per array, and making
    the first array of a group restores the group. Made in ``like``'s order, a load holds one
    group beyond the live state instead of a second copy of the process's part of it."""

    GROUP_BYTES = 64 << 20

    def __init__(self, directory: str, like: Mapping[str, Any], group_bytes: int = GROUP_BYTES) -> None:
        import jax

        self.directory = directory
        self.targets = {key: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for key, v in like.items()}
        self.group_of: Dict[str, int] = {}
        self.groups: List[List[str]] = [[]]
        held = 0
        for key, value in like.items():
            own = sum(int(shard.data.nbytes) for shard in value.addressable_shards)
            if self.groups[-1] and held + own > group_bytes:
                self.groups.append([])
                held = 0
            self.groups[-1].append(key)
            self.group_of[key] = len(self.groups) - 1
            held += own
        self._restored: Dict[str, Any] = {}

    def deferred(self) -> Dict[str, "DeferredArray"]:
        return {key: _FromOrbax(self, key) for key in self.targets}

    def take(self, key: str) -> Any:
        """The array ``key``: restored with its group when not yet (the group's others kept until taken)."""
        if key not in self._restored:
            import orbax.checkpoint as ocp

            subset = {k: self.targets[k] for k in self.groups[self.group_of[key]]}
            with ocp.Checkpointer(uncompressed_pytree_handler(ocp)) as checkpointer:
                self._restored.update(checkpointer.restore(self.directory, args=ocp.args.PyTreeRestore(
                    item=subset, restore_args=ocp.checkpoint_utils.construct_restore_args(subset),
                    partial_restore=True)))
        return self._restored.pop(key)


class _FromOrbax(DeferredArray):
    def __init__(self, groups: OrbaxGroups, key: str) -> None:
        self._groups, self._key = groups, key
        self.shape, self.dtype = tuple(groups.targets[key].shape), groups.targets[key].dtype

    def make(self) -> Any:
        return self._groups.take(self._key)


# -- writing ----------------------------------------------------------------------------------------------
def _bounds(index: Tuple[slice, ...], shape: Tuple[int, ...]) -> Tuple[Tuple[int, int], ...]:
    """``(start, stop)`` per dimension of a shard's index (slices with ``None`` ends)."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def own_pieces(arrays: Mapping[str, Any], copy: bool) -> Tuple[Dict[str, np.ndarray], Dict[str, Dict[str, Any]]]:
    """This process's pieces of the sharded ``arrays`` (those with ``replica_id == 0``) as host
    arrays named ``<array>@<offsets>``, and what the file's metadata says of each. ``copy``: host
    copies the training may not change (an async save); otherwise views where the device is the
    host's memory.

    Example:
        >>> pieces, info = own_pieces({"w": sharded}, copy=False)
        >>> info["w@0,4"]
        {'array': 'w', 'offsets': [0, 4], 'global_shape': [8, 8]}
    """
    import jax

    pieces: Dict[str, np.ndarray] = {}
    info: Dict[str, Dict[str, Any]] = {}
    for key, array in arrays.items():
        for shard in array.addressable_shards:
            if shard.replica_id != 0:
                continue
            offsets = [start for start, _ in _bounds(shard.index, array.shape)]
            name = f"{key}@{','.join(map(str, offsets))}"
            host = np.asarray(jax.device_get(shard.data))
            pieces[name] = np.array(host, copy=True) if copy else host
            info[name] = {"array": key, "offsets": offsets, "global_shape": list(array.shape)}
    return pieces, info


def write_shards(directory: str, process: int, pieces: Mapping[str, np.ndarray],
                 info: Mapping[str, Dict[str, Any]]) -> FileHashes:
    """Stream this process's ``pieces`` (from `own_pieces`) into ``directory`` (a store's URL
    or a folder) as ``shard-<process>.safetensors``, hashed as written; ``{name: {size, xxh3}}``
    (nothing written, ``{}``, when the process holds no piece).

    Example:
        >>> write_shards("s3://bucket/run/checkpoint_3/sharded.orbax", 0, *own_pieces(arrays, copy=False))
        {'shard-00000.safetensors': {'size': 4200, 'xxh3': '...'}}
    """
    if not pieces:
        return {}
    name = f"shard-{process:05d}.safetensors"
    path = f"{directory.rstrip('/')}/{name}" if is_url(directory) else os.path.join(directory, name)
    exported = {key: safetensors_io.export_numpy(value) for key, value in pieces.items()}
    return {name: location_of(path).write(path, exported, live=False,
                                          metadata={_SHARDS_INFO: json.dumps(dict(info), sort_keys=True)})}


# -- reading ----------------------------------------------------------------------------------------------
class _Piece(NamedTuple):
    path: str          # the file (an object's URL or a folder's path)
    entry: str         # its name in the file
    dtype: str         # safetensors dtype
    offsets: Tuple[int, ...]
    shape: Tuple[int, ...]
    start: int         # bytes [start, end) of the file
    end: int


class _Files:
    """What the reader needs of the files under a store prefix or in a folder."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.store = ObjectStore(directory) if is_url(directory) else None

    def path(self, name: str) -> str:
        return f"{self.directory.rstrip('/')}/{name}" if self.store else os.path.join(self.directory, name)

    def names(self) -> List[str]:
        if self.store is not None:
            return self.store.files(self.directory)
        return sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []

    def size(self, path: str) -> int:
        return self.store.size_of(path) if self.store is not None else os.path.getsize(path)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        if self.store is not None:
            return self.store.read_range(path, start, end)
        with open(path, "rb") as handle:
            data = os.pread(handle.fileno(), end - start, start)
        if len(data) != end - start:
            raise CheckpointError(f"{path}: ended before byte {end}; nothing was restored." + see("file-ended"))
        return data

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[Any]:
        if self.store is not None:
            with self.store.reading(path) as handle:
                yield handle
        else:
            with open(path, "rb") as handle:
                yield handle


def holds_shard_files(directory: str) -> bool:
    """Whether ``directory`` (a store's prefix or a folder) holds `write_shards`' files."""
    return any(SHARD_FILE.fullmatch(name) for name in _Files(directory).names())


def _pieces(files: _Files) -> Tuple[Dict[str, List[_Piece]], Dict[str, Tuple[int, ...]], Dict[str, int],
                                    Dict[str, Any]]:
    """Every piece of every array, from the files' headers: ``array -> pieces``, each array's
    whole shape, each file's size, each file's data start and entries."""
    pieces: Dict[str, List[_Piece]] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    sizes: Dict[str, int] = {}
    headers: Dict[str, Any] = {}
    paths = [files.path(name) for name in files.names() if SHARD_FILE.fullmatch(name)]
    for path, (size, (data_start, entries, extra)) in zip(paths, headers_of(paths, files.size, files.read_range)):
        sizes[path], headers[path] = size, (data_start, entries)
        try:
            info = json.loads(extra[_SHARDS_INFO])
            described = {entry: (str(info[entry]["array"]), tuple(int(o) for o in info[entry]["offsets"]),
                                 tuple(int(n) for n in info[entry]["global_shape"])) for entry in entries}
            problem = _misfit(entries, described, shapes)
        except (KeyError, TypeError, ValueError) as err:
            problem = f"{type(err).__name__}: {err}"
        if problem is not None:
            raise CheckpointError(f"{path}: its {_SHARDS_INFO} metadata does not describe its entries ({problem}); "
                                  "nothing was restored." + see("sharded-load-failed"))
        for entry, (dtype, shape, begin, end) in entries.items():
            array, offsets, _ = described[entry]
            pieces.setdefault(array, []).append(_Piece(path, entry, dtype, offsets, tuple(shape),
                                                       data_start + begin, data_start + end))
    if not sizes:
        raise CheckpointError(f"{files.directory}: holds no shard file (shard-NNNNN.safetensors); nothing was "
                              "restored." + see("sharded-files-unlisted"))
    return pieces, shapes, sizes, headers


def _misfit(entries: Mapping[str, Tuple[str, Tuple[int, ...], int, int]],
            described: Mapping[str, Tuple[str, Tuple[int, ...], Tuple[int, ...]]],
            shapes: Dict[str, Tuple[int, ...]]) -> Optional[str]:
    """Why a file's entries do not fit the arrays its metadata names (``shapes``: each array's
    whole shape so far, extended here), or None."""
    for entry, (_, shape, _, _) in entries.items():
        array, offsets, whole = described[entry]
        if len(offsets) != len(shape) or len(whole) != len(shape) or any(
                o < 0 or o + n > w for o, n, w in zip(offsets, shape, whole)):
            return f"{entry} does not fit in its array of shape {whole}"
        if shapes.setdefault(array, whole) != whole:
            return f"{array} has the shape {whole} here and {shapes[array]} in another file"
    return None


def _overlap(piece: _Piece,
             bounds: Tuple[Tuple[int, int], ...]) -> Optional[Tuple[Tuple[slice, ...], Tuple[slice, ...]]]:
    """Where ``piece`` and the region ``bounds`` meet: (slices of the piece, slices of the
    region), or None."""
    taken, placed = [], []
    for offset, length, (low, high) in zip(piece.offsets, piece.shape, bounds):
        begin, end = max(offset, low), min(offset + length, high)
        if begin >= end:
            return None
        taken.append(slice(begin - offset, end - offset))
        placed.append(slice(begin - low, end - low))
    return tuple(taken), tuple(placed)


class ShardsRead(NamedTuple):
    """What `read_shards` read: ``arrays`` (name -> array, or `DeferredArray`), ``hashed`` (the
    size and xxh3 of each file read whole now), and with ``stream_later`` the files read only
    as their arrays are made (``later``: their names; ``later_hashes()``: their hashes by then)."""

    arrays: Dict[str, Any]
    hashed: FileHashes
    later: Tuple[str, ...] = ()
    later_hashes: Callable[[], FileHashes] = dict


def read_shards(directory: str, like: Mapping[str, Any],
                copy_to: Optional[Callable[[str, int], Optional[str]]] = None,
                stream_later: Optional[Callable[[str, Any], None]] = None) -> ShardsRead:
    """`write_shards`' files in ``directory`` read into new arrays placed like ``like`` (on any
    number of processes), and ``{name: {size, xxh3}}`` of the files this process read whole
    (hashed in that pass). No collective: each process reads what its devices need.

    ``copy_to(path, size)``: where to keep a private local copy of an object (on a store) this
    process reads whole (or None). Such a file is streamed there, hashed, and the arrays made only of its
    pieces come back as `DeferredArray`s that read their bytes from the copy when the load
    restores them (one at a time: no second copy of the process's shard). Without a copy the
    arrays are made now, as before.

    ``stream_later(key, array)`` (one pass, `ShardedLoad.hash_when_placed`; ``copy_to`` is then
    not used): the files this process reads whole are read only when the first array made of
    them is asked for (`DeferredArray.make`), once, in file order, hashed as they stream, with
    no local copy; every array of such a file is handed to ``stream_later`` as soon as its
    pieces arrived, which puts it in place of the live one at once where it can, so that the
    load holds one array beyond the live state whatever order the arrays are made in.

    Example:
        >>> arrays, hashed, _, _ = read_shards("s3://bucket/run/checkpoint_3/sharded.orbax", {"w": live_w})
    """
    files = _Files(directory)
    pieces, shapes, sizes, headers = _pieces(files)
    # array -> region -> this process's devices that hold that region (their memory made when needed)
    regions: Dict[str, Dict[Tuple[Tuple[int, int], ...], List[Any]]] = {}
    for key, value in like.items():
        if key not in pieces:
            raise CheckpointError(f"{directory}: holds no piece of {key!r}; nothing was restored."
                                  + see("sharded-no-counterpart"))
        if shapes[key] != tuple(value.shape):
            raise CheckpointError(f"{directory}: {key!r} has the shape {shapes[key]} there and {tuple(value.shape)} "
                                  "in this run; nothing was restored." + see("sharded-load-failed"))
        dtype = np.dtype(value.dtype)
        stored = {piece.dtype for piece in pieces[key]}
        if stored != {safetensors_io.safetensors_dtype(dtype)}:
            raise CheckpointError(f"{directory}: {key!r} is stored as {sorted(stored)} and is {dtype.name} in this "
                                  "run; nothing was restored." + see("sharded-load-failed"))
        mine = regions.setdefault(key, {})
        for device, index in value.sharding.addressable_devices_indices_map(value.shape).items():
            mine.setdefault(_bounds(index, tuple(value.shape)), []).append(device)
    buffers = _Buffers(like, regions)
    hashed: FileHashes = {}
    copied: Dict[Tuple[str, Tuple[Tuple[int, int], ...]], Tuple[str, _Piece]] = {}  # region -> (copy, piece)
    by_file: Dict[str, List[Tuple[str, _Piece]]] = {}  # every entry of each file
    for key, saved in pieces.items():
        for piece in saved:
            by_file.setdefault(piece.path, []).append((key, piece))
    whole = {path for path, held in by_file.items()
             if all(_extent(piece) in regions.get(key, {}) for key, piece in held)}  # every entry is a region of mine
    streamed = _streamable(whole, by_file, regions) if stream_later is not None else set()
    for path, held in by_file.items():
        if path in streamed:  # read when its first array is made (`_ShardStreams`)
            for key, piece in held:
                buffers.filled[(key, _extent(piece))] += math.prod(piece.shape)
            continue
        if path in whole:
            local = copy_to(path, sizes[path]) if copy_to is not None and files.store is not None else None
            got = private_copy(files.store, path, local, sizes[path], headers[path]) if local is not None else None
            if got is not None:
                hashed[os.path.basename(path)] = got
                copied.update({(key, _extent(piece)): (str(local), piece) for key, piece in held})
            else:
                hashed[os.path.basename(path)] = _read_whole(files, path, sizes[path], {
                    piece.entry: buffers.of(key, _extent(piece)) for key, piece in held})
            for key, piece in held:
                buffers.filled[(key, _extent(piece))] += math.prod(piece.shape)
            continue
        for key, piece in held:  # slices: the saved piece fetched once, its overlaps copied out
            meets = [(bounds, meet) for bounds in regions.get(key, {})
                     for meet in [_overlap(piece, bounds)] if meet is not None]
            if not meets:
                continue
            data = np.frombuffer(bytearray(files.read_range(path, piece.start, piece.end)),
                                 dtype=safetensors_io.numpy_dtype(piece.dtype)).reshape(piece.shape)
            for bounds, (taken, placed) in meets:
                for buffer in buffers.of(key, bounds):
                    buffer[placed] = data[taken]
                buffers.filled[(key, bounds)] += math.prod(s.stop - s.start for s in placed)
    for key in like:
        for bounds in regions[key]:
            if buffers.filled[(key, bounds)] != math.prod(b - a for a, b in bounds):
                raise CheckpointError(f"{directory}: its pieces of {key!r} do not cover the part {bounds} this process "
                                      "holds; nothing was restored." + see("sharded-load-failed"))
    streams = _ShardStreams(files, {path: sizes[path] for path in streamed},
                            {path: by_file[path] for path in streamed}, like, regions, stream_later)
    out: Dict[str, Any] = {}
    for key, value in like.items():
        sources = {bounds: copied.get((key, bounds)) for bounds in regions[key]}
        if streams.holds(key):
            out[key] = _Streamed(streams, key, tuple(value.shape), np.dtype(value.dtype))
        elif all(sources.values()):
            out[key] = _FromCopy(tuple(value.shape), np.dtype(value.dtype), value.sharding, regions[key], sources)
        else:
            out[key] = buffers.array(key)
    return ShardsRead(out, hashed, tuple(sorted(os.path.basename(path) for path in streamed)), streams.hashes)


def _streamable(whole: Set[str], by_file: Mapping[str, List[Tuple[str, "_Piece"]]],
                regions: Mapping[str, Mapping[Tuple[Tuple[int, int], ...], List[Any]]]) -> Set[str]:
    """The files of ``whole`` (each entry a region of this process's) that may be read only when
    their arrays are made: those whose every array has each of its regions in such a file (an
    array with a region read now, a slice of another file, is made now, with its files)."""
    source = {(key, _extent(piece)): path for path in whole for key, piece in by_file[path]}
    streamed = set(whole)
    while True:
        ready = {key for key, mine in regions.items() if all(source.get((key, b)) in streamed for b in mine)}
        keep = {path for path in streamed if all(key in ready for key, _ in by_file[path])}
        if keep == streamed:
            return streamed
        streamed = keep


class _ShardStreams:
    """The shard files read in one pass as the load makes their arrays (`read_shards`'
    ``stream_later``): the first array asked for reads its files, each once, in file order,
    hashing them; an array is made (`_global_array`) as soon as its last region arrived and handed
    to ``adopt`` (which puts it in place of the live one where it can), and kept until it is
    asked for. A failed read is raised again for every array of the file asked for after it."""

    def __init__(self, files: _Files, sizes: Mapping[str, int], held: Mapping[str, List[Tuple[str, "_Piece"]]],
                 like: Mapping[str, Any], regions: Mapping[str, Mapping[Tuple[Tuple[int, int], ...], List[Any]]],
                 adopt: Optional[Callable[[str, Any], None]]) -> None:
        self._files, self._sizes, self._held, self._adopt = files, dict(sizes), dict(held), adopt
        keys = {key for pieces in held.values() for key, _ in pieces}
        # not the live arrays (they are freed when replaced): what a new one is made like
        self._made_like = {key: (tuple(like[key].shape), like[key].sharding) for key in keys}
        self._regions = {key: dict(regions[key]) for key in keys}
        self._files_of = {key: sorted({path for path, pieces in held.items() for k, _ in pieces if k == key})
                          for key in keys}
        self._arrived: Dict[str, Dict[Tuple[Tuple[int, int], ...], List[np.ndarray]]] = {key: {} for key in keys}
        self._ready: Dict[str, Any] = {}
        self._hashes: FileHashes = {}
        self._failed: Dict[str, BaseException] = {}

    def holds(self, key: str) -> bool:
        return key in self._made_like

    def hashes(self) -> FileHashes:
        """The size and xxh3 of each file streamed whole so far."""
        return dict(self._hashes)

    def make(self, key: str) -> Any:
        for path in self._files_of[key]:
            if path in self._failed:
                raise self._failed[path]
            if os.path.basename(path) not in self._hashes:
                self._stream(path)
        if key not in self._ready:  # its file's header no longer lists a piece it listed before
            raise CheckpointError(f"{self._files_of[key][0]}: changed while it was read (a piece of {key!r} its header "
                                  "listed before is missing)." + see("file-ended"))
        return self._ready.pop(key)

    def _stream(self, path: str) -> None:
        hand_offs = {piece.entry: functools.partial(self._piece_arrived, key, piece) for key, piece in self._held[path]}
        try:
            with self._files.reading(path) as handle:
                self._hashes[os.path.basename(path)] = safetensors_io.read_stream_handed(
                    handle, path, self._sizes[path], hand_offs)
        except BaseException as err:
            self._failed[path] = err
            raise

    def _piece_arrived(self, key: str, piece: "_Piece", host: np.ndarray) -> None:
        if host.dtype != safetensors_io.numpy_dtype(piece.dtype) or tuple(host.shape) != piece.shape:
            raise CheckpointError(f"{piece.path}: changed while it was read ({piece.entry} is not the "
                                  f"{piece.dtype} {list(piece.shape)} its header listed before)." + see("file-ended"))
        bounds = _extent(piece)
        devices = self._regions[key][bounds]
        copies = [host]
        for _ in devices[1:]:  # one buffer per device of the region
            copies.append(safetensors_io.private_array(host.dtype, host.shape))
            copies[-1][...] = host
        arrived = self._arrived[key]
        arrived[bounds] = copies
        if len(arrived) < len(self._regions[key]):
            return
        shape, sharding = self._made_like[key]
        array = _global_array(shape, sharding, [(device, buffer) for region, held in self._regions[key].items()
                                                for device, buffer in zip(held, arrived[region])])
        del self._arrived[key], arrived, copies, host
        self._ready[key] = array
        if self._adopt is not None:
            self._adopt(key, array)


class _Streamed(DeferredArray):
    """A sharded array read from files streamed once as the load makes it (`_ShardStreams`)."""

    def __init__(self, streams: _ShardStreams, key: str, shape: Tuple[int, ...], dtype: np.dtype) -> None:
        self._streams, self._key, self.shape, self.dtype = streams, key, shape, dtype

    def make(self) -> Any:
        return self._streams.make(self._key)


class _Buffers:
    """The memory of the regions read now (not from a verified copy), made when first asked for:
    one aligned buffer per device of a region (`jax.device_put` then makes a CPU array over it
    instead of copying it)."""

    def __init__(self, like: Mapping[str, Any], regions: Mapping[str, Mapping[Tuple[Tuple[int, int], ...], List[Any]]]):
        self._like, self._regions = like, regions
        self._made: Dict[Tuple[str, Tuple[Tuple[int, int], ...]], List[np.ndarray]] = {}
        self.filled = {(key, bounds): 0 for key, mine in regions.items() for bounds in mine}

    def of(self, key: str, bounds: Tuple[Tuple[int, int], ...]) -> List[np.ndarray]:
        if (key, bounds) not in self._made:
            dtype, shape = np.dtype(self._like[key].dtype), [b - a for a, b in bounds]
            self._made[(key, bounds)] = [safetensors_io.private_array(dtype, shape) for _ in self._regions[key][bounds]]
        return self._made[(key, bounds)]

    def array(self, key: str) -> Any:
        value = self._like[key]
        return _global_array(tuple(value.shape), value.sharding, [
            (device, buffer) for bounds, devices in self._regions[key].items()
            for device, buffer in zip(devices, self.of(key, bounds))])


def _global_array(shape: Tuple[int, ...], sharding: Any, placed: List[Tuple[Any, np.ndarray]]) -> Any:
    """The array of ``shape`` and ``sharding`` made of each ``(device, buffer)``'s buffer put on its
    device (over the buffer itself on the CPU: aligned memory of its own)."""
    import jax

    return jax.make_array_from_single_device_arrays(shape, sharding, [jax.device_put(b, d) for d, b in placed])


class _FromCopy(DeferredArray):
    """A sharded array whose every region is one piece of a verified private copy (`private_copy`):
    made when the load restores it, each region read into memory of its own."""

    def __init__(self, shape: Tuple[int, ...], dtype: np.dtype, sharding: Any,
                 regions: Mapping[Tuple[Tuple[int, int], ...], List[Any]],
                 sources: Mapping[Tuple[Tuple[int, int], ...], Optional[Tuple[str, _Piece]]]) -> None:
        self.shape, self.dtype, self._sharding = shape, dtype, sharding  # not the live array: it is freed when replaced
        self._regions, self._sources = dict(regions), dict(sources)

    def make(self) -> Any:
        placed = []
        for bounds, devices in self._regions.items():
            local, piece = self._sources[bounds]  # type: ignore[misc]
            first = safetensors_io.private_array(self.dtype, [b - a for a, b in bounds])
            safetensors_io.read_range_into(local, piece.start, first)
            copies = [first] + [np.array(first, copy=True) for _ in devices[1:]]  # one buffer per device
            placed += list(zip(devices, copies))
        return _global_array(self.shape, self._sharding, placed)


def _extent(piece: _Piece) -> Tuple[Tuple[int, int], ...]:
    """The region of its array that ``piece`` holds, as `_bounds` gives a device's."""
    return tuple((o, o + n) for o, n in zip(piece.offsets, piece.shape))


def _read_whole(files: _Files, path: str, size: int, whole: Mapping[str, List[np.ndarray]]) -> Dict[str, object]:
    """Stream the file ``path`` into the buffers of its entries (``whole``: each entry's buffers,
    one per device of its region), hashing it in the same pass; the other buffers of the same
    region get copies."""
    def destination(entry: str, dtype: str, shape: Tuple[int, ...]) -> Optional[np.ndarray]:
        buffers = whole.get(entry)
        if not buffers:
            return None
        first = buffers[0]
        if tuple(first.shape) != tuple(shape) or safetensors_io.safetensors_dtype(first.dtype) != dtype:
            return None
        return first.reshape(-1).view(np.uint8)

    with files.reading(path) as handle:
        hashes = safetensors_io.read_stream_into(handle, path, size, destination)
    if hashes is None:
        raise CheckpointError(f"{path}: changed while it was read (its entries are not those its header listed "
                              "before); nothing was restored." + see("file-ended"))
    for buffers in whole.values():
        for buffer in buffers[1:]:
            buffer[...] = buffers[0]
    return hashes
