"""The checkpoint manager: one per Accelerator, with two verbs, `CheckpointManager.save` and
`CheckpointManager.load` (both collective).

save: every process writes its part into a temporary directory (the main process the
replicated objects, each process its RNG state), reports its files' sizes and checksums; the
main process writes the manifest last and renames the directory into place; then everyone
returns. load: the manifest verified and every object checked against its file's header before
any is touched, then every byte read once, hashed as it is placed (`placement`).

The stages live in modules of their own, each a part of the manager (mixed in here):
`folders` (where a save writes, the lock and lease), `save` (snapshot, each process's files),
`commit` (manifest last, rename, retention), `sharded` (arrays split across processes),
`load_target` (which checkpoint a load reads, falling back from a damaged one), `load`
(verification, checks, restore), `placement` (large arrays read straight into the live ones),
`rng_state`; `types` declares what they pass around, `agreement` how the processes agree.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, FrozenSet, List, Optional, Tuple

from ..backend import Backend, ShardedArrays
from . import lease
from .asynchronous import AsyncSave
from .commit import Committing
from .folders import SaveFolders
from .load import Loading
from .load_target import LoadTarget
from .placement import Placement
from .rng_state import RngState
from .save import Saving
from .sharded import ShardedState
from .types import Entry, in_place_min_bytes

if TYPE_CHECKING:
    from ..config import ProjectConfiguration
    from ..runtime.collectives import Collectives

# `Entry` is what `add` takes; `in_place_min_bytes` is read by the JAX backend (backends/jax/core.py).
__all__ = ["CheckpointManager", "Entry", "in_place_min_bytes"]

# `guard_writes(wait_detached)` holds back in-place updates of the saved state until an async
# save no longer reads live memory; returns what releases the guard (see `WriteGuards`).
GuardWrites = Callable[[Callable[[], None]], Callable[[], None]]


class CheckpointManager(SaveFolders, Saving, Committing, ShardedState, LoadTarget, Loading, Placement, RngState):
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
        # a load that falls back to an older checkpoint when this one is damaged (`load_one`, `load_newest`)
        self._falling_back = False
        # this load verifies every file before it restores anything (`load`'s ``verify_first``)
        self._verify_first = False
        # a sharded load in one pass: the files hashed as their arrays are placed, and their
        # hashes once placed (`ShardedRead.hashed_later`, `later_hashes`)
        self._placed_hashes: Optional[Tuple[Tuple[str, ...], Callable[[], Dict[str, Any]]]] = None
        # while `_place_sharded` makes the arrays: the objects whose arrays a reader may hand over
        # early (`ShardedLoad.adopt_early`)
        self._adopting: FrozenSet[str] = frozenset()
        # main process: the experiment trackers' runs, written into every manifest (see TrackerSet)
        self.tracker_identities: Callable[[], Dict[str, Dict[str, str]]] = dict
        # this save's and this load's processes name folders of their own (`_own_folders`)
        self._own_save = False
        self._own_load = False
        # an async save to folders of their own: the checkpoint whose retention waits for every
        # process's commit (`finish_background_save`)
        self._own_pending: Optional[str] = None

    def add(self, entry: Entry) -> None:
        """Save and restore ``entry`` with every checkpoint, after the ones added before."""
        self.entries.append(entry)

    def save(self, output_dir: Optional[str], *, async_save: bool = False,
             run_hooks: Optional[Callable[[str], List[str]]] = None,
             guard_writes: Optional[GuardWrites] = None) -> Tuple[str, Optional[AsyncSave]]:
        """Save everything registered into ``output_dir`` (or the next automatically named
        checkpoint), atomically (collective). Returns the checkpoint directory and, for
        ``async_save``, the background save still writing it (None otherwise).

        ``run_hooks(folder)``: the save-state hooks, run first, writing into the checkpoint; they
        return the names of the objects they saved themselves. ``guard_writes``: see `GuardWrites`
        (an async save then takes no copy of the framework arrays).

        Example:
            >>> final, pending = manager.save("ckpt/last")
        """
        final = self.resolve_save_dir(output_dir)
        iteration = self.config.iteration
        if self.config.automatic_checkpoint_naming:
            self.config.iteration += 1
        begun: Optional[Tuple[str, str]] = None
        skip: Collection[str] = ()
        hooks: Tuple[Dict[str, Any], Optional[str]] = ({}, None)
        if run_hooks is not None:  # they write into the checkpoint before its files are written
            begun = self.begin(final)
            skip, *rest = self.run_save_hooks(begun[1], run_hooks)
            hooks = (rest[0], rest[1])
        if not async_save:
            snapshot = self.safe_snapshot(iteration, skip=skip)
            snapshot.hook_files, snapshot.hook_error = hooks
            return self.save_snapshot(final, snapshot, begun), None
        snapshot = self.safe_snapshot(iteration, detach=True, skip=skip)
        snapshot.hook_files, snapshot.hook_error = hooks
        self.refuse_sharded_on_store(final, snapshot)
        token, tmp = begun if begun is not None else self.begin(final)
        # Arrays sharded across processes: their collective part (the plan, host copies of each
        # process's own shards) runs here; only their writes go to the background.
        sharded = self.begin_sharded(tmp, snapshot)
        detached = threading.Event()  # set once the background no longer reads live memory
        pending = AsyncSave(lambda: self.save_in_background(final, token, tmp, snapshot, sharded, detached.set),
                            detached=detached)
        if guard_writes is not None:
            pending.release = guard_writes(pending.wait_detached)
        return final, pending

    def load(self, input_dir: Optional[str], before_restore: Callable[[str], Collection[str]] = lambda folder: (),
             *, if_exists: bool = False, verify_first: bool = False) -> Optional[str]:
        """Verify and restore the checkpoint ``input_dir`` names, or the newest one that verifies
        with automatic naming (collective; see `load_newest`). Returns the checkpoint loaded, or,
        ``if_exists`` and there is none yet, None with nothing changed.

        Every byte is read once and hashed as it is placed; ``verify_first``: every file is
        verified whole before any object is restored (a second read of the large files), so
        that a failed load changes nothing.

        ``before_restore(folder)``: the load-state hooks, once every check passed, before any
        object is restored; they return the names of the objects they restored themselves.

        Example:
            >>> manager.load(None, state_hooks.run_load, if_exists=True)
            'runs/exp1/checkpoints/checkpoint_4'
        """
        if if_exists and not self.has_checkpoint(input_dir):
            return None
        self._verify_first = verify_first
        try:
            return self.load_newest(input_dir, before_restore, if_exists=if_exists)
        finally:
            self._verify_first = False
