"""The checkpoint pipeline's types: what is saved (`Entry`), what one process writes (`Snapshot`),
where a load puts large arrays (`Place`, `InPlace`, `ShardedLater`), and the declared interfaces
the stages work through: a `Location` (a folder or an object store, see `store`), a `Reader`
of verified files and a `Placer` that takes over an array once its bytes are read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Mapping,
    Optional,
    Protocol,
    Tuple,
    Union,
    runtime_checkable,
)

import numpy as np

from ..backend import Replaceable
from ..runtime.environment import IN_PLACE_VARIABLE
from ..runtime.watchdog import CHANNEL_KINDS
from . import codec, safetensors_io

Arrays = Dict[str, np.ndarray]
Described = Dict[str, Tuple[str, Tuple[int, ...]]]  # array name -> (safetensors dtype, shape)


@runtime_checkable
class Placer(Protocol):
    """Takes over one array a verified read has just filled (``into`` of `Reader.read_placed`,
    besides a writable uint8 view of the live array's bytes): it must copy what it keeps before
    it returns, unless it is a `safetensors_io.KeepsHost` (a JAX array replaced one at a time:
    `Replaceable.replace`, keeping the memory) or a `safetensors_io.Overlapped` (its copy only
    started, and waited for before the memory is written again: `Replaceable.replace_async`)."""

    def __call__(self, array: np.ndarray) -> None: ...


@runtime_checkable
class Reader(Protocol):
    """Reads a checkpoint's files back verified (size and xxh3 against the manifest's), and says
    whether one changed since it was verified: what a load needs of a `Location`."""

    def read(self, path: str, size: int, checksum: str) -> Arrays:
        """Every array of the file, each in private memory of its own."""

    def read_placed(self, path: str, size: int, checksum: str,
                    into: Mapping[str, Union[np.ndarray, Placer]]) -> Tuple[Arrays, List[str]]:
        """`read`, with the arrays named in ``into`` put there; returns the others and the names placed."""

    def verify(self, path: str, size: int, checksum: str, copy_to: Optional[str] = None) -> Any:
        """Hash the file in bounded memory (keeping a verified copy at ``copy_to``); returns its identity."""

    def describe(self, path: str, size: int) -> Described:
        """Each array's dtype and shape, from the header alone."""

    def changed(self, path: str, identity: Any) -> bool:
        """Whether the file may have changed since `verify` returned ``identity``."""


@runtime_checkable
class Location(Reader, Protocol):
    """Where checkpoints live (`store.Folder`, `store.ObjectStore`; `store.location_of` picks one):
    the manager's steps are the same everywhere, a location is the part that differs: listing
    the numbered checkpoints, staging and committing a save, reports between processes."""

    atomic_replace: bool  # a commit replaces a checkpoint of the same name atomically (a folder's rename)
    report_poll_seconds: float  # how often the main process looks for an async save's part markers

    def numbered(self, folder: str) -> List[Tuple[int, str]]:
        """The committed ``checkpoint_N`` of ``folder``, oldest first."""

    def highest_number(self, folder: str) -> Optional[int]: ...

    def taken(self, folder: str, number: int) -> bool: ...

    def damaged(self, folder: str) -> List[Tuple[int, str]]:
        """The checkpoints a load set aside as damaged."""

    def set_aside_damaged(self, checkpoint: str) -> str: ...

    def refusal(self, target: str) -> Optional[str]:
        """Why a save may not write at ``target``, or None."""

    def staging(self, final: str, token: str) -> str:
        """Where this save's files go before the commit."""

    def prepare(self, staging: str) -> None: ...

    def write(self, path: str, arrays: Mapping[str, Any], live: bool,
              metadata: Mapping[str, str] = ()) -> Dict[str, object]:
        """Write one safetensors file, hashed as it is written; returns ``{"size", "xxh3"}``."""

    def commit(self, staging: str, final: str, token: str, body: Dict[str, Any]) -> None:
        """Write the manifest last and make the checkpoint ``final`` (atomically)."""

    def discard(self, staging: str) -> None: ...

    def after_commit(self, final: str, automatic: bool, total_limit: Optional[int], leased: bool = True) -> None:
        """Retention: older checkpoints beyond ``total_limit`` and what crashed saves left."""

    def has_manifest(self, directory: str) -> bool: ...

    def read_manifest(self, directory: str) -> Dict[str, Any]: ...

    def post_report(self, path: str, report: Dict[str, Any]) -> None: ...

    def take_report(self, path: str) -> Optional[Dict[str, Any]]: ...


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

    def replaceable_handles(self) -> Dict[str, Replaceable]:
        """The `Replaceable` handle of each array a load may replace one at a time, by the
        array's name in the checkpoint (as `codec.encode` names it); empty when there is none.

        Example:
            >>> entry.replaceable_handles()["model/layers/0/kernel"].current()
        """
        tree = self.replaceable()
        return {} if tree is None else codec.encode(tree, lambda x: isinstance(x, Replaceable), self.name)[1]


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
    """Where a load's placing pass puts one large array of a live object (`CheckpointManager._places`):
    ``into`` is the array's own writable bytes (torch: read in place) or a callable that replaces
    the object's array by a new one made from the bytes (`Replaceable.replace`: JAX); ``current()``
    is the array the object holds (after the load: the restored one)."""

    into: Union[np.ndarray, Placer]
    current: Callable[[], Any]
    # a replaced array's own memory when it may be written in place after all (`Replaceable.writable_in_place`)
    own: Callable[[], Any] = lambda: None

    def target(self) -> Any:
        """``into``, or the array's own writable memory when `own` gives it (asked once, in the placing pass)."""
        owned = self.own()
        return self.into if owned is None else owned


@dataclass
class InPlace:
    """A file of a load whose large arrays are read into the live ones once every check passed
    (`CheckpointManager._read_in_place`), hashed as they are placed: where it is and what its
    header holds. ``verified``: it was also hashed whole before (``load_state(verify_first=True)``);
    ``identity`` and ``copy`` are then what that first pass saw."""

    path: str
    size: int
    checksum: str
    identity: Any  # for `Location.changed` before the pass that places (None: not verified first)
    described: Dict[str, Tuple[str, Tuple[int, ...]]]
    places: Dict[str, Place]  # array name -> where the pass that places puts it
    copy: Optional[str] = None  # verified first, a store's file: its verified local copy, which is read again
    verified: bool = False

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
