"""save_state / load_state: the one sequence both backends share.

save: every process writes its part into a temporary directory (the main process the
replicated objects, each process its RNG state), reports its files' sizes and checksums; the
main process writes the manifest last and renames the directory into place; then everyone
returns. load: verify the manifest and every file before touching any object, then restore.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import shutil
import stat
import tempfile
import threading
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, List, Optional, Tuple

import numpy as np
import xxhash

from ..backend import Backend, DeferredArray, Replaceable, ShardedArrays, ShardedWrite, WriteGuards
from ..config import checkpoint_location, is_url
from ..errors import TROUBLESHOOTING, CheckpointError, failure_reason, see
from ..runtime.environment import IN_PLACE_VARIABLE, LOAD_COPY_VARIABLE
from ..runtime.rng import capture_host_rng, restore_host_rng
from ..runtime.watchdog import CHANNEL_KINDS
from . import codec, layout, lease, lock, safetensors_io
from .manifest import check_file_name
from .safetensors_io import verify_file
from .store import Folder, ObjectStore, StoreError, location_of

if TYPE_CHECKING:
    from ..config import ProjectConfiguration
    from ..runtime.collectives import Collectives


def _tree(root: str, sub: str) -> List[str]:
    """Every file below ``root/sub``, named ``sub/...``, sorted."""
    return sorted(os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                  for folder, _, names in os.walk(os.path.join(root, sub)) for name in names)


def share_of(sizes: Dict[str, int], rank: int, count: int) -> List[str]:
    """Process ``rank``'s share of the files ``sizes`` lists, for checksumming: the largest file
    first to the process with the fewest bytes so far (ties: the lower rank), so the shares are
    balanced by bytes and every process computes the same split.

    Example:
        >>> share_of({"a": 8, "b": 5, "c": 4, "d": 1}, 0, 2), share_of({"a": 8, "b": 5, "c": 4, "d": 1}, 1, 2)
        (['a', 'd'], ['b', 'c'])
    """
    loads, mine = [0] * count, []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        owner = min(range(count), key=lambda r: (loads[r], r))
        loads[owner] += sizes[name]
        if owner == rank:
            mine.append(name)
    return sorted(mine)


def _hash_files(root: str, names: List[str]) -> Dict[str, Any]:
    """Manifest entries (size, xxh3) of ``names`` below ``root``."""
    return {name: verify_file(os.path.join(root, name), None, None) for name in names}


def _merged_hook_files(tmp: str, reports: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Every process's uploaded hook files; one name uploaded with two contents is refused (the
    store kept whichever came last, which no report can tell)."""
    merged: Dict[str, Tuple[int, Any]] = {}
    for rank, report in enumerate(reports):
        for name, info in report.get("hook_files", {}).items():
            first = merged.setdefault(name, (rank, info))
            if first[1] != info:
                raise CheckpointError(f"{tmp.rstrip('/')}/{name}: written by save-state hooks on processes {first[0]} "
                                      f"and {rank} with different contents; on a store each process's hook files are "
                                      "uploaded: write a file on one process only (if accelerator.is_main_process)."
                                      + see("state-hooks"))
    return {name: info for name, (_, info) in merged.items()}


def _raise_reported(final: str, reports: List[Dict[str, Any]]) -> None:
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise CheckpointError(
            f"save_state({final!r}) failed and was not committed; the previous checkpoint is intact. "
            f"{'; '.join(errors)}" + see("save-failed")
        )


def _raise_failed(directory: str, failed: List[Tuple[int, str]]) -> None:
    """Raise, naming every process's reason, when any process (``(rank, reason)``) failed to load."""
    if failed:
        raise CheckpointError(f"{directory}: cannot be loaded; "
                              + "; ".join(f"process {rank}: {reason}" for rank, reason in failed)
                              + see("another-process-could-not-load"))


# What verification reports of a damaged checkpoint, by the troubleshooting anchor its error
# ends with (`see`): a checksum or size mismatch, a file that ends early, is empty, not
# safetensors, a link or special file; a manifest missing, unparseable, too costly, edited after it
# was written or naming files it may not; a structure or header no save writes (hostile). Only
# these make an automatic load go on to an older checkpoint (`CheckpointManager.load_newest`);
# anything else (the checkpoint does not fit this run, a newer format version, a store out of
# reach, a file that cannot be opened for another reason than its absence) is raised as it is.
DAMAGE_ANCHORS = frozenset({
    "checksum-mismatch", "size-mismatch", "file-ended", "empty-file", "invalid-safetensors", "header-too-large",
    "not-a-regular-file", "link-inside-checkpoint", "refusing-file-name", "manifest-missing", "manifest-too-large",
    "manifest-invalid", "manifest-too-costly", "manifest-modified", "manifest-field", "manifest-files",
    "manifest-format", "invalid-structure", "missing-array", "sharded-files-unlisted",
})
_ANCHOR = re.compile(r"#([A-Za-z0-9_-]+)\s*$")


def is_damage(error: BaseException) -> bool:
    """Whether ``error``, raised while a checkpoint was verified, says the checkpoint is damaged
    (see `DAMAGE_ANCHORS`) rather than that it does not fit this run or could not be reached. An
    error may say so itself (a ``damage`` attribute); a file that cannot be opened is damage
    only when it is missing.

    Example:
        >>> is_damage(safetensors_io.checksum_mismatch("ckpt/model_0.safetensors"))
        True
        >>> is_damage(CheckpointError("ckpt/model_0.safetensors: tensor 'w' is F32 [3]..." + see("tensor-mismatch")))
        False
    """
    said = getattr(error, "damage", None)
    if said is not None:
        return bool(said)
    if not isinstance(error, CheckpointError):
        return False
    found = _ANCHOR.search(str(error))
    anchor = found.group(1) if found else None
    if anchor == "cannot-open-file":
        return isinstance(error.__cause__, FileNotFoundError)
    return anchor in DAMAGE_ANCHORS


def _not_damage(error: CheckpointError) -> CheckpointError:
    """``error``, marked as no damage of the checkpoint (`is_damage`): a file changed while it was read."""
    error.damage = False  # type: ignore[attr-defined]
    return error


class DamagedCheckpoint(CheckpointError):
    """Raised on every process alike by a load that falls back (`CheckpointManager.load_newest`)
    when the only failures of its verification, on every process, were damage (`is_damage`):
    ``failed`` holds each process's ``(index, reason)``."""

    def __init__(self, directory: str, failed: List[Tuple[int, str]]) -> None:
        super().__init__(f"{directory}: damaged; " + _reasons(failed) + see("damaged-checkpoint-skipped"))
        self.directory, self.failed = directory, failed


_LINK = re.compile(r"\s*See " + re.escape(TROUBLESHOOTING) + r"#[A-Za-z0-9_-]+\s*$")


def _reasons(failed: List[Tuple[int, str]]) -> str:
    """Each process's reason, without the link to the troubleshooting page it ends with."""
    return "; ".join(f"process {rank}: {_LINK.sub('', reason)}" for rank, reason in failed)


def _commit_error(final: str, err: OSError, rank: int = 0) -> CheckpointError:
    return CheckpointError(f"save_state({final!r}) failed while committing and was not committed; the previous "
                           f"checkpoint is intact. process {rank}: {err}" + see("save-failed"))


def _retention_error(final: str, err: OSError) -> CheckpointError:
    return CheckpointError(f"save_state({final!r}) committed the checkpoint, but removing older ones "
                           f"(total_limit) or what crashed saves left failed: {_LINK.sub('', str(err))}. "
                           "A checkpoint leaves the listing before its files are deleted: none is left "
                           "half-deleted and still loadable." + see("retention-delete-failed"))


# The health-channel kind under which a process posts why it could not write its part of an
# async save (``save-failed/{rank}``: JSON ``{"token", "error"}``).
PART_FAILED = "save-failed"
assert PART_FAILED in CHANNEL_KINDS


@dataclass
class Entry:
    """One object saved in every checkpoint: its name, and how to get and set its state."""

    name: str
    get_state: Callable[[], Any]
    set_state: Callable[[Any], None]
    # True: the backend restores it from NumPy views of private memory (safetensors_io.read),
    # copying them or taking them over; False: a user object, which gets them as framework arrays.
    managed: bool = True
    # True: the checkpoint must hold exactly this object's arrays (a model); otherwise it may hold
    # arrays the object does not have yet (an optimizer before its first step).
    strict: bool = False
    # Called by `load` with the decoded state and the saving run's process count before any
    # object is restored; raises ValueError when this run cannot resume it (a data position that
    # another process count cannot continue exactly, an open accumulation window). The arrays of
    # an object read into place (`IN_PLACE_MIN_BYTES`) are then read-only placeholders of their
    # dtype and shape: a check looks at structure and counts, not at those arrays' values.
    check: Optional[Callable[[Any, int], None]] = None
    # For an array of this object's state (its name without the object's prefix): the group it
    # belongs to when a checkpoint may lack the group whole (see `TrainingObjects.absent_group`).
    absent_group: Callable[[str], Optional[str]] = lambda name: None
    # A tree like get_state()'s whose leaves are `Replaceable` handles of the arrays a load may
    # replace one at a time (`TrainingObjects.replaceable_arrays`), or None.
    replaceable: Callable[[], Any] = lambda: None


@dataclass
class Snapshot:
    """Host copies of everything one process writes, taken before any file is written."""

    iteration: int = 0
    files: Dict[str, Dict[str, safetensors_io.Exported]] = field(default_factory=dict)
    structures: Dict[str, Any] = field(default_factory=dict)
    # arrays sharded across processes, written by every process through the backend (DCP, Orbax)
    sharded: Dict[str, Any] = field(default_factory=dict)
    sharded_names: Dict[str, str] = field(default_factory=dict)
    # True when files are written from live memory (torch async saves), which the writer must
    # not read twice; `changed_in_place` then names the arrays edited in place since the snapshot.
    live: bool = False
    changed_in_place: Callable[[], List[str]] = lambda: []
    # waits until arrays staged from device memory (`WriteGuards.stage_array`) are on the host
    ready: Callable[[], None] = lambda: None
    # objects that save-state hooks saved instead (see `CheckpointManager.snapshot`)
    skipped: List[str] = field(default_factory=list)
    # on a store: the files this process's save-state hooks wrote, uploaded (name -> size, xxh3),
    # or why they could not be (see `CheckpointManager.run_save_hooks`)
    hook_files: Dict[str, Any] = field(default_factory=dict)
    hook_error: Optional[str] = None
    # True when the processes save to folders of their own (`CheckpointManager.resolve_save_dir`):
    # every process writes the replicated objects too, and commits its own folder
    own_folder: bool = False


# Arrays a load reads straight into the live ones (see `CheckpointManager._places`) from this
# size; smaller ones go to fresh memory in the same pass that verifies them: placing them saves
# little memory, and it costs a second read of their file. The conformance suite sets the
# variable to 0, so that every load of its groups takes the two-pass path.
IN_PLACE_MIN_BYTES = 1 << 20


# Files a load verifies, then reads into place, side by side: each file is one hash stream (its
# xxh3 cannot be split), so a second one keeps a second core busy. JAX, 1.5 GB in 2 files in a
# fresh process on 2 cores: the two passes took 0.26 s and 0.31 s one file after the other.
_FILES_AT_ONCE = max(1, min(4, os.cpu_count() or 1))


def in_place_min_bytes() -> int:
    return int(os.environ.get(IN_PLACE_VARIABLE) or IN_PLACE_MIN_BYTES)


@dataclass
class Place:
    """Where a load's second pass puts one large array of a live object (`CheckpointManager._places`):
    ``into`` is the array's own writable bytes (torch: read in place) or a callable that replaces
    the object's array by a new one made from the bytes (`Replaceable.replace`: JAX); ``current()``
    is the array the object holds (after the load: the restored one)."""

    into: Any
    current: Callable[[], Any]
    # a replaced array's own memory when it may be written in place after all (`Replaceable.writable_in_place`)
    own: Callable[[], Any] = lambda: None

    def target(self) -> Any:
        """``into``, or the array's own writable memory when `own` gives it (asked once, in the second pass)."""
        owned = self.own()
        return self.into if owned is None else owned


@dataclass
class InPlace:
    """A file of a load that is verified first and read into the live arrays once every check
    passed (`CheckpointManager._read_in_place`): where it is, what the first pass saw."""

    path: str
    size: int
    checksum: str
    identity: Any  # for `Location.changed` before the second pass
    described: Dict[str, Tuple[str, Tuple[int, ...]]]
    places: Dict[str, Place]  # array name -> where the second pass puts it
    copy: Optional[str] = None  # a store's file: its verified local copy, which the second pass reads

    def placeholders(self) -> Dict[str, np.ndarray]:
        """Read-only arrays of every saved dtype and shape that hold no memory (for the checks
        that run before anything is read into place)."""
        return {name: np.lib.stride_tricks.as_strided(np.zeros(1, safetensors_io.numpy_dtype(dtype)), shape,
                                                      (0,) * len(shape), writeable=False)
                for name, (dtype, shape) in self.described.items()}


@dataclass
class ShardedLater:
    """An object's state whose sharded arrays a load makes and puts in place one at a time once
    every check passed (`CheckpointManager._place_sharded`): its verified unsharded arrays, and
    its own sharded ones (`DeferredArray`s, or arrays the reader made already)."""

    arrays: Dict[str, Any]
    sharded: Dict[str, Any]

    def undecoded(self, structure: Any) -> Any:
        """The state with the deferred arrays in the arrays' places (for the checks before)."""
        return codec.decode(structure, {**self.arrays, **self.sharded}, lambda a: a, ready=self.sharded.keys())


def _described(arrays: Dict[str, np.ndarray]) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    return {name: (safetensors_io.safetensors_dtype(a.dtype), tuple(a.shape)) for name, a in arrays.items()}


HOST_GENERATORS = ("python", "numpy")


def _like(backend: Backend, live: Any, saved: np.ndarray) -> Any:
    """``live`` when it is a framework array of the ``saved`` array's dtype and shape, else None."""
    if live is None or isinstance(live, np.ndarray) or not backend.is_array(live):
        return None
    try:
        same = backend.describe_array(live) == (safetensors_io.safetensors_dtype(saved.dtype), tuple(saved.shape))
    except (TypeError, ValueError):
        return None
    return live if same else None


def _same_state(a: Any, b: Any) -> bool:
    """Whether two decoded generator states are equal (NumPy arrays by dtype, shape and value)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and bool(np.array_equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _state_bytes(value: Any) -> bytes:
    """A canonical byte form of a decoded generator state (for `derived_rng_seed`)."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype.str}{list(value.shape)}".encode() + np.ascontiguousarray(value).tobytes()
    if isinstance(value, dict):
        return b"{" + b",".join(json.dumps(k).encode() + b":" + _state_bytes(value[k]) for k in sorted(value)) + b"}"
    if isinstance(value, (list, tuple)):
        return b"[" + b",".join(_state_bytes(v) for v in value) + b"]"
    return json.dumps(value, default=repr).encode()


def derived_rng_seed(generator: str, process_index: int, saved_processes: int, template: Any) -> int:
    """The seed of ``generator`` on a process that did not exist in the saving run
    (``process_index >= saved_processes``): a 32-bit value of NumPy's ``SeedSequence`` over the
    generator's name, the process index, the saving run's process count and the saved state of
    the same generator on process ``process_index % saved_processes`` (``template``). The same
    checkpoint resumed with the same count gives the same streams; different processes, generators
    and checkpoints give unrelated ones.

    Example:
        >>> derived_rng_seed("python", 2, 2, {"state": [1, 2, 3]}) == derived_rng_seed(
        ...     "python", 2, 2, {"state": [1, 2, 3]})
        True
    """
    entropy = [zlib.crc32(f"unified-rng/{generator}".encode()), int(process_index), int(saved_processes),
               zlib.crc32(_state_bytes(template))]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def resolve_rng(streams: List[Dict[str, Any]], process_index: int) -> Dict[str, Any]:
    """The random streams of process ``process_index`` from every saving process's ``streams``
    (``{"host": {"python", "numpy"}, "framework": {name: state}}``), when the count changed.

    Per generator (Python's ``random``, NumPy's global generator, each framework generator):
    a generator in the same state on every saving process (seeded alike, as ``Accelerator(seed=)``
    and ``set_seed(seed)`` do; the JAX key stream) gets that state on every process; otherwise
    process ``i`` below the saving count gets process ``i``'s saved state, and a process that
    did not exist gets the generator seeded with `derived_rng_seed`.

    Returns ``{"host", "framework"}`` states to restore, ``"derived"`` (generator -> seed, for
    this process) and ``"differing"`` (generators whose saved states differed between processes).
    """
    saved = len(streams)
    names = list(HOST_GENERATORS) + sorted(set.intersection(*(set(s["framework"]) for s in streams)))

    def state_of(stream: Dict[str, Any], name: str) -> Any:
        return stream["host"][name] if name in HOST_GENERATORS else stream["framework"][name]

    mine = streams[process_index] if process_index < saved else streams[process_index % saved]
    host, framework = dict(mine["host"]), dict(mine["framework"])
    derived: Dict[str, int] = {}
    differing = []
    for name in names:
        values = [state_of(s, name) for s in streams]
        if all(_same_state(values[0], v) for v in values[1:]):
            value = values[0]
        else:
            differing.append(name)
            value = values[process_index % saved]
            if process_index >= saved:
                derived[name] = derived_rng_seed(name, process_index, saved, value)
        (host if name in HOST_GENERATORS else framework)[name] = value
    return {"host": host, "framework": framework, "derived": derived, "differing": differing}


class CheckpointManager:
    """Saves and loads an Accelerator's registered state. One per Accelerator.

    ``backend`` provides array export and the framework RNG; ``collectives`` the timed syncs.
    """

    def __init__(self, backend: Backend, collectives: "Collectives", config: "ProjectConfiguration") -> None:
        self.backend = backend
        self.collectives = collectives
        self.config = config
        self.entries: List[Entry] = []
        # arrays split across processes, where the backend has them: sharded.<format>/ in a checkpoint
        self.sharding: Optional[ShardedArrays] = backend if isinstance(backend, ShardedArrays) else None
        self.sharded_dir = f"sharded.{self.sharding.sharded_format}" if self.sharding else None
        self._lock_key: Optional[str] = None  # main process: the checkpoint folder it holds
        self._lease: Optional[lease.Lease] = None  # main process: the store prefix it holds
        self._held_folder: Optional[str] = None
        self._channel: Any = None  # the health channel, once asked for (False: the backend has none)
        self._hook_copy: Optional[str] = None  # a load from a store: the hook files, downloaded for the hooks
        self._load_copies: Optional[str] = None  # a load from a store: verified local copies (`_copy_for`)
        self._copies_made = threading.Lock()
        # a load whose sharded reader reads the files verified before only when it makes the arrays
        # (`_place_sharded`): their identities, checked again after the last is made
        self._read_after_check: Optional[Dict[str, Any]] = None
        # a load that falls back to an older checkpoint when this one is damaged (`load`, `load_newest`)
        self._falling_back = False
        # main process: the experiment trackers' runs, written into every manifest (see TrackerSet)
        self.tracker_identities: Callable[[], Dict[str, Dict[str, str]]] = dict
        # this save's and this load's processes name folders of their own (`_own_folders`)
        self._own_save = False
        self._own_load = False
        # an async save to folders of their own: the checkpoint whose retention waits for every
        # process's commit (`finish_background_save`)
        self._own_pending: Optional[str] = None

    def _is_sharded(self, value: Any) -> bool:
        return self.sharding is not None and self.sharding.is_sharded(value)

    # -- what gets saved ----------------------------------------------------------------------------
    def add(self, entry: Entry) -> None:
        self.entries.append(entry)

    def _export(self, value: Any, detach: bool, live: Dict[str, Any], name: str,
                staged: Optional[List[str]] = None) -> safetensors_io.Exported:
        """One array as (dtype, shape, bytes). ``detach``: the bytes must keep the state of this
        moment while the training goes on (an async save): NumPy arrays and mutable framework
        arrays are copied, except where the backend can watch in-place changes instead
        (collected in ``live``) or stages device memory to the host without waiting (named in
        ``staged``); views of immutable arrays stay valid as they are."""
        if isinstance(value, np.ndarray):
            dtype, shape, raw = safetensors_io.export_numpy(value)
            return dtype, shape, (raw.copy() if detach else raw)
        if detach and staged is not None and isinstance(self.backend, WriteGuards):
            exported = self.backend.stage_array(value)
            if exported is not None:
                staged.append(name)
                return exported
        dtype, shape, raw = self.backend.export_array(value)
        if detach and not self.backend.immutable_arrays:
            if isinstance(self.backend, WriteGuards):
                live[name] = value
            else:
                raw = raw.copy()
        return dtype, shape, raw

    def snapshot(self, iteration: int, detach: bool = False, skip: Collection[str] = ()) -> Snapshot:
        """Everything this process must write, as host arrays. ``detach`` makes the snapshot
        hold the state of this moment while training goes on (see `_export`); the objects named
        in ``skip`` are not saved (save-state hooks saved them their own way)."""
        snap = Snapshot(iteration=iteration, skipped=list(skip), own_folder=self._own_save)
        # in folders of their own, every process's folder holds the replicated objects too: the
        # only folder a process can read when it resumes
        main = self.backend.process_index == 0 or snap.own_folder
        live: Dict[str, Any] = {}
        staged: List[str] = []
        for entry in self.entries:
            if entry.name in snap.skipped:
                continue
            try:
                structure, arrays = codec.encode(entry.get_state(), self.backend.is_array, entry.name)
            except TypeError as err:
                raise CheckpointError(f"cannot save {entry.name}: {err}" + see("cannot-save")) from err
            whole = {}
            for name, value in arrays.items():
                if self._is_sharded(value):  # every process holds a part: all write
                    if snap.own_folder:
                        raise CheckpointError(
                            f"cannot save {entry.name}: arrays sharded across processes need one checkpoint "
                            "folder that every process sees; the processes named folders of their own. Name one "
                            "shared folder, or an object store (docs/object-storage.md)." + see("own-folders"))
                    key = f"a{len(snap.sharded)}"
                    snap.sharded[key], snap.sharded_names[key] = value, name
                elif main:
                    whole[name] = self._export(value, detach, live, name, staged)
            if main:
                snap.structures[entry.name] = structure
                snap.files[f"{entry.name}.safetensors"] = whole
        rank = self.backend.process_index
        rng = {"host": capture_host_rng(), "framework": self.backend.rng_state()}
        structure, arrays = codec.encode(rng, lambda x: False, f"rng_{rank}")
        snap.structures[f"rng_{rank}"] = structure
        snap.files[f"rng_{rank}.safetensors"] = {k: self._export(v, detach, live, k, staged) for k, v in arrays.items()}
        if staged:
            snap.ready = self.backend.staged()  # type: ignore[attr-defined]
        if live:
            snap.live, snap.changed_in_place = True, self.backend.watch_in_place_changes(live)  # type: ignore[attr-defined]
        return snap

    # -- save ----------------------------------------------------------------------------------------
    def resolve_save_dir(self, output_dir: Optional[str]) -> str:
        config = self.config
        if config.automatic_checkpoint_naming:
            if config.project_dir is None:
                raise ValueError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)."
                                 + see("auto-naming-needs-project-dir"))
            if output_dir is not None:
                raise ValueError("With automatic_checkpoint_naming, call save_state() without output_dir."
                                 + see("auto-naming-output-dir"))
            folder = os.path.join(config.project_dir, layout.CHECKPOINTS)
            self._own_save = self._own_folders(config.project_dir, "save_state (where?)")
            if is_url(folder):
                self._hold_store(config.project_dir)
            elif self._own_save:
                self._hold_own_folder(config.project_dir)
            else:
                self._hold_folder(config.project_dir)
            # One process decides the number, from its listing; everyone uses it.
            def number() -> int:
                location = location_of(folder)
                highest = location.highest_number(folder)
                # never collide with an existing checkpoint_N (or one set aside as damaged)
                chosen = config.iteration if highest is None or config.iteration > highest else highest + 1
                # nor write over a commit the listing missed (a store's listing may be stale): asked one by one
                while location.taken(folder, chosen):
                    chosen += 1
                return chosen

            if self._own_save:  # each folder's first free number; the highest is free in every folder
                config.iteration = max(self._decided_by_each("save_state (name)", folder, number))
            else:
                config.iteration = self._decided_by_main("save_state (name)", folder, number)
            return layout.automatic_dir(config.project_dir, config.iteration)
        target = output_dir if output_dir is not None else config.project_dir
        if target is None:
            raise ValueError(
                "save_state() needs a directory: pass output_dir, or set project_dir, or enable "
                "ProjectConfiguration(automatic_checkpoint_naming=True)." + see("save-needs-directory")
            )
        target = checkpoint_location(target)
        self._own_save = self._own_folders(target, "save_state (where?)")
        if self._own_save:
            refusals = self._decided_by_each("save_state (may it write here?)", target,
                                             lambda: location_of(target).refusal(target))
            refused = [(rank, why) for rank, why in enumerate(refusals) if why]
            if refused:
                raise CheckpointError(f"{target}: refusing to save here: "
                                      + "; ".join(f"process {rank}: {why}" for rank, why in refused)
                                      + see("refusing-to-save-here"))
            return target
        refusal = self._decided_by_main("save_state (may it write here?)", target,
                                        lambda: location_of(target).refusal(target))
        if refusal:
            raise CheckpointError(f"{target}: refusing to save here: {refusal}" + see("refusing-to-save-here"))
        return target

    def _decided_by_main(self, operation: str, where: str, decide: Callable[[], Any]) -> Any:
        """``decide()`` (a look at the checkpoint folder or store: a JSON value) on the main
        process, its answer on every process: the processes cannot disagree, a store gets one
        request instead of one per process, and when the look fails (a store out of reach) every
        process raises `CheckpointError` at once instead of waiting for the main one."""
        answer: Optional[Dict[str, Any]] = None
        if self.backend.process_index == 0:
            try:
                answer = {"value": decide()}
            except (OSError, CheckpointError) as err:
                answer = {"error": str(err)}
        answer = self.collectives.broadcast_json(answer, operation=operation)
        if "error" in answer:
            raise CheckpointError(f"{where}: {operation} failed on process 0: {answer['error']}"
                                  + see("store-listing-failed"))
        return answer["value"]

    def _own_folders(self, where: str, operation: str) -> bool:
        """Whether the processes name folders of their own for this save or load (collective):
        each process gathers the folder every process named (strings, as JSON). The same folder
        (as an absolute path) everywhere is one checkpoint folder that every process sees, and
        the main process commits it; different folders are what a job on machines without a
        shared file system names (``tempfile.mkdtemp()``, a local disk's path per machine): each
        process then commits its own folder (docs/checkpoints.md). An object store is one place
        every process reaches: different URLs, or a URL beside a folder, are refused."""
        named = self.collectives.all_gather_json(where if is_url(where) else os.path.abspath(where),
                                                 operation=operation)
        if len(set(named)) == 1:
            return False
        if any(is_url(name) for name in named):
            raise CheckpointError(f"{where}: the processes named different checkpoint locations ("
                                  + ", ".join(f"process {rank}: {name}" for rank, name in enumerate(named))
                                  + "), one of them an object store, which every process reaches: name the same "
                                  "URL on every process." + see("own-folders"))
        return True

    def _decided_by_each(self, operation: str, where: str, decide: Callable[[], Any]) -> List[Any]:
        """``decide()`` (a look at this process's own folder: a JSON value) on every process, and
        every process's answer on every process, in process order (folders of their own, see
        `_own_folders`); when the look fails on any process, every process raises
        `CheckpointError` naming each one that failed."""
        try:
            answer: Dict[str, Any] = {"value": decide()}
        except (OSError, CheckpointError) as err:
            answer = {"error": _LINK.sub("", str(err))}
        answers = self.collectives.all_gather_json(answer, operation=operation)
        failed = [(rank, a["error"]) for rank, a in enumerate(answers) if "error" in a]
        if failed:
            raise CheckpointError(f"{where}: {operation} failed; " + _reasons(failed) + see("store-listing-failed"))
        return [a["value"] for a in answers]

    def _hold_own_folder(self, folder: str) -> None:
        """`_hold_folder` for folders of their own: every process locks its own ``project_dir``."""
        if self._held_folder == folder:
            return
        failure: Optional[BaseException] = None
        try:
            self.release_folder()
            layout.make_dirs(folder)
            self._lock_key = lock.acquire(folder)
        except (OSError, CheckpointError) as err:
            failure = err
        failed = self.collectives.share_failure(failure, "save_state (lock)")
        if failed:
            raise CheckpointError(f"process {failed[0][0]}: {failed[0][1]}" + see("folder-in-use"))
        self._held_folder = folder

    def _hold_folder(self, folder: str) -> None:
        """The main process locks the checkpoint folder for this run (once); every process learns
        at once when another live run holds it."""
        if self._held_folder == folder:
            return
        def hold() -> None:
            self.release_folder()
            layout.make_dirs(folder)  # a new project_dir is made durable (the lock would create it without)
            self._lock_key = lock.acquire(folder)

        failed = self._on_main_process("save_state (lock)", hold, lambda err: err)
        if failed:
            raise CheckpointError(f"process {failed[0]}: {failed[1]}" + see("folder-in-use"))
        self._held_folder = folder

    def _hold_store(self, project_dir: str) -> None:
        """The main process holds the lease of the store's prefix for this run (`lease`), taken at
        the first save and renewed at every save; every process learns at once when another
        live run holds it or this run lost it. Stores whose client cannot write conditionally
        get no lease (docs/object-storage.md)."""
        def hold() -> None:
            if self._lease is not None and self._held_folder == project_dir:
                self._lease.check()
                return
            self.release_folder()
            fs = ObjectStore(project_dir).fs
            if lease.supported(fs):
                self._lease = lease.Lease.acquire(fs, project_dir)

        failed = self._on_main_process("save_state (lease)", hold, lambda err: err)
        if failed:
            raise CheckpointError(f"process {failed[0]}: {failed[1]}" + see("store-in-use"))
        self._held_folder = project_dir

    def _on_main_process(self, operation: str, action: Callable[[], None],
                         failure_of: Callable[[OSError], BaseException]) -> Optional[Tuple[int, str]]:
        """Run ``action`` on the main process only (the others wait); an `OSError` or
        `CheckpointError` there, as ``failure_of`` words it, reaches every process at once:
        raised where it happened, returned as ``(process, reason)`` elsewhere."""
        failure: Optional[BaseException] = None
        if self.backend.process_index == 0:
            try:
                action()
            except CheckpointError as err:
                failure = err
            except OSError as err:
                failure = failure_of(err)
        failed = self.collectives.share_failure(failure, operation)
        return failed[0] if failed else None

    def release_folder(self) -> None:
        """Unlock the folder this run held (`end_training`)."""
        if self._lock_key is not None:
            lock.release(self._lock_key)
        if self._lease is not None:
            self._lease.release()
        self._lock_key, self._lease, self._held_folder = None, None, None

    def safe_snapshot(self, iteration: int, detach: bool = False, skip: Collection[str] = ()) -> Snapshot:
        """`snapshot` on every process, failing on every process when it fails on any."""
        failure: Optional[BaseException] = None
        try:
            snap = self.snapshot(iteration, detach, skip)
        except Exception as err:  # noqa: BLE001 - any failure here (a framework's RuntimeError too) is shared, never left for the others to wait out
            failure = err
        failed = self.collectives.share_failure(failure, "save_state (snapshot)")
        if failed:
            raise CheckpointError("save_state failed on another process before writing anything: "
                                  + "; ".join(f"process {rank}: {reason}" for rank, reason in failed)
                                  + see("save-failed-before-writing"))
        return snap

    def begin(self, final: str) -> Tuple[str, str]:
        """Agree on a token for this save (collective); returns ``(token, temporary directory)``."""
        token = self.collectives.broadcast_json(uuid.uuid4().hex[:12] if self.backend.process_index == 0 else None,
                                                operation="save_state (begin)")
        return token, location_of(final).staging(final, token)

    def run_save_hooks(self, tmp: str,
                       run_hooks: Callable[[str], List[str]]) -> Tuple[List[str], Dict[str, Any], Optional[str]]:
        """Run the save-state hooks (``run_hooks(folder)``, every process) with the folder they
        write into: ``tmp`` itself, or, on a store (hooks write with ``open()``), a local
        temporary folder whose files are then uploaded into ``tmp``, hashed as they go, and
        removed. Returns what ``run_hooks`` returned, the files uploaded, and why an upload
        failed (None): the save reports it from this process, so that every process raises."""
        if not is_url(tmp):
            Folder().prepare(tmp)  # the folders it creates are made durable (the hooks' runner only makes them)
            return run_hooks(tmp), {}, None
        local = tempfile.mkdtemp(prefix="unified-save-hooks-")
        try:
            skip = run_hooks(local)
            location, uploaded = location_of(tmp), {}
            try:
                for name in _tree(local, ""):
                    check_file_name(local, name)
                    uploaded[name] = location.upload(os.path.join(local, name), f"{tmp.rstrip('/')}/{name}")
            except (OSError, CheckpointError) as err:
                return skip, {}, f"process {self.backend.process_index}: a save-state hook's file: {err}"
            return skip, uploaded, None
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def refuse_sharded_on_store(self, final: str, snap: Snapshot) -> None:
        """The same decision on every process: each holds a part of the sharded arrays."""
        if snap.sharded and is_url(final) and not getattr(self.sharding, "sharded_to_store", False):
            if snap.hook_files:  # uploaded by the hooks, which ran first
                location_of(final).discard(final)
            raise CheckpointError(f"save_state({final!r}): the {self.backend.name!r} backend saves arrays sharded "
                                  "across processes to a folder only in this version; nothing was written. Save to a "
                                  "folder (on several machines, one they all mount)." + see("object-storage-limits"))

    def begin_sharded(self, tmp: str, snap: Snapshot) -> Optional[ShardedWrite]:
        """The calling thread's half of an async save's sharded write (every process; the
        backend's collectives): host copies of this process's own shards and the plan. Returns
        the write for the background, None without sharded arrays. A failure here is not raised:
        the write carries it, so that it reaches every process through the save's reports."""
        if not snap.sharded:
            return None
        try:
            location_of(tmp).prepare(tmp)
            return self.sharding.begin_sharded_save(os.path.join(tmp, self.sharded_dir), snap.sharded)
        except (OSError, CheckpointError) as err:
            error = err  # `err` is unbound once the except clause ends

            def failed() -> None:
                raise error

            return ShardedWrite(failed)

    def write_part(self, tmp: str, snap: Snapshot, sharded: Optional[ShardedWrite] = None,
                   released: Callable[[], None] = lambda: None) -> Dict[str, Any]:
        """Write this process's files; returns its report (or an ``error``), never raises OSError.

        Sharded arrays: with ``sharded`` (an async save, see `begin_sharded`) this process's
        writes, without a collective; otherwise `ShardedArrays.save_sharded`, a collective,
        joined even after a failure here so that no process waits for this one. ``released`` is
        called once nothing reads the snapshot's live memory any more."""
        rank = self.backend.process_index
        report = self._write_whole(tmp, snap)
        released()
        if snap.hook_error is not None:
            report = {"error": f"{report['error']}; {snap.hook_error}" if "error" in report else snap.hook_error}
        elif snap.hook_files and "error" not in report:
            report["hook_files"] = snap.hook_files
        if snap.sharded:
            # an async write finishes even after a failure: nothing may write into tmp once it is
            # removed; whatever it raises is this process's report (the main process waits for it)
            caught = (OSError, CheckpointError) if sharded is None else Exception
            try:
                if sharded is not None:
                    hashes = sharded.result()
                else:
                    hashes = self.sharding.save_sharded(os.path.join(tmp, self.sharded_dir), snap.sharded)
            except caught as err:
                reason = f"process {rank}: {err if isinstance(err, (OSError, CheckpointError)) else repr(err)}"
                return {"error": f"{report['error']}; {reason}" if "error" in report else reason}
            if "error" not in report:
                if hashes is not None:  # hashed as they were written: no second pass over them
                    report["files"].update({f"{self.sharded_dir}/{name}": info for name, info in hashes.items()})
                report["shards_hashed"] = hashes is not None
                if rank == 0:
                    report["sharded"] = snap.sharded_names
        return report

    def _write_whole(self, tmp: str, snap: Snapshot) -> Dict[str, Any]:
        """The files this process writes whole (`Snapshot.files`): its report, or an ``error``."""
        location = location_of(tmp)
        try:
            snap.ready()
            location.prepare(tmp)
            files = {name: location.write(os.path.join(tmp, name), arrays, snap.live)
                     for name, arrays in snap.files.items()}
        except OSError as err:
            return {"error": f"process {self.backend.process_index}: {err}"}
        changed = snap.changed_in_place()
        if changed:  # the files may mix two moments: never commit them
            return {"error": f"process {self.backend.process_index}: {', '.join(sorted(changed)[:5])}"
                             f"{' and more' if len(changed) > 5 else ''} changed in place while the asynchronous "
                             "save was writing them (an EMA update or weight edit before wait_for_checkpoint()?); "
                             "call accelerator.wait_for_checkpoint() before changing saved state in place"}
        return {"files": files, "structures": snap.structures}

    def save(self, final: str, snap: Snapshot, begun: Optional[Tuple[str, str]] = None) -> str:
        """Write ``snap`` into a temporary directory and commit it as ``final`` (collective);
        ``begun``: the ``(token, temporary directory)`` of a `begin` already made."""
        self.refuse_sharded_on_store(final, snap)
        token, tmp = begun if begun is not None else self.begin(final)
        reports = self.collectives.all_gather_json(self.write_part(tmp, snap), operation="save_state (written)")
        if snap.own_folder:
            self._commit_own(final, tmp, token, reports, snap)
            return final
        if snap.sharded and not any("error" in r or r.get("shards_hashed") for r in reports):
            # every process's shards are on disk and no writer hashed them: each process checksums
            # an equal share of them (the decision is the same everywhere: it reads only the reports)
            hashed = self.collectives.all_gather_json(self._hash_share(tmp), operation="save_state (shards hashed)")
            reports = [{**r, "error": h["error"]} if "error" in h else r for r, h in zip(reports, hashed)]
            reports[0].setdefault("shard_files", {}).update(
                {k: v for h in hashed for k, v in h.get("files", {}).items()})
        # A failed commit (full disk, file-size limit...) reaches everyone now, not at the timeout.
        # The main process lists every process's shard files now that all of them are written.
        failed = self._on_main_process(
            "save_state (committed)",
            lambda: self._commit(final, tmp, token, self._list_shard_files(tmp, snap, reports), snap),
            lambda err: _commit_error(final, err))
        if failed:
            raise CheckpointError(f"a save_state failed on process {failed[0]}: {failed[1]}"
                                  + see("background-save-failed"))
        _raise_reported(final, reports)
        return final

    def save_in_background(self, final: str, token: str, tmp: str, snap: Snapshot,
                           sharded: Optional[ShardedWrite] = None, released: Callable[[], None] = lambda: None) -> str:
        """The async variant, run in a thread on every process, without collectives: each process
        leaves a part marker in ``tmp`` (its report, or why it could not write its part) once its
        files, its own shards included (``sharded``, begun by `begin_sharded`), are written; the
        main process waits for all markers, lists every process's shard files, then commits. A
        process that cannot write even its marker (a full disk) posts why on the group's health
        channel, so that the main process learns it at once rather than at the timeout."""
        if snap.own_folder:
            return self._own_in_background(final, token, tmp, snap, released)
        report = self.write_part(tmp, snap, sharded, released)
        rank, count = self.backend.process_index, self.backend.num_processes
        if rank != 0:
            try:
                location_of(tmp).post_report(os.path.join(tmp, f"part_{rank}.json"), report)
            except BaseException as err:
                reason = f"process {rank}: could not write its part marker ({err})"
                reason = f"{report['error']}; {reason}" if "error" in report else reason
                self._post_part_failure(token, reason)
                if not isinstance(err, OSError):
                    raise
                _raise_reported(final, [{"error": reason}])
            _raise_reported(final, [report])  # the main process will not commit; say why here too
            return final
        reports = [report] + [self._wait_part(tmp, r, token) for r in range(1, count)]
        try:
            self._commit(final, tmp, token, self._list_shard_files(tmp, snap, reports), snap)
        except OSError as err:
            raise _commit_error(final, err) from err
        _raise_reported(final, reports)
        return final

    # -- folders of their own (docs/checkpoints.md#machines-without-a-shared-file-system) ----------
    def _commit_own(self, final: str, tmp: str, token: str, reports: List[Dict[str, Any]], snap: Snapshot) -> None:
        """Every process commits its own folder (its manifest written last, the folder made
        durable and renamed into place) once every process's part is written; then, once every
        process committed, each applies retention to its own folder. A failure anywhere
        reaches every process; nothing of a save that failed before the commits stays behind."""
        rank, location = self.backend.process_index, location_of(final)
        failure: Optional[BaseException] = None
        if any("error" in r for r in reports):
            location.discard(tmp)
        else:
            try:
                self._write_manifest_and_rename(final, tmp, token, [reports[rank]], snap)
            except CheckpointError as err:
                location.discard(tmp)
                failure = err
            except OSError as err:
                location.discard(tmp)
                failure = _commit_error(final, err, rank)
        failed = self.collectives.share_failure(failure, "save_state (committed)")
        if failed:
            raise CheckpointError(f"a save_state failed on process {failed[0][0]}: {failed[0][1]}"
                                  + see("background-save-failed"))
        _raise_reported(final, reports)
        self._retain_own(final)

    def _retain_own(self, final: str) -> None:
        """Each process deletes what crashed saves left beside its ``final`` and, with automatic
        naming, its own folder's oldest checkpoints beyond ``total_limit`` (collective)."""
        failure: Optional[BaseException] = None
        try:
            location_of(final).after_commit(final, self.config.automatic_checkpoint_naming, self.config.total_limit)
        except OSError as err:
            failure = _retention_error(final, err)
        failed = self.collectives.share_failure(failure, "save_state (retention)")
        if failed:
            raise CheckpointError(f"process {failed[0][0]}: {_LINK.sub('', failed[0][1])}"
                                  + see("retention-delete-failed"))

    def _own_in_background(self, final: str, token: str, tmp: str, snap: Snapshot,
                           released: Callable[[], None]) -> str:
        """`save_in_background` for folders of their own: this process writes and commits its
        own folder, without collectives; retention waits until every process committed
        (`finish_background_save`, at `wait_for_checkpoint`)."""
        report = self.write_part(tmp, snap, None, released)
        location = location_of(final)
        if "error" in report:
            location.discard(tmp)
            _raise_reported(final, [report])
        try:
            self._write_manifest_and_rename(final, tmp, token, [report], snap)
        except CheckpointError:
            location.discard(tmp)
            raise
        except OSError as err:
            location.discard(tmp)
            raise _commit_error(final, err, self.backend.process_index) from err
        self._own_pending = final  # only once committed: a process that failed has nothing to retain
        return final

    def finish_background_save(self, committed: bool) -> None:
        """After an async save's `wait_for_checkpoint` (collective, every process alike): in
        folders of their own, once every process ``committed`` its folder, each applies
        retention to its own; a save that failed anywhere deletes no older checkpoint."""
        final, self._own_pending = self._own_pending, None
        if final is not None and committed:
            self._retain_own(final)

    def _hash_share(self, tmp: str) -> Dict[str, Any]:
        """This process's share (`share_of`) of the shard files' checksums, or an ``error``."""
        rank, count = self.backend.process_index, self.backend.num_processes
        try:
            sizes = {name: os.path.getsize(os.path.join(tmp, name)) for name in _tree(tmp, self.sharded_dir)}
            return {"files": _hash_files(tmp, share_of(sizes, rank, count))}
        except OSError as err:
            return {"error": f"process {rank}: {err}"}

    def _list_shard_files(self, tmp: str, snap: Snapshot, reports: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Main process, once every process reported its part written: every process's shard
        files (size, xxh3) into its own report, for the manifest: those the processes hashed
        (``shard_files``, a sync save), and any file of the folder that none of them did (an
        async save, or a process that listed the folder differently). An OSError removes ``tmp``."""
        if snap.sharded and not any("error" in r for r in reports):
            hashed = reports[0].pop("shard_files", {})
            known = {name for r in reports for name in r["files"]}
            try:
                missing = [name for name in self._shard_files(tmp) if name not in hashed and name not in known]
                if missing and is_url(tmp):  # a store's writers hash what they write: nothing else belongs there
                    raise StoreError(f"{tmp}: {missing[0]} was written by the sharded writer without its checksum; "
                                     "nothing was committed." + see("save-failed"))
                reports[0]["files"].update({**hashed, **_hash_files(tmp, missing)})
            except OSError:
                location_of(tmp).discard(tmp)
                raise
        return reports

    def _shard_files(self, tmp: str) -> List[str]:
        """Every file below the sharded folder of ``tmp``, named ``sharded.<format>/...``."""
        if not is_url(tmp):
            return _tree(tmp, self.sharded_dir)
        return [f"{self.sharded_dir}/{name}" for name in ObjectStore(tmp).files(os.path.join(tmp, self.sharded_dir))]

    def _health(self) -> Optional[Any]:
        """The group's health channel (see `Backend.health_channel`), or None without one."""
        if self._channel is None:
            self._channel = (self.backend.health_channel() if self.backend.num_processes > 1 else None) or False
        return self._channel or None

    def _post_part_failure(self, token: str, reason: str) -> None:
        channel = self._health()
        if channel is not None:
            try:
                channel.post(f"{PART_FAILED}/{self.backend.process_index}",
                             json.dumps({"token": token, "error": reason}))
            except Exception:  # noqa: BLE001 - the service may be gone; the marker or the timeout still tell
                pass

    def _posted_part_failure(self, channel: Any, rank: int, token: str) -> Optional[str]:
        try:
            posted = channel.read().get(f"{PART_FAILED}/{rank}")
            failure = json.loads(posted) if posted else None
        except Exception:  # noqa: BLE001 - as above
            return None
        return failure["error"] if isinstance(failure, dict) and failure.get("token") == token else None

    def _wait_part(self, tmp: str, rank: int, token: str) -> Dict[str, Any]:
        """Process ``rank``'s report: its marker, or the failure it posted, or a timeout."""
        path = os.path.join(tmp, f"part_{rank}.json")
        location = location_of(tmp)
        deadline = time.monotonic() + self.collectives.timeout
        channel, look_at = self._health(), 0.0
        while True:
            try:
                report = location.take_report(path)
            except OSError as err:  # the store out of reach from the main process: its part's failure
                return {"error": f"process 0: {err}"}
            if report is not None:
                return report
            now = time.monotonic()
            if channel is not None and now >= look_at:
                failure = self._posted_part_failure(channel, rank, token)
                if failure is not None:
                    return {"error": failure}
                look_at = now + 0.2  # a read costs one request per name on some channels
            if now > deadline:
                return {"error": f"{path} did not appear within {self.collectives.timeout:g}s"}
            time.sleep(location.report_poll_seconds)

    def _commit(self, final: str, tmp: str, token: str, reports: List[Dict[str, Any]], snap: Snapshot) -> None:
        """Main process: write the manifest last, make every file and folder durable, rename
        into place, then apply retention; when it returns the checkpoint survives a power loss
        and older ones beyond ``total_limit`` are gone (as Accelerate's are when its save
        returns). Nothing of a save that failed (here or on any process) stays behind, and a
        failed save deletes no older checkpoint."""
        location = location_of(final)
        if any("error" in r for r in reports):
            location.discard(tmp)
            return
        try:
            self._write_manifest_and_rename(final, tmp, token, reports, snap)
        except (OSError, CheckpointError):
            location.discard(tmp)
            raise
        # Leftovers of crashed saves on a store are deleted only under this run's lease: without
        # one, a manifest-less checkpoint_N may be another live run's save in progress.
        leased = self._lease is not None and self._lease.lost is None
        try:
            location.after_commit(final, self.config.automatic_checkpoint_naming, self.config.total_limit, leased)
        except OSError as err:  # the checkpoint is committed: say so, not "not committed"
            raise CheckpointError(f"save_state({final!r}) committed the checkpoint, but removing older ones "
                                  f"(total_limit) or what crashed saves left failed: {_LINK.sub('', str(err))}. "
                                  "A checkpoint leaves the listing before its files are deleted: none is left "
                                  "half-deleted and still loadable." + see("retention-delete-failed")) from err

    def _write_manifest_and_rename(self, final: str, tmp: str, token: str, reports: List[Dict[str, Any]],
                                   snap: Snapshot) -> None:
        files: Dict[str, Any] = {}
        structures: Dict[str, Any] = {}
        for r in reports:
            files.update(r["files"])
            structures.update(r["structures"])
        # what save-state hooks wrote, verified at load (a file named like one of ours is ours)
        if is_url(tmp):
            uploaded = _merged_hook_files(tmp, reports)
            hook_files = sorted(set(uploaded) - set(files))
            files.update({name: uploaded[name] for name in hook_files})
        else:
            hook_files = sorted(set(_tree(tmp, "")) - set(files))
            for name in hook_files:
                check_file_name(tmp, name)
            files.update(_hash_files(tmp, hook_files))
        body = {
            "sharded": reports[0].get("sharded", {}),
            "backend": self.backend.name,
            "num_processes": self.backend.num_processes,
            "iteration": snap.iteration,
            "objects": [e.name for e in self.entries if e.name not in snap.skipped],
            "files": files,
            "structures": structures,
        }
        if hook_files or snap.skipped:
            body.update(hook_files=hook_files, hook_objects=list(snap.skipped))
        if snap.own_folder:  # this process's folder; the token tells a load that every folder is of one save
            body.update(process_folder=self.backend.process_index, save=token)
        trackers = self.tracker_identities()
        if trackers:  # the experiment trackers' runs, which a resumed job continues (init_trackers)
            body["trackers"] = trackers
        location_of(final).commit(tmp, final, token, body)

    # -- load ----------------------------------------------------------------------------------------
    def load_target(self, input_dir: Optional[str]) -> Tuple[str, bool]:
        """Where `load_state` looks, without touching the file system: ``(folder, True)`` for the
        ``checkpoints`` folder of automatic naming (the newest complete checkpoint in it), else
        ``(folder, False)`` for the checkpoint folder itself. Raises for nowhere to look."""
        config = self.config
        if input_dir is None and config.automatic_checkpoint_naming and config.project_dir is not None:
            return os.path.join(config.project_dir, layout.CHECKPOINTS), True
        target = input_dir if input_dir is not None else config.project_dir
        if target is None:
            raise ValueError("load_state() needs input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True) "
                             "with project_dir." + see("load-needs-directory"))
        return checkpoint_location(target), False

    def saved_tracker_identities(self) -> Dict[str, Dict[str, str]]:
        """The tracker runs (name -> identity) of the checkpoint that ``load_state()`` would load,
        ``{}`` when there is none or it names none; never raises (a damaged manifest is reported by
        ``load_state``, not here) and never a collective."""
        try:
            target, automatic = self.load_target(None)
            location = location_of(target)
            if automatic:
                found = location.numbered(target)
                if not found:
                    return {}
                target = found[-1][1]
            if not location.has_manifest(target):
                return {}
            saved = location.read_manifest(target).get("trackers") or {}
        except (ValueError, OSError, CheckpointError):
            return {}
        return {name: dict(identity) for name, identity in saved.items() if isinstance(identity, dict)}

    def has_checkpoint(self, input_dir: Optional[str]) -> bool:
        """Whether `load_target`'s answer holds a checkpoint to load (`load_state(if_exists=True)`):
        a complete automatically named one, or one set aside as damaged (then `load_newest` raises
        rather than let the run start fresh over it), or a ``manifest.json`` (or a checkpoint a save
        set aside, which `resolve_load_dir` puts back) in the folder. Collective: the main process
        looks, every process gets its answer (or raises when it could not look)."""
        folder, automatic = self.load_target(input_dir)  # on every process: nowhere to look raises everywhere
        location = location_of(folder)

        def look() -> bool:
            if automatic:
                return bool(location.numbered(folder)) or bool(location.damaged(folder))
            return location.has_manifest(folder) or (location.atomic_replace and layout.set_aside_exists(folder))

        if not self._own_folders(folder, "load_state (where?)"):
            return self._decided_by_main("load_state (is there a checkpoint?)", folder, look)
        found = self._decided_by_each("load_state (is there a checkpoint?)", folder, look)
        if all(found) or not any(found):
            return all(found)
        raise CheckpointError(
            f"{folder}: the processes named folders of their own, and only some hold a checkpoint (processes "
            f"{', '.join(str(r) for r, f in enumerate(found) if f)}; none in the folders of processes "
            f"{', '.join(str(r) for r, f in enumerate(found) if not f)}): neither resuming nor starting fresh "
            "would continue one training. Give every process its folder of the same run." + see("own-folders"))

    def load_newest(self, input_dir: Optional[str],
                    before_restore: Callable[[str], Collection[str]] = lambda folder: (),
                    if_exists: bool = False) -> str:
        """`load_state`'s load (collective); returns the checkpoint it loaded.

        An explicit ``input_dir`` (or ``project_dir`` without automatic naming) is loaded as it
        is: a damaged one raises. With automatic naming, the newest ``checkpoint_N`` is tried
        first; when its verification finds it damaged (`is_damage`, on any process, and no other
        kind of failure on any), the main process sets it aside (``checkpoint_N.damaged``; on a
        store its manifest moves to ``manifest.json.damaged``), warns which one it skipped and
        why, and the next newest is tried; every process takes the same decision from the same
        shared failures. Nothing is restored from a damaged checkpoint: verification runs
        before any object is touched. When none verifies, `CheckpointError` names every one
        skipped (``if_exists`` too: starting fresh would throw away their training).

        Example:
            >>> manager.load_newest(None, state_hooks.run_load)
            'runs/exp1/checkpoints/checkpoint_4'
        """
        target, automatic = self.load_target(input_dir)
        self._own_load = self._own_folders(target, "load_state (where?)")
        try:
            return self._load_newest(target, automatic, input_dir, before_restore, if_exists)
        finally:
            self._own_load = False

    def _load_newest(self, target: str, automatic: bool, input_dir: Optional[str],
                     before_restore: Callable[[str], Collection[str]], if_exists: bool) -> str:
        if not automatic:
            directory = self.resolve_load_dir(input_dir)
            self.load(directory, before_restore)
            return directory
        skipped: List[Tuple[str, str, str]] = []  # (checkpoint, why, where it was set aside)

        while True:
            newest = self._newest(target, {path for path, _, _ in skipped})
            if newest is None:
                error = self._nothing_verifies(target, skipped, if_exists)  # links to troubleshooting itself
                raise error
            try:
                self.load(newest, before_restore, fall_back=True)
                return newest
            except DamagedCheckpoint as damaged:
                why = _reasons(damaged.failed)
            skipped.append((newest, why, self._set_aside_damaged(newest, why)))

    def _newest(self, target: str, tried: Collection[str]) -> Optional[str]:
        """The newest committed ``checkpoint_N`` of the automatic naming's folder ``target`` that is
        not in ``tried``, or None (collective): the main process's answer; in folders of their
        own, the newest N committed in every process's folder (a save that one process could not
        commit is in some folders only), each process's own ``checkpoint_N``."""
        location = location_of(target)
        if not self._own_load:
            return self._decided_by_main(
                "load_state (newest)", target,
                lambda: ([None] + [path for _, path in location.numbered(target) if path not in tried])[-1])
        numbers = self._decided_by_each("load_state (newest)", target,
                                        lambda: [n for n, path in location.numbered(target) if path not in tried])
        common = set(numbers[0]).intersection(*numbers[1:])
        return os.path.join(target, f"checkpoint_{max(common)}") if common else None

    def _set_aside_damaged(self, checkpoint: str, why: str) -> str:
        """The main process sets the damaged ``checkpoint`` aside (the others wait) and warns; returns
        where it went, on every process. Raises on every process when it could not: a damaged
        checkpoint left in the listing would stay the newest, and retention would delete intact
        older ones first. In folders of their own, every process sets its own folder's aside."""
        answer: Optional[Dict[str, Any]] = None
        if self._own_load:
            try:
                answer = {"aside": location_of(checkpoint).set_aside_damaged(checkpoint)}
            except (OSError, CheckpointError) as err:
                answer = {"error": _LINK.sub("", str(err))}
            answers = self.collectives.all_gather_json(answer, operation="load_state (set aside a damaged checkpoint)")
            errors = [(rank, a["error"]) for rank, a in enumerate(answers) if "error" in a]
            answer = {"error": _reasons(errors)} if errors else answer
        elif self.backend.process_index == 0:
            try:
                answer = {"aside": location_of(checkpoint).set_aside_damaged(checkpoint)}
            except (OSError, CheckpointError) as err:
                answer = {"error": _LINK.sub("", str(err))}
        if not self._own_load:
            answer = self.collectives.broadcast_json(answer, operation="load_state (set aside a damaged checkpoint)")
        if "error" in answer:
            raise CheckpointError(f"{checkpoint}: damaged ({why}), and process 0 could not set it aside: "
                                  f"{answer['error']}. Nothing was restored. Move or delete it by hand, then load "
                                  "again: the next newest checkpoint is tried." + see("set-aside-failed"))
        if self.backend.process_index == 0:
            warnings.warn(
                f"load_state(): skipped {checkpoint}: it is damaged ({why}). It was set aside as {answer['aside']}, "
                "which is never listed, loaded, numbered again or deleted by retention: inspect it, then delete it. "
                "Trying the next newest checkpoint." + see("damaged-checkpoint-skipped"), stacklevel=4)
        return answer["aside"]

    def _nothing_verifies(self, target: str, skipped: List[Tuple[str, str, str]], if_exists: bool) -> CheckpointError:
        """The error of an automatic load that found no checkpoint to load (`load_newest`)."""
        location = location_of(target)

        def damaged() -> List[str]:
            return [path for _, path in location.damaged(target) if path not in {a for _, _, a in skipped}]

        # in folders of their own, each process names its own folder's
        earlier = damaged() if self._own_load else self._decided_by_main("load_state (damaged ones)", target, damaged)
        if not skipped and not earlier:
            return CheckpointError(f"{target}: no complete checkpoint to load." + see("no-complete-checkpoint"))
        said = [f"{checkpoint} ({why}; set aside as {aside})" for checkpoint, why, aside in skipped]
        said += [f"{path} (set aside as damaged by an earlier load)" for path in earlier]
        fresh = ("load_state(if_exists=True) does not start fresh while damaged checkpoints exist: that would silently "
                 "throw away the training they hold. " if if_exists else "")
        return CheckpointError(
            f"{target}: no checkpoint verifies; nothing was restored. Damaged: {'; '.join(said)}. {fresh}Put a good "
            "copy of one of them back under its checkpoint_N name (from a backup), or, to start over, delete them "
            "(or move them out of the folder)." + see("no-checkpoint-verifies"))

    def resolve_load_dir(self, input_dir: Optional[str]) -> str:
        """The directory `load` reads (collective when it may first have to repair one)."""
        target, automatic = self.load_target(input_dir)
        location = location_of(target)
        if automatic:
            newest = self._newest(target, ())
            if newest is None:
                raise CheckpointError(f"{target}: no complete checkpoint to load." + see("no-complete-checkpoint"))
            return newest
        if location.atomic_replace:  # a folder: a save may have set the old checkpoint aside
            self._recover(target)
        if self._own_load:
            has_manifest = all(self._decided_by_each("load_state (is there a manifest?)", target,
                                                     lambda: location.has_manifest(target)))
        else:
            has_manifest = self._decided_by_main("load_state (is there a manifest?)", target,
                                                 lambda: location.has_manifest(target))
        if input_dir is None and not has_manifest:
            raise ValueError(f"load_state(): {target} holds no checkpoint; pass input_dir, or use "
                             "ProjectConfiguration(automatic_checkpoint_naming=True)." + see("load-needs-directory"))
        return target

    def _recover(self, target: str) -> None:
        """The main process puts back a checkpoint that a save interrupted between its two renames
        left set aside; the others wait for it (every process renaming at once would race)."""
        def failure_of(err: OSError) -> CheckpointError:
            return CheckpointError(f"{target}: could not put back the checkpoint an interrupted save set aside "
                                   f"({err})." + see("recover-failed"))

        if self._own_load:  # every process repairs its own folder
            failure: Optional[BaseException] = None
            try:
                layout.recover(target)
            except OSError as err:
                failure = failure_of(err)
            shared = self.collectives.share_failure(failure, "load_state (recover)")
            failed = shared[0] if shared else None
        else:
            failed = self._on_main_process("load_state (recover)", lambda: layout.recover(target), failure_of)
        if failed:
            raise CheckpointError(f"{target}: process {failed[0]} could not repair it: {failed[1]}"
                                  + see("recover-failed"))

    def load(self, directory: str, before_restore: Callable[[str], Collection[str]] = lambda folder: (),
             fall_back: bool = False) -> Dict[str, Any]:
        """Verify and restore everything from ``directory`` (collective). Returns the manifest.

        ``before_restore(folder)`` runs once everything is verified, before any object is
        restored (the load-state hooks); it returns the names of the objects it restored itself.
        ``folder`` is ``directory``, or on a store a local temporary folder holding the verified
        files of the save-state hooks (removed once the load returns). ``fall_back``: when the
        verification's only failures, on every process, are damage (`is_damage`), raise
        `DamagedCheckpoint` on every process (`load_newest` then tries an older checkpoint)."""
        self._falling_back = fall_back
        try:
            return self._load(directory, before_restore)
        finally:
            self._falling_back = False
            for folder in (self._hook_copy, self._load_copies):
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)
            self._hook_copy = self._load_copies = None
            self._read_after_check = None

    def _load(self, directory: str, before_restore: Callable[[str], Collection[str]]) -> Dict[str, Any]:
        failure: Optional[BaseException] = None
        try:
            manifest, states, rng, sharded_files = self._read(directory)
            if not manifest.get("sharded"):
                self._check_resumable(directory, manifest, states)
        except (CheckpointError, OSError) as err:
            failure = err
        # Every process learns every failure, so each raises an error naming the bad file.
        self._share_verified(directory, failure, "load_state (verified)")
        if self._own_load:
            self._refuse_other_saves(directory, manifest)
        if manifest.get("sharded"):
            states = self._with_sharded(directory, manifest, states, sharded_files)
            failure = None
            try:
                self._check_resumable(directory, manifest, states)
            except CheckpointError as err:
                failure = err
            self._raise_shared(directory, failure, "load_state (resumable)")
        by_hooks = set(before_restore(self._hook_copy or directory))
        self._read_in_place(directory, manifest, {n: v for n, v in states.items() if n not in by_hooks}, states)
        self._place_sharded(directory, manifest, {n: v for n, v in states.items() if n not in by_hooks}, states)
        hook_saved = set(manifest.get("hook_objects", ()))
        left = sorted(hook_saved - by_hooks)
        if left:
            raise CheckpointError(f"{os.path.join(directory, 'manifest.json')}: {', '.join(left)} was saved by a "
                                  "save-state hook instead of unified, and no load-state hook restored it: register "
                                  "the matching load hook (accelerator.register_load_state_pre_hook)."
                                  + see("state-hooks"))
        for entry in self.entries:
            if entry.name in by_hooks:
                continue
            try:
                entry.set_state(states[entry.name])
            except (KeyError, ValueError, RuntimeError, TypeError) as err:
                raise CheckpointError(f"{os.path.join(directory, entry.name + '.safetensors')}: cannot restore "
                                      f"{entry.name}: {err}" + see("cannot-restore")) from err
        self._restore_rng(rng, manifest)
        if self.config.automatic_checkpoint_naming and self.config.project_dir is not None:
            folder = os.path.join(self.config.project_dir, layout.CHECKPOINTS)
            if self._own_load or self._own_folders(self.config.project_dir, "load_state (next number: where?)"):
                numbers = [n for n in self._decided_by_each("load_state (next number)", folder,
                                                            lambda: location_of(folder).highest_number(folder))
                           if n is not None]
                highest = max(numbers) if numbers else None
            else:
                highest = self._decided_by_main("load_state (next number)", folder,
                                                lambda: location_of(folder).highest_number(folder))
            self.config.iteration = 0 if highest is None else highest + 1
        return manifest

    def _refuse_other_saves(self, directory: str, manifest: Dict[str, Any]) -> None:
        """Folders of their own (collective, once every folder verified): every process's folder
        must hold the same save (the token its manifest carries; for copies of a checkpoint of
        one folder, the same files), or the processes would resume different states."""
        files = json.dumps(manifest.get("files"), sort_keys=True).encode()
        mine = manifest.get("save") or xxhash.xxh3_64_hexdigest(files)
        saves = self.collectives.all_gather_json(mine, operation="load_state (one save?)")
        if len(set(saves)) > 1:
            groups: Dict[str, List[int]] = {}
            for rank, save in enumerate(saves):
                groups.setdefault(save, []).append(rank)
            raise CheckpointError(
                f"{directory}: the processes' folders hold different saves (processes "
                + " / ".join(", ".join(map(str, ranks)) for ranks in groups.values())
                + "); nothing was restored. Give every process its folder of the same save_state call."
                + see("own-folders"))

    def _raise_shared(self, directory: str, failure: Optional[BaseException], operation: str) -> None:
        """Share ``failure`` (or none) with every process; raise on every process when any failed."""
        _raise_failed(directory, self.collectives.share_failure(failure, operation))

    def _share_verified(self, directory: str, failure: Optional[BaseException], operation: str) -> None:
        """`_raise_shared` for a failure of verification, before anything is restored; in a load
        that falls back (`load`), with whether each failure is damage: when every failure is,
        `DamagedCheckpoint` is raised on every process (the same decision everywhere: it is
        taken from the gathered failures), else each process raises as `_raise_shared` does."""
        if not self._falling_back:
            self._raise_shared(directory, failure, operation)
            return
        mine = None if failure is None else {"reason": failure_reason(failure), "damage": is_damage(failure)}
        gathered = self.collectives.all_gather_json(mine, operation)
        self._raise_gathered(directory, failure,
                             [(rank, g["reason"], g["damage"]) for rank, g in enumerate(gathered) if g])

    def _raise_gathered(self, directory: str, failure: Optional[BaseException],
                        failed: List[Tuple[int, str, bool]]) -> None:
        """Raise for every process's ``failed`` verification ``(index, reason, damage)``: all
        damage in a load that falls back: `DamagedCheckpoint`; else this process's own
        ``failure``, or the others' reasons."""
        if not failed:
            return
        if self._falling_back and all(damage for _, _, damage in failed):
            damaged = DamagedCheckpoint(directory, [(rank, reason) for rank, reason, _ in failed])  # links itself
            raise damaged from failure
        if failure is not None:
            raise failure
        _raise_failed(directory, [(rank, reason) for rank, reason, _ in failed])

    def _check_resumable(self, directory: str, manifest: Dict[str, Any], states: Dict[str, Any]) -> None:
        """Before any object is restored: every object with a check accepts its saved state in this
        run (a data position this process count continues exactly, no open accumulation window
        saved by another process count...)."""
        saved_processes = int(manifest.get("num_processes") or 0)
        for entry in self.entries:
            if entry.check is None or entry.name not in states:  # not in states: saved by a hook
                continue
            state = states[entry.name]
            if isinstance(state, InPlace):  # not read yet: its arrays' dtypes and shapes, no values
                state = codec.decode(manifest["structures"][entry.name], state.placeholders(), lambda a: a)
            elif isinstance(state, ShardedLater):  # its sharded arrays not made yet
                state = state.undecoded(manifest["structures"][entry.name])
            try:
                entry.check(state, saved_processes)
            except (KeyError, ValueError, TypeError) as err:
                raise CheckpointError(
                    f"{os.path.join(directory, entry.name + '.safetensors')}: cannot resume {entry.name} "
                    f"(saved by {saved_processes} processes, loaded by {self.backend.num_processes}): {err}. "
                    "Nothing was restored." + see("cannot-resume")) from err

    def _with_sharded(self, directory: str, manifest: Dict[str, Any], files: Dict[str, Any],
                      verified: Dict[str, Tuple[int, ...]]) -> Dict[str, Any]:
        """Decode every object from its verified ``files`` plus its sharded arrays, restored
        through the backend (a collective) and placed like the arrays the objects hold now.

        The backend's reader (Orbax) opens the sharded files itself, after they were verified:
        when any of them changed meanwhile (``verified`` holds their identities), what it read may
        not be what was verified, and nothing is restored, on any process."""
        encoded = {entry.name: codec.encode(entry.get_state(), self.backend.is_array, entry.name)[1]
                   for entry in self.entries}
        current = {name: value for arrays in encoded.values() for name, value in arrays.items()}
        owner = {name: entry for entry, arrays in encoded.items() for name in arrays}  # array -> its object
        names = manifest["sharded"]
        missing = [n for n in names.values() if n not in current]
        if missing:
            raise CheckpointError(f"{directory}: sharded arrays {missing} have no counterpart in this run's objects."
                                  + see("sharded-no-counterpart"))
        # (`_read` -> `_verify_sharded_tree` already refused sharded state on a backend without it)
        # in the order `_place_sharded` makes them: by object, then by name
        order = {entry.name: i for i, entry in enumerate(self.entries)}
        ordered = sorted(names.items(), key=lambda item: (order[owner[item[1]]], item[1]))
        root, like = os.path.join(directory, self.sharded_dir), {k: current[n] for k, n in ordered}
        hashing = self.sharding.hashes_while_reading or is_url(directory)  # a store is read hashed
        restored: Dict[str, Any] = {}
        hashes: Dict[str, Any] = {}
        read_error: Optional[BaseException] = None
        try:
            # a load in two passes (see `_place_sharded`) unless every array is below the size read in place
            bounded = any(int(getattr(value, "nbytes", 0)) >= in_place_min_bytes() for value in like.values())
            if hashing:
                restored, hashes = self.sharding.load_sharded_hashed(root, like,
                                                                     copy_to=self._copy_for if bounded else None)
            else:
                restored = (self.sharding.load_sharded_deferred(root, like) if bounded else None) or \
                    self.sharding.load_sharded(root, like)
                if any(isinstance(value, DeferredArray) for value in restored.values()):
                    self._read_after_check = verified  # the reader reads them later: checked again then
            del like, current, encoded  # a live array replaced later is freed then (`_place_sharded`)
        except Exception as err:
            read_error = err  # this process's alone (a hashing read is not a collective): shared below
            try:
                self._refuse_changed(verified)  # the likelier cause of its error
            except CheckpointError as changed:
                read_error = changed
                if not hashing:  # the backend's read was a collective: every process raised
                    raise changed
            if not hashing:
                raise err
        if hashing:
            self._check_read_hashes(directory, manifest, hashes, verified, read_error)
        else:
            failure: Optional[BaseException] = None
            try:
                self._refuse_changed(verified)
            except CheckpointError as err:
                failure = err
            self._raise_shared(directory, failure, "load_state (sharded files unchanged)")
        by_name = {names[k]: v for k, v in restored.items()}
        later = {owner[n] for n, v in by_name.items() if isinstance(v, DeferredArray)}
        return {entry.name: ShardedLater(files[entry.name],
                                         {n: v for n, v in by_name.items() if owner[n] == entry.name})
                if entry.name in later
                else self._decode(entry, manifest["structures"][entry.name], files[entry.name], by_name)
                for entry in self.entries if entry.name in files}

    def _place_sharded(self, directory: str, manifest: Dict[str, Any], candidates: Dict[str, Any],
                       states: Dict[str, Any]) -> None:
        """After every check passed on every process (collective): each sharded array a reader
        deferred (`DeferredArray`) is made and put in place of the live one at once
        (`Replaceable.adopt`: the old one is freed before the next is made), so a load holds
        one array beyond the live state instead of a second copy of this process's part of it;
        ``states`` then holds the decoded states. A failure (out of memory, the local copy
        unreadable) is reported on every process as a partial restore. ``candidates``: the
        states of the objects that no load-state hook restored itself."""
        later = {name: state for name, state in candidates.items() if isinstance(state, ShardedLater)}
        if not later:
            return
        failure: Optional[BaseException] = None
        by_name = {entry.name: entry for entry in self.entries}
        for name, pending in later.items():
            entry = by_name[name]
            tree = entry.replaceable()
            handles = {} if tree is None else codec.encode(tree, lambda x: isinstance(x, Replaceable), entry.name)[1]
            sharded = dict(pending.sharded)
            try:
                for key in sorted(sharded):
                    value = sharded[key]
                    if not isinstance(value, DeferredArray):
                        continue
                    sharded[key] = value = value.make()
                    if key in handles:  # else the object takes it with the rest of its state
                        handles[key].adopt(value)
                        sharded[key] = handles[key].current()
                    del value
            except (CheckpointError, OSError) as err:
                failure = CheckpointError(f"{directory}: a sharded file changed or could not be read while {name} was "
                                          f"read into place, after it was verified ({err}); the objects now hold part "
                                          "of this checkpoint: load it (or another) again before training."
                                          + see("changed-while-placed"))
                break
            except Exception as err:  # noqa: BLE001 - a replacement failed (out of memory...): every process hears it
                failure = CheckpointError(f"{directory}: restoring the sharded arrays of {name} failed after they were "
                                          f"verified ({type(err).__name__}: {err}); the objects now hold part of this "
                                          "checkpoint: free memory, then load it (or another) again before training."
                                          + see("placing-failed"))
                break
            states[name] = self._decode(entry, manifest["structures"][name], pending.arrays, sharded)
        changed = self._changed(self._read_after_check or {}) if failure is None else []
        if changed:
            failure = CheckpointError(f"{changed[0]}: changed while the sharded reader read it into place, after it "
                                      "was verified; the objects now hold part of this checkpoint: load it (or "
                                      "another) again before training." + see("changed-while-placed"))
        self._raise_shared(directory, failure, "load_state (sharded arrays placed)")

    def _check_read_hashes(self, directory: str, manifest: Dict[str, Any], hashes: Dict[str, Any],
                           identities: Dict[str, Tuple[int, ...]], read_error: Optional[BaseException] = None) -> None:
        """After a reader that hashed the files it read whole (``hashes``, this process's), before
        anything is restored: those must match the manifest, and every other listed file is
        hashed now by one process (`share_of`) and must not have changed since `_read` saw it
        (``identities``), so that what the reader took from it is what was checked. Collective:
        ``read_error``, this process's failed read, reaches every process here (and is raised
        here as it is)."""
        prefix = self.sharded_dir + "/"
        listed = {name: info for name, info in manifest["files"].items() if name.startswith(prefix)}
        failure: Optional[str] = None if read_error is None else failure_reason(read_error)
        damage = read_error is None or is_damage(read_error)  # (a mismatch found below is damage)
        for name, got in sorted(hashes.items()):  # none after a failed read
            path, info = check_file_name(directory, prefix + name), listed.get(prefix + name)
            if info is None:
                failure = f"{path}: read by the sharded reader but not listed in the manifest"
            elif got["size"] != info["size"]:
                failure = str(safetensors_io.size_mismatch(path, got["size"], info["size"]))
            elif got["xxh3"] != info["xxh3"]:
                failure = str(safetensors_io.checksum_mismatch(path))
            if failure:
                break
        gathered = self.collectives.all_gather_json({"hashed": sorted(hashes), "error": failure, "damage": damage},
                                                    operation="load_state (sharded files checked)")
        self._raise_gathered(directory, read_error,
                             [(rank, g["error"], g["damage"]) for rank, g in enumerate(gathered) if g["error"]])
        done = {prefix + name for g in gathered for name in g["hashed"]}
        rest = {name: int(info["size"]) for name, info in listed.items() if name not in done}
        if not rest:  # the same on every process: it comes from the gathered lists
            return
        error: Optional[BaseException] = None
        try:
            location = location_of(directory)
            for name in share_of(rest, self.backend.process_index, self.backend.num_processes):
                path = check_file_name(directory, name)
                location.verify(path, listed[name]["size"], listed[name]["xxh3"])
                self._refuse_changed({path: identities[path]})
        except (CheckpointError, OSError) as err:
            error = err
        self._share_verified(directory, error, "load_state (sharded files checked)")

    def _decode(self, entry: Entry, structure: Any, arrays: Dict[str, Any],
                restored: Optional[Dict[str, Any]] = None) -> Any:
        """An entry's state from its arrays: NumPy views for managed objects, framework arrays
        over the same private memory otherwise (each array's memory is its own: `codec.decode`
        refuses a structure naming one array twice); ``restored`` arrays (sharded, already placed
        by the backend) are used as they are."""
        restored = restored or {}
        if entry.managed:
            return codec.decode(structure, {**arrays, **restored}, lambda a: a, ready=restored.keys())
        # a user object's arrays are made like the ones it holds now (device, a torch DTensor's
        # mesh), where those have the saved dtype and shape
        live = codec.encode(entry.get_state(), self.backend.is_array, entry.name)[1]
        return codec.decode(structure, {**arrays, **restored}, self.backend.from_numpy, ready=restored.keys(),
                            named=lambda value, name: self.backend.from_numpy(
                                value, like=_like(self.backend, live.get(name), value)))

    @staticmethod
    def _listed(directory: str, manifest: Dict[str, Any], name: str) -> Tuple[str, Dict[str, Any]]:
        """The path of file ``name`` of the checkpoint and its manifest entry (size, xxh3)."""
        info = manifest["files"].get(name)
        if info is None:
            raise CheckpointError(f"{os.path.join(directory, 'manifest.json')}: lists no file {name!r}; the "
                                  "checkpoint does not match this run." + see("lists-no-file"))
        return check_file_name(directory, name), info

    def _read_file(self, directory: str, manifest: Dict[str, Any], name: str) -> Dict[str, np.ndarray]:
        path, info = self._listed(directory, manifest, name)
        return location_of(directory).read(path, info["size"], info["xxh3"])

    def _places(self, entry: Entry, live: Dict[str, Any]) -> Dict[str, Place]:
        """Where a load puts the large arrays (at least `IN_PLACE_MIN_BYTES`) of an entry's
        ``live`` arrays: straight into their memory (`Backend.writable_host_bytes`), else
        replaced one at a time (`Entry.replaceable`); the others are read into fresh memory."""
        places, least = {}, in_place_min_bytes()
        tree = entry.replaceable()
        handles = {} if tree is None else codec.encode(tree, lambda x: isinstance(x, Replaceable), entry.name)[1]
        for name, value in live.items():
            if isinstance(value, np.ndarray) or int(getattr(value, "nbytes", 0)) < least:
                continue
            raw = self.backend.writable_host_bytes(value)
            if raw is not None:
                places[name] = Place(raw, lambda value=value: value)
            elif name in handles:  # (`codec.encode` collected only `Replaceable` leaves)
                handle = handles[name]
                places[name] = Place(safetensors_io.KeepsHost(handle.replace) if handle.keeps_host else handle.replace,
                                     handle.current, handle.writable_in_place)
        return places

    def _verify_for_placing(self, directory: str, manifest: Dict[str, Any], entry: Entry,
                            places: Dict[str, Place]) -> "InPlace":
        """The first of a load's two passes over a file read into place: every byte hashed in a
        bounded buffer and compared, and the header described, before any object is restored."""
        path, info = self._listed(directory, manifest, f"{entry.name}.safetensors")
        location = location_of(directory)
        copy = self._copy_for(path, int(info["size"]))
        identity = location.verify(path, info["size"], info["xxh3"], copy_to=copy)
        copy = copy if copy is not None and os.path.exists(copy) else None  # removed: the disk was full
        described = location.describe(path, info["size"])
        # only into arrays of the saved dtype and shape (a user object's own load_state_dict decides
        # about the others, from fresh memory, as before)
        places = {key: place for key, place in places.items()
                  if described.get(key) == tuple(self.backend.describe_array(place.current()))}
        return InPlace(path, int(info["size"]), str(info["xxh3"]), identity, described, places, copy)

    def _copy_for(self, path: str, size: int) -> Optional[str]:
        """Where the first pass over a store's file keeps a verified copy for the second: a new
        file in a private temporary folder (removed when the load returns), or ``None`` to
        download it again: a folder's file, ``UNIFIED_STORE_LOAD_COPY=0``, or a local disk
        without room for it (and 1 GiB or 5% left)."""
        if not is_url(path) or os.environ.get(LOAD_COPY_VARIABLE, "1") == "0":
            return None
        with self._copies_made:  # the first passes run side by side: one folder for all of them
            if self._load_copies is None:
                self._load_copies = tempfile.mkdtemp(prefix="unified-load-")
        disk = shutil.disk_usage(self._load_copies)
        if disk.free - size < max(1 << 30, disk.total // 20):  # leave 1 GiB and 5% free
            return None
        return os.path.join(self._load_copies, f"{uuid.uuid4().hex}.safetensors")

    def _read_in_place(self, directory: str, manifest: Dict[str, Any], candidates: Dict[str, Any],
                       states: Dict[str, Any]) -> None:
        """The second pass (collective), after every check passed on every process: each file
        verified by `_verify_for_placing` is read again, its large arrays straight into the live
        ones, hashed as it goes; ``states`` then holds the decoded states. A file that changed
        since it was verified is refused before anything is read into place; one that changes
        while it is read is reported on every process as partly restored. ``candidates``: the
        states of the objects that no load-state hook restored itself (the hooks, Accelerate's
        *pre* hooks, run before: they see the objects as they were)."""
        later = {name: state for name, state in candidates.items() if isinstance(state, InPlace)}
        if not later:
            return
        failure: Optional[BaseException] = None
        location = location_of(directory)
        changed = [p.path for p in later.values() if location.changed(p.path, p.identity)]
        if changed:
            failure = CheckpointError(f"{changed[0]}: changed after it was verified; nothing was restored. Check that "
                                      "nothing writes into the checkpoint." + see("file-ended"))
        self._raise_shared(directory, failure, "load_state (unchanged since verified)")
        by_name = {entry.name: entry for entry in self.entries}

        def read(placing: InPlace, into: Dict[str, Any]) -> Tuple[Dict[str, np.ndarray], List[str]]:
            if placing.copy is not None:  # the verified copy on the local disk (private: it cannot change)
                return Folder().read_placed(placing.copy, placing.size, placing.checksum, into)
            return location.read_placed(placing.path, placing.size, placing.checksum, into)

        # where each array goes is settled here, one object after another (a backend may hand arrays
        # over: `Replaceable.writable_in_place`); then the files are read (and hashed: one stream per
        # file) side by side, their results taken in the objects' order
        with concurrent.futures.ThreadPoolExecutor(min(len(later), _FILES_AT_ONCE),
                                                   thread_name_prefix="unified-place") as reading:
            reads = {}
            for name, placing in later.items():
                try:
                    into = {key: place.target() for key, place in placing.places.items()}
                except Exception as err:  # noqa: BLE001 - reported in its turn, as a failed read
                    reads[name] = concurrent.futures.Future()
                    reads[name].set_exception(err)
                    continue
                reads[name] = reading.submit(read, placing, into)
            self._place_in_order(directory, manifest, later, reads, by_name, states)

    def _place_in_order(self, directory: str, manifest: Dict[str, Any], later: Dict[str, "InPlace"],
                        reads: Dict[str, Any], by_name: Dict[str, Entry], states: Dict[str, Any]) -> None:
        """The second pass's results, file by file in the objects' order (`_read_in_place`)."""
        failure: Optional[BaseException] = None
        for name, placing in later.items():
            try:
                arrays, placed = reads[name].result()
            except (CheckpointError, OSError) as err:
                failure = CheckpointError(f"{placing.path}: changed while it was read into the live objects, after it "
                                          f"was verified ({err}); they now hold part of this checkpoint: load it (or "
                                          "another) again before training." + see("changed-while-placed"))
                break
            except Exception as err:  # noqa: BLE001 - a replacement failed (out of device memory...): every process hears it
                failure = CheckpointError(f"{placing.path}: restoring {name} failed after it was verified "
                                          f"({type(err).__name__}: {err}); the objects now hold part of this "
                                          "checkpoint: free memory, then load it (or another) again before training."
                                          + see("placing-failed"))
                break
            states[name] = self._decode(by_name[name], manifest["structures"][name], arrays,
                                        {key: placing.places[key].current() for key in placed})
        self._raise_shared(directory, failure, "load_state (read into place)")

    @staticmethod
    def _changed(verified: Dict[str, Any]) -> List[str]:
        """The files of ``verified`` (path -> identity when checked) that changed since."""
        return [path for path, identity in verified.items() if location_of(path).changed(path, identity)]

    @classmethod
    def _refuse_changed(cls, verified: Dict[str, Any]) -> None:
        changed = cls._changed(verified)
        if changed:  # something writes into the checkpoint: no damage to fall back from
            raise _not_damage(CheckpointError(f"{changed[0]}: changed after it was verified, while the sharded reader "
                                              "read it; nothing was restored. Check that nothing writes into the "
                                              "checkpoint." + see("file-ended")))

    def _read(self, directory: str) -> Tuple[Dict[str, Any], Dict[str, Any], Optional[Any], Dict[str, Tuple[int, ...]]]:
        manifest = location_of(directory).read_manifest(directory)
        where = os.path.join(directory, "manifest.json")
        if manifest.get("backend") != self.backend.name:
            raise CheckpointError(
                f"{where}: written by the {manifest.get('backend')!r} backend; this run uses {self.backend.name!r}. "
                "Load it with the backend that wrote it." + see("wrong-backend")
            )
        saved = manifest.get("objects", [])
        hook_saved = manifest.get("hook_objects", [])
        mine = [e.name for e in self.entries if e.name not in hook_saved]
        if saved != mine:
            raise CheckpointError(
                f"{where}: holds objects {saved}; this run prepared/registered {mine}. Prepare and register "
                "the same objects in the same order as the run that saved it." + see("objects-differ")
            )
        structures = manifest.get("structures")
        missing = [e.name for e in self.entries
                   if e.name not in hook_saved and (not isinstance(structures, dict) or e.name not in structures)]
        if missing:
            raise CheckpointError(f"{where}: has no structure for {', '.join(missing)}" + see("no-structure"))
        sharded = manifest.get("sharded") or {}
        if sharded and self._own_load:
            raise CheckpointError(f"{where}: holds arrays sharded across processes, which load from one folder that "
                                  "every process sees; the processes named folders of their own." + see("own-folders"))
        self._verify_hook_files(directory, manifest)
        states = self._read_objects(directory, manifest, hook_saved, sharded)
        sharded_files = self._verify_sharded_tree(directory, manifest) if sharded else {}
        rank, saved = self.backend.process_index, manifest.get("num_processes")
        if not isinstance(saved, int) or isinstance(saved, bool) or saved < 1:
            raise CheckpointError(f"{where}: num_processes is {saved!r}, not a process count." + see("no-rng-state"))
        folder_of = manifest.get("process_folder")
        if folder_of is not None and saved != self.backend.num_processes:
            raise CheckpointError(f"{where}: saved by {saved} processes into folders of their own; load it with "
                                  f"{saved} processes, each naming its own folder (this run has "
                                  f"{self.backend.num_processes})." + see("own-folders"))
        if folder_of is not None and folder_of != rank:
            raise CheckpointError(f"{where}: the folder of process {folder_of} of a checkpoint saved to folders of "
                                  f"their own; process {rank} must name its own folder." + see("own-folders"))
        # The same count: this process's own streams. Another: every saving process's (see resolve_rng).
        ranks = [rank] if saved == self.backend.num_processes else range(saved)
        streams = []
        for r in ranks:
            name = f"rng_{r}"
            if name not in structures:
                raise CheckpointError(f"{where}: has no RNG state for process {r}; refusing to resume without it."
                                      + see("no-rng-state"))
            state = codec.decode(structures[name], self._read_file(directory, manifest, f"{name}.safetensors"),
                                 lambda a: a)
            self._check_rng(state, os.path.join(directory, f"{name}.safetensors"))
            streams.append(state)
        if saved == self.backend.num_processes:
            rng = {**streams[0], "derived": {}, "differing": []}
        else:
            rng = resolve_rng(streams, rank)
        return manifest, states, rng, sharded_files

    def _read_objects(self, directory: str, manifest: Dict[str, Any], hook_saved: Collection[str],
                      sharded: Dict[str, str]) -> Dict[str, Any]:
        """Each object's file (those no save-state hook wrote), checked against the object: an
        `InPlace` for a file whose large arrays are read into the live ones later (verified now:
        the first pass), else its decoded state (with sharded arrays: its arrays, see
        `_with_sharded`). The first passes run on a thread of their own while this one reads
        the other files into fresh memory (a resumed optimizer's moments): on 2 cores they
        overlap. Failures are raised in the objects' order, as when they were read one by one."""
        structures = manifest["structures"]
        states: Dict[str, Any] = {}
        mine_now = [(entry, codec.encode(entry.get_state(), self.backend.is_array, entry.name)[1])
                    for entry in self.entries if entry.name not in hook_saved]
        places = {entry.name: ({} if sharded else self._places(entry, live)) for entry, live in mine_now}
        with concurrent.futures.ThreadPoolExecutor(_FILES_AT_ONCE, thread_name_prefix="unified-verify") as verifying:
            verified = {entry.name: verifying.submit(self._verify_for_placing, directory, manifest, entry,
                                                     places[entry.name])
                        for entry, _ in mine_now if places[entry.name]}
            read: Dict[str, Any] = {}
            failed: Optional[Tuple[str, Exception]] = None
            try:
                for entry, _ in mine_now:
                    if entry.name not in verified:
                        read[entry.name] = self._read_file(directory, manifest, f"{entry.name}.safetensors")
            except Exception as err:  # raised below in its turn: an earlier object's failure comes first
                failed = (entry.name, err)
            try:
                for entry, live in mine_now:
                    where = os.path.join(directory, f"{entry.name}.safetensors")
                    # read into the live arrays once everything is checked (`_read_in_place`)
                    if entry.name in verified:
                        later = verified[entry.name].result()
                        self._check_fits(entry, live, later.described, set(), where)
                        states[entry.name] = later
                        continue
                    if failed is not None and failed[0] == entry.name:
                        raise failed[1]
                    arrays = read[entry.name]
                    self._check_fits(entry, live, _described(arrays), set(sharded.values()), where)
                    states[entry.name] = arrays if sharded else self._decode(entry, structures[entry.name], arrays)
            finally:
                for future in verified.values():
                    future.cancel()
        return states

    def _verify_hook_files(self, directory: str, manifest: Dict[str, Any]) -> None:
        """The files save-state hooks wrote are checked (size and xxh3, each process a share)
        before the load-state hooks read them."""
        names = manifest.get("hook_files", [])
        listed = {name: manifest["files"].get(name) for name in names}
        missing = [name for name, info in listed.items() if info is None]
        if missing:
            raise CheckpointError(f"{os.path.join(directory, 'manifest.json')}: lists hook file {missing[0]!r} "
                                  "without its size and checksum." + see("manifest-files"))
        if is_url(directory):  # the hooks read with open(): every process downloads them all, verified
            if names:
                self._hook_copy = tempfile.mkdtemp(prefix="unified-load-hooks-")
                location = location_of(directory)
                for name in names:
                    local = check_file_name(self._hook_copy, name)
                    os.makedirs(os.path.dirname(local), exist_ok=True)
                    location.download(f"{directory.rstrip('/')}/{name}", local, listed[name]["size"],
                                      listed[name]["xxh3"])
            return
        # one folder: each process checks a share; folders of their own: each process all of its own
        share = sorted(listed) if self._own_load else share_of(
            {name: int(info["size"]) for name, info in listed.items()}, self.backend.process_index,
            self.backend.num_processes)
        for name in share:
            safetensors_io.verify_file(check_file_name(directory, name), listed[name]["size"], listed[name]["xxh3"])

    def _verify_sharded_prefix(self, directory: str, listed: Dict[str, Any]) -> Dict[str, Any]:
        """`_verify_sharded_tree` on a store: every object below the sharded prefix is listed in
        the manifest and has its size; returns each one's ETag (its reader hashes what it reads,
        `_check_read_hashes` the rest)."""
        where = os.path.join(directory, "manifest.json")
        if not getattr(self.sharding, "sharded_to_store", False):
            raise CheckpointError(f"{where}: holds arrays sharded across processes on an object store, which the "
                                  f"{self.backend.name!r} backend cannot read from a store."
                                  + see("object-storage-limits"))
        store = ObjectStore(directory)
        present = set(self._shard_files(directory))
        unlisted = sorted(present - set(listed))
        if not listed or unlisted:
            what = f"{unlisted[0]} is not listed in it" if unlisted else f"it lists no file of {self.sharded_dir}/"
            raise CheckpointError(f"{where}: names sharded arrays but {what}; refusing to let the sharded reader "
                                  "open it." + see("sharded-files-unlisted"))
        return {path: store.identity(path, int(info["size"]))
                for path, info in ((check_file_name(directory, name), info) for name, info in listed.items())}

    def _verify_sharded_tree(self, directory: str, manifest: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
        """The sharded arrays' reader (Orbax, DCP) opens whatever its folder holds: every entry there
        must be a plain file or folder (no link, FIFO or device) that the manifest lists and whose
        size and checksum match; a manifest naming sharded arrays must list their files. Each
        process reads and checks its share of the files (the load shares failures before anything
        is read); returns the identity of each file it checked (see `_with_sharded`)."""
        where = os.path.join(directory, "manifest.json")
        if self.sharding is None:
            raise CheckpointError(f"{where}: holds arrays sharded across processes, which the {self.backend.name!r} "
                                  "backend cannot read." + see("sharded-no-counterpart"))
        prefix = self.sharded_dir + "/"
        listed = {name: info for name, info in manifest["files"].items() if name.startswith(prefix)}
        root = os.path.join(directory, self.sharded_dir)
        if is_url(directory):
            return self._verify_sharded_prefix(directory, listed)
        if not listed or not os.path.isdir(root) or os.path.islink(root):
            raise CheckpointError(f"{where}: names sharded arrays but {self.sharded_dir}/ is missing or lists no file."
                                  + see("sharded-files-unlisted"))
        for folder, subfolders, names in os.walk(root):
            for name in subfolders + names:
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, directory).replace(os.sep, "/")
                mode = os.lstat(path).st_mode
                if stat.S_ISDIR(mode):
                    continue
                if not stat.S_ISREG(mode) or relative not in listed:
                    what = "not a regular file" if not stat.S_ISREG(mode) else "not listed in the manifest"
                    raise CheckpointError(f"{path}: {what}; refusing to let the sharded reader open it."
                                          + see("sharded-files-unlisted"))
        if self.sharding.hashes_while_reading:  # checked in `_with_sharded`, from the reader's own pass
            identities = {}
            for name, info in listed.items():
                path = check_file_name(directory, name)
                try:
                    st = os.lstat(path)
                except OSError as err:
                    raise safetensors_io.cannot_open(path, err) from err
                if st.st_size != info["size"]:
                    raise safetensors_io.size_mismatch(path, st.st_size, info["size"])
                identities[path] = safetensors_io.identity(st)
            return identities
        # The checkpoint folder is one shared file system (docs/multi-host.md): each process checks
        # an equal share of the files, and `load` shares every failure before any reader opens one.
        share = share_of({name: int(info["size"]) for name, info in listed.items()},
                         self.backend.process_index, self.backend.num_processes)
        return {path: safetensors_io.verify_for_reader(path, listed[name]["size"], listed[name]["xxh3"])
                for path, name in ((check_file_name(directory, name), name) for name in share)}

    def _check_fits(self, entry: Entry, live: Dict[str, Any], saved: Dict[str, Tuple[str, Tuple[int, ...]]],
                    sharded: Any, where: str) -> None:
        """Before anything is restored: every array of a prepared object (``live``: its arrays
        now) is in the file with the same dtype and shape (no silent cast, no optimizer moment of
        another shape), and a model's file holds no array the model lacks. User objects' own
        ``load_state_dict`` decides for them."""
        if not entry.managed:
            return
        prefix = len(entry.name) + 1
        saved_groups = {entry.absent_group(name[prefix:]) for name in saved}
        for name, value in live.items():
            if name in sharded:
                continue
            if name not in saved:
                group = entry.absent_group(name[prefix:])
                if group is not None and group not in saved_groups:
                    continue  # saved without this group (an optimizer before its first step)
                raise CheckpointError(f"{where}: has no tensor {name!r}, which this run's {entry.name} has; the "
                                      "checkpoint does not match this model." + see("tensor-mismatch"))
            if isinstance(value, np.ndarray):
                want = (safetensors_io.safetensors_dtype(value.dtype), tuple(value.shape))
            else:
                want = self.backend.describe_array(value)
            got = saved[name]
            if got != want:
                raise CheckpointError(
                    f"{where}: tensor {name!r} is {got[0]} {list(got[1])} in the checkpoint; this run's {entry.name} "
                    f"has {want[0]} {list(want[1])}. Nothing was restored: build the object as the saving run did."
                    + see("tensor-mismatch"))
        extra = sorted(set(saved) - set(live) - set(sharded)) if entry.strict else []
        if extra:
            raise CheckpointError(f"{where}: holds tensor(s) {', '.join(map(repr, extra[:5]))} that this run's "
                                  f"{entry.name} does not have; the checkpoint does not match this model."
                                  + see("tensor-mismatch"))

    def _check_rng(self, rng: Any, where: str) -> None:
        """Refuse, before anything is restored, RNG state that lacks a generator this run has:
        a resume that silently skipped one would diverge without a word."""
        framework = rng.get("framework") if isinstance(rng, dict) else None
        host = rng.get("host") if isinstance(rng, dict) else None
        missing = [] if isinstance(host, dict) and {"python", "numpy"} <= set(host) else ["Python/NumPy"]
        current = self.backend.rng_state()
        saved = set(framework if isinstance(framework, dict) else ())
        missing += sorted(set(current) - saved - set(self.backend.optional_rng_state))
        if missing:
            raise CheckpointError(f"{where}: has no state for the random generator(s) {', '.join(missing)} of this "
                                  "run; refusing to resume without it." + see("rng-restore"))
        for name, value in current.items():
            if name not in framework:  # an optional one (`Backend.optional_rng_state`)
                continue
            saved = framework[name]
            if not (isinstance(saved, np.ndarray) and saved.dtype == np.asarray(value).dtype
                    and saved.shape == np.shape(value)):
                raise CheckpointError(f"{where}: the state of generator {name!r} does not fit this run's "
                                      "(another dtype or size)." + see("rng-restore"))
        scratch_random, scratch_numpy = random.getstate(), np.random.get_state()
        try:  # the host generators refuse a malformed state here, before anything is restored
            restore_host_rng(host)
        except (TypeError, ValueError, KeyError, OverflowError) as err:
            raise CheckpointError(f"{where}: malformed Python/NumPy generator state ({err})."
                                  + see("rng-restore")) from err
        finally:
            random.setstate(scratch_random)
            np.random.set_state(scratch_numpy)

    def _restore_rng(self, rng: Dict[str, Any], manifest: Dict[str, Any]) -> None:
        """Restore this process's streams as `resolve_rng` chose them; a derived stream is the
        generator seeded with its derived seed (framework generators through `Backend.seed`)."""
        derived: Dict[str, int] = rng["derived"]
        framework = dict(rng["framework"])
        for name in sorted(set(derived) - {"python", "numpy"}):
            self.backend.seed(derived[name])
            framework[name] = np.array(self.backend.rng_state()[name], copy=True)
        restore_host_rng(rng["host"])
        if "python" in derived:
            random.seed(derived["python"])
        if "numpy" in derived:
            np.random.seed(derived["numpy"])
        self.backend.set_rng_state(framework)
        saved, count = manifest.get("num_processes"), self.backend.num_processes
        if count > saved and self.backend.process_index == 0 and rng["differing"]:
            warnings.warn(
                f"Checkpoint saved by {saved} processes, loaded by {count}: processes {saved} to {count - 1} had no "
                f"saved state for the random generator(s) {', '.join(rng['differing'])}, which differed between the "
                "saving processes; theirs were derived from the checkpoint (processes below "
                f"{saved} continue their own streams)." + see("rng-rederived"),
                stacklevel=3,
            )
