"""Which checkpoint a load reads (collective): the folder named or the newest ``checkpoint_N`` of
automatic naming, whether there is one (``if_exists``), a checkpoint an interrupted save set
aside put back, and the fall-back of an automatic load: a damaged checkpoint is set aside and
the next newest tried.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

from ..config import checkpoint_location
from ..errors import CheckpointError, see
from . import layout
from .agreement import Agreement
from .failures import _LINK, DamagedCheckpoint, _reasons
from .store import location_of


class LoadTarget(Agreement):
    """Finding the checkpoint to load, and falling back (mixed into `CheckpointManager`)."""

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
            self.load_one(directory, before_restore)
            return directory
        skipped: List[Tuple[str, str, str]] = []  # (checkpoint, why, where it was set aside)

        while True:
            newest = self._newest(target, {path for path, _, _ in skipped})
            if newest is None:
                error = self._nothing_verifies(target, skipped, if_exists)  # links to troubleshooting itself
                raise error
            try:
                self.load_one(newest, before_restore, fall_back=True)
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
