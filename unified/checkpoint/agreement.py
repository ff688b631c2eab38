"""What every stage of the manager shares: its state (`Agreement`'s attributes, set by
`CheckpointManager.__init__`) and the ways the processes agree: a look at the folder or store
taken by the main process or by each, an action on the main process only, and failures shared
so that every process raises at once instead of waiting out the others.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from ..backend import Backend, ShardedArrays
from ..config import is_url
from ..errors import CheckpointError, failure_reason, see
from .failures import _LINK, DamagedCheckpoint, _raise_failed, _reasons, is_damage
from .types import Entry

if TYPE_CHECKING:
    from ..config import ProjectConfiguration
    from ..runtime.collectives import Collectives


class Agreement:
    """The manager's shared state and its collective decisions (mixed into `CheckpointManager`)."""

    backend: Backend
    collectives: "Collectives"
    config: "ProjectConfiguration"
    entries: List[Entry]
    sharding: Optional[ShardedArrays]
    sharded_dir: Optional[str]
    _own_save: bool
    _own_load: bool
    _falling_back: bool
    _verify_first: bool
    _placed_hashes: Optional[Tuple[Tuple[str, ...], Callable[[], Dict[str, Any]]]]
    _adopting: FrozenSet[str]

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
