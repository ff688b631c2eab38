"""A save's last stage: the manifest written last, every file made durable, the folder renamed
into place (`Location.commit`), then retention; in folders of their own each process commits
its own folder and retention waits until every process committed.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from ..config import is_url
from ..errors import CheckpointError, see
from .agreement import Agreement
from .failures import _LINK, _commit_error, _raise_reported, _retention_error
from .manifest import check_file_name
from .save import _hash_files, _tree
from .store import location_of
from .types import Snapshot


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


class Committing(Agreement):
    """Committing a written save (mixed into `CheckpointManager`)."""

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
