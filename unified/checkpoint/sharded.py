"""Arrays sharded across processes (``sharded.<format>/``, written and read by the backend's
`ShardedArrays`: DCP, Orbax): the save's collective half and the shard files' checksums, and at
load the folder checked before the backend's reader opens it, the arrays read (hashed, or
deferred and made one at a time once every check passed) and placed.
"""
from __future__ import annotations

import os
import stat
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..backend import DeferredArray, Replaceable, ShardedLoad, ShardedWrite
from ..config import is_url
from ..errors import CheckpointError, failure_reason, see
from . import codec, safetensors_io
from .agreement import Agreement
from .failures import _not_damage, damaged_while_placed, is_damage
from .manifest import check_file_name
from .save import _hash_files, _tree, share_of
from .store import ObjectStore, StoreError, location_of
from .types import Entry, ShardedLater, Snapshot, in_place_min_bytes


class ShardedState(Agreement):
    """Saving and loading arrays sharded across processes (mixed into `CheckpointManager`)."""

    def _is_sharded(self, value: Any) -> bool:
        return self.sharding is not None and self.sharding.is_sharded(value)

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
        # an object that may hold fewer arrays than its checkpoint (an optimizer before its first
        # step, as `_check_fits` allows for a file's arrays) gets the others read whole (`like`: None)
        lacking = {entry.name for entry in self.entries
                   if not entry.strict and getattr(self.sharding, "reads_without_counterpart", False)}
        for n in names.values():
            if n not in current and n.split("/", 1)[0] in lacking:
                current[n], owner[n] = None, n.split("/", 1)[0]
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
            read = self.sharding.load_sharded(root, like, ShardedLoad(
                hash_files=hashing, defer=bounded, copy_to=self._copy_for if bounded and is_url(directory) else None,
                hash_when_placed=not self._verify_first, adopt_early=self._adopt_early(names, owner)))
            restored, hashes = read.arrays, read.hashes  # (the hashes count only when `hashing`)
            if hashing and read.hashed_later:  # one pass: compared once the arrays are placed
                self._placed_hashes = (read.hashed_later, read.later_hashes)
            if read.deferred and not hashing:
                self._read_after_check = verified  # the reader reads them later: checked again then
            del read, like, current, encoded  # a live array replaced later is freed then (`_place_sharded`)
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
            later = self._placed_hashes[0] if self._placed_hashes is not None else ()
            self._check_read_hashes(directory, manifest, hashes, verified, read_error, later)
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

    def _adopt_early(self, names: Dict[str, str], owner: Dict[str, str]) -> Callable[[str, Any], None]:
        """`ShardedLoad.adopt_early`: the reader's array ``key`` put in place of its object's live
        one at once, while `_place_sharded` makes the arrays of the objects this load restores
        (``names``: the reader's keys to the arrays' names; ``owner``: each name's object)."""
        by_name = {entry.name: entry for entry in self.entries}
        handles: Dict[str, Dict[str, Replaceable]] = {}

        def adopt(key: str, array: Any) -> None:
            name = names[key]
            entry = owner[name]
            if entry not in self._adopting:  # restored by a load-state hook: the object takes it with its state
                return
            if entry not in handles:
                handles[entry] = by_name[entry].replaceable_handles()
            handle = handles[entry].get(name)
            if handle is not None and handle.current() is not array:
                handle.adopt(array)

        return adopt

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
        if not manifest.get("sharded"):
            return
        # Every process of a sharded load goes on to the exchange below, also one with nothing
        # deferred: whether a process's reader deferred depends on its own shards (whether it needs
        # each file whole, their sizes), so it differs between processes (under a mesh, for example).
        by_name = {entry.name: entry for entry in self.entries}
        self._adopting = frozenset(later)
        try:
            failure = self._make_deferred(directory, manifest, later, by_name, states)
        finally:
            self._adopting = frozenset()
        changed = self._changed(self._read_after_check or {}) if failure is None else []
        if changed:
            failure = CheckpointError(f"{changed[0]}: changed while the sharded reader read it into place, after it "
                                      "was verified; the objects now hold part of this checkpoint: load it (or "
                                      "another) again before training." + see("changed-while-placed"))
        if failure is None and self._placed_hashes is not None:
            failure = self._check_placed_hashes(directory, manifest)
        self._share_verified(directory, failure, "load_state (sharded arrays placed)")

    def _make_deferred(self, directory: str, manifest: Dict[str, Any], later: Dict[str, ShardedLater],
                       by_name: Dict[str, Entry], states: Dict[str, Any]) -> Optional[BaseException]:
        """`_place_sharded`'s making of each deferred array, object by object, each put in place
        at once (`Replaceable.adopt`; a reader may have handed it over earlier, `_adopt_early`);
        ``states`` gets each object's decoded state. The first failure, or None."""
        for name, pending in later.items():
            entry = by_name[name]
            handles = entry.replaceable_handles()
            sharded = dict(pending.sharded)
            try:
                for key in sorted(sharded):
                    value = sharded[key]
                    if not isinstance(value, DeferredArray):
                        continue
                    sharded[key] = value = value.make()
                    if key in handles:  # else the object takes it with the rest of its state
                        if handles[key].current() is not value:  # (not handed over early)
                            handles[key].adopt(value)
                        sharded[key] = handles[key].current()
                    del value
            except (CheckpointError, OSError) as err:
                if self._placed_hashes is not None:  # one pass: found as it was placed
                    return damaged_while_placed(err, f"the sharded arrays of {name}")
                return CheckpointError(f"{directory}: a sharded file changed or could not be read while {name} was "
                                       f"read into place, after it was verified ({err}); the objects now hold part "
                                       "of this checkpoint: load it (or another) again before training."
                                       + see("changed-while-placed"))
            except Exception as err:  # noqa: BLE001 - a replacement failed (out of memory...): every process hears it
                return CheckpointError(f"{directory}: restoring the sharded arrays of {name} failed after they were "
                                       f"verified ({type(err).__name__}: {err}); the objects now hold part of this "
                                       "checkpoint: free memory, then load it (or another) again before training."
                                       + see("placing-failed"))
            states[name] = self._decode(entry, manifest["structures"][name], pending.arrays, sharded)
        return None

    def _check_placed_hashes(self, directory: str, manifest: Dict[str, Any]) -> Optional[CheckpointError]:
        """One pass (`ShardedLoad.hash_when_placed`): the files the reader hashed as it placed
        their arrays, against the manifest; one that no array was made from (its objects
        restored by a load-state hook) is hashed now. The first mismatch, as damage found while
        placing, or None."""
        assert self._placed_hashes is not None
        names, later_hashes = self._placed_hashes
        got, prefix = later_hashes(), self.sharded_dir + "/"
        location = location_of(directory)
        for name in names:
            path, info = check_file_name(directory, prefix + name), manifest["files"].get(prefix + name)
            try:
                if info is not None and name not in got:
                    location.verify(path, info["size"], info["xxh3"])
                    continue
                refusal = _hash_refusal(path, info, got.get(name, {}))
            except CheckpointError as err:
                refusal = err
            if refusal is not None:
                return damaged_while_placed(refusal, "the sharded arrays")
        return None

    def _check_read_hashes(self, directory: str, manifest: Dict[str, Any], hashes: Dict[str, Any],
                           identities: Dict[str, Tuple[int, ...]], read_error: Optional[BaseException] = None,
                           later: Tuple[str, ...] = ()) -> None:
        """After a reader that hashed the files it read whole (``hashes``, this process's), before
        anything is restored: those must match the manifest, and every other listed file is
        hashed now by one process (`share_of`) and must not have changed since `_read` saw it
        (``identities``), so that what the reader took from it is what was checked; except the
        files this process hashes as it places their arrays (``later``: `_check_placed_hashes`).
        Collective: ``read_error``, this process's failed read, reaches every process here (and
        is raised here as it is)."""
        prefix = self.sharded_dir + "/"
        listed = {name: info for name, info in manifest["files"].items() if name.startswith(prefix)}
        failure: Optional[str] = None if read_error is None else failure_reason(read_error)
        damage = read_error is None or is_damage(read_error)  # (a mismatch found below is damage)
        for name, got in sorted(hashes.items()):  # none after a failed read
            refusal = _hash_refusal(check_file_name(directory, prefix + name), listed.get(prefix + name), got)
            if refusal is not None:
                failure = str(refusal)
                break
        gathered = self.collectives.all_gather_json({"hashed": sorted(hashes) + sorted(later), "error": failure,
                                                     "damage": damage},
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


def _hash_refusal(path: str, info: Optional[Dict[str, Any]], got: Dict[str, Any]) -> Optional[CheckpointError]:
    """Why the file at ``path``, read whole and hashed by the sharded reader (``got``: its size and
    xxh3), does not match its manifest entry ``info`` (None: the manifest lists none), or None."""
    if info is None:
        return CheckpointError(f"{path}: read by the sharded reader but not listed in the manifest."
                               + see("sharded-files-unlisted"))
    if got["size"] != info["size"]:
        return safetensors_io.size_mismatch(path, got["size"], info["size"])
    if got["xxh3"] != info["xxh3"]:
        return safetensors_io.checksum_mismatch(path)
    return None
