"""Loading one checkpoint (collective): the manifest verified, the small files read and verified,
each object's state checked against this run (`_check_fits`, `Entry.check`; a large file's from
its header) before any object is touched, then the load-state hooks, the large arrays read into
place and hashed as they go (`placement`, `sharded`), the objects and RNG restored (`rng_state`).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

import numpy as np
import xxhash

from ..backend import Backend
from ..config import is_url
from ..errors import CheckpointError, see
from . import codec, layout, safetensors_io
from .agreement import Agreement
from .manifest import check_file_name
from .save import share_of
from .store import ObjectStore, location_of
from .types import _FILES_AT_ONCE, Entry, InPlace, ShardedLater


def _described(arrays: Dict[str, np.ndarray]) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    return {name: (safetensors_io.safetensors_dtype(a.dtype), tuple(a.shape)) for name, a in arrays.items()}


def _like(backend: Backend, live: Any, saved: np.ndarray) -> Any:
    """``live`` when it is a framework array of the ``saved`` array's dtype and shape, else None."""
    if live is None or isinstance(live, np.ndarray) or not backend.is_array(live):
        return None
    try:
        same = backend.describe_array(live) == (safetensors_io.safetensors_dtype(saved.dtype), tuple(saved.shape))
    except (TypeError, ValueError):
        return None
    return live if same else None


class Loading(Agreement):
    """Verifying and restoring one checkpoint (mixed into `CheckpointManager`)."""

    def load_one(self, directory: str, before_restore: Callable[[str], Collection[str]] = lambda folder: (),
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
            self._placed_hashes = None

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
        return manifest, states, self._read_rng(directory, manifest, saved), sharded_files

    def _read_objects(self, directory: str, manifest: Dict[str, Any], hook_saved: Collection[str],
                      sharded: Dict[str, str]) -> Dict[str, Any]:
        """Each object's file (those no save-state hook wrote), checked against the object: an
        `InPlace` for a file whose large arrays are read into the live ones later (its header
        now, `_plan_placing`), else its decoded state (with sharded arrays: its arrays, see
        `_with_sharded`). The headers are read on a thread of their own while this one reads
        the other files into fresh memory (a resumed optimizer's moments): on 2 cores they
        overlap. Failures are raised in the objects' order, as when they were read one by one."""
        structures = manifest["structures"]
        states: Dict[str, Any] = {}
        mine_now = [(entry, codec.encode(entry.get_state(), self.backend.is_array, entry.name)[1])
                    for entry in self.entries if entry.name not in hook_saved]
        places = {entry.name: ({} if sharded else self._places(entry, live)) for entry, live in mine_now}
        with concurrent.futures.ThreadPoolExecutor(_FILES_AT_ONCE, thread_name_prefix="unified-plan") as verifying:
            verified = {entry.name: verifying.submit(self._plan_placing, directory, manifest, entry,
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
                        try:
                            self._check_fits(entry, live, later.described, set(), where)
                        except CheckpointError as refusal:  # what a damaged header says?
                            error = refusal if later.verified else self._damage_behind(
                                later.path, later.size, later.checksum, refusal)
                            raise error from None
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
                store = ObjectStore(directory)
                for name in names:
                    local = check_file_name(self._hook_copy, name)
                    os.makedirs(os.path.dirname(local), exist_ok=True)
                    store.download(f"{directory.rstrip('/')}/{name}", local, listed[name]["size"],
                                      listed[name]["xxh3"])
            return
        # one folder: each process checks a share; folders of their own: each process all of its own
        share = sorted(listed) if self._own_load else share_of(
            {name: int(info["size"]) for name, info in listed.items()}, self.backend.process_index,
            self.backend.num_processes)
        for name in share:
            safetensors_io.verify_file(check_file_name(directory, name), listed[name]["size"], listed[name]["xxh3"])

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
