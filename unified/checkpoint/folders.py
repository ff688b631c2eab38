"""Where a save writes (collective): the folder or store it resolves (automatic naming picks
the next free number), whether the processes named folders of their own, and what this run
holds while it saves there (the folder's lock, the store prefix's lease).
"""
from __future__ import annotations

import os
from typing import Optional

from ..config import checkpoint_location, is_url
from ..errors import CheckpointError, see
from . import layout, lease, lock
from .agreement import Agreement
from .store import ObjectStore, location_of


class SaveFolders(Agreement):
    """Resolving and holding the save folder (mixed into `CheckpointManager`)."""

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

    def release_folder(self) -> None:
        """Unlock the folder this run held (`end_training`)."""
        if self._lock_key is not None:
            lock.release(self._lock_key)
        if self._lease is not None:
            self._lease.release()
        self._lock_key, self._lease, self._held_folder = None, None, None
