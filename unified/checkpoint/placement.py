"""Large arrays read straight into the live objects, hashed as they are placed: one pass over
each byte (the default). A mismatch found while placing is reported on every process, naming
the file and the object; the objects then hold part of the checkpoint. With
``load_state(verify_first=True)`` each file is verified whole first in a bounded buffer (on a
store keeping a verified local copy), and read again into place only once every check passed on
every process: a failed load then changes nothing, for a second read of every byte.
"""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import uuid
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..backend import Replaceable
from ..config import is_url
from ..errors import CheckpointError, see
from ..runtime.environment import LOAD_COPY_VARIABLE
from . import safetensors_io
from .agreement import Agreement
from .failures import _not_damage, damaged_while_placed
from .store import Folder, location_of
from .types import _FILES_AT_ONCE, Entry, InPlace, Place, Placer, in_place_min_bytes


class Placement(Agreement):
    """Reading large arrays into the live objects (mixed into `CheckpointManager`)."""

    def _places(self, entry: Entry, live: Dict[str, Any]) -> Dict[str, Place]:
        """Where a load puts the large arrays (at least `IN_PLACE_MIN_BYTES`) of an entry's
        ``live`` arrays: straight into their memory (`Backend.writable_host_bytes`), else
        replaced one at a time (`Entry.replaceable`); the others are read into fresh memory."""
        places, least = {}, in_place_min_bytes()
        handles = entry.replaceable_handles()
        for name, value in live.items():
            if isinstance(value, np.ndarray) or int(getattr(value, "nbytes", 0)) < least:
                continue
            raw = self.backend.writable_host_bytes(value)
            if raw is not None:
                places[name] = Place(raw, lambda value=value: value)
            elif name in handles:  # (`codec.encode` collected only `Replaceable` leaves)
                handle = handles[name]
                places[name] = Place(_hand_off(handle), handle.current, handle.writable_in_place)
        return places

    def _plan_placing(self, directory: str, manifest: Dict[str, Any], entry: Entry,
                      places: Dict[str, Place]) -> "InPlace":
        """A file read into place later (`_read_in_place`): its header described (checked as a
        read checks it), before any object is restored. Its bytes are hashed as they are placed;
        ``verify_first``: hashed whole now as well, in a bounded buffer (the old order)."""
        path, info = self._listed(directory, manifest, f"{entry.name}.safetensors")
        location = location_of(directory)
        identity, copy = None, None
        if self._verify_first:
            copy = self._copy_for(path, int(info["size"]))
            identity = location.verify(path, info["size"], info["xxh3"], copy_to=copy)
            copy = copy if copy is not None and os.path.exists(copy) else None  # removed: the disk was full
        try:
            described = location.describe(path, info["size"])
        except CheckpointError as refusal:  # a damaged header reads as a checksum mismatch, as in a read
            error = refusal if self._verify_first else self._damage_behind(path, info["size"], info["xxh3"], refusal)
            raise error from None
        # only into arrays of the saved dtype and shape (a user object's own load_state_dict decides
        # about the others, from fresh memory, as before)
        places = {key: place for key, place in places.items()
                  if described.get(key) == tuple(self.backend.describe_array(place.current()))}
        return InPlace(path, int(info["size"]), str(info["xxh3"]), identity, described, places, copy,
                       verified=self._verify_first)

    @staticmethod
    def _damage_behind(path: str, size: int, checksum: str, refusal: CheckpointError) -> CheckpointError:
        """What to raise when a file not verified yet is refused for what its header says (not
        safetensors, a tensor of another dtype or shape): its checksum mismatch when the file is
        damaged (a load that falls back then goes on to an older checkpoint), else ``refusal``."""
        try:
            location_of(path).verify(path, size, checksum)
        except CheckpointError as damage:
            return damage
        return refusal

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
        """The pass that places (collective), after every check passed on every process: each
        file planned by `_plan_placing` is read, its large arrays straight into the live ones,
        hashed as it goes; ``states`` then holds the decoded states. A mismatch is reported on
        every process, naming the file and the object (`_place_in_order`). Verified first: a
        file that changed since is refused before anything is read into place. ``candidates``:
        the states of the objects that no load-state hook restored itself (the hooks, Accelerate's
        *pre* hooks, run before: they see the objects as they were)."""
        later = {name: state for name, state in candidates.items() if isinstance(state, InPlace)}
        if not later:
            return
        failure: Optional[BaseException] = None
        location = location_of(directory)
        changed = [p.path for p in later.values() if p.verified and location.changed(p.path, p.identity)]
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
        """The placing pass's results, file by file in the objects' order (`_read_in_place`).
        A file found damaged there is damage of the checkpoint (`is_damage`: a load that falls
        back goes on to an older one, which restores every object whole)."""
        failure: Optional[BaseException] = None
        for name, placing in later.items():
            try:
                arrays, placed = reads[name].result()
            except (CheckpointError, OSError) as err:
                failure = self._failed_while_placed(placing, name, err)
                break
            except Exception as err:  # noqa: BLE001 - a replacement failed (out of device memory...): every process hears it
                failure = CheckpointError(f"{placing.path}: restoring {name} failed after it was verified "
                                          f"({type(err).__name__}: {err}); the objects now hold part of this "
                                          "checkpoint: free memory, then load it (or another) again before training."
                                          + see("placing-failed"))
                break
            states[name] = self._decode(by_name[name], manifest["structures"][name], arrays,
                                        {key: placing.places[key].current() for key in placed})
        self._share_verified(directory, failure, "load_state (read into place)")

    @staticmethod
    def _failed_while_placed(placing: "InPlace", name: str, err: Exception) -> CheckpointError:
        """The error every process raises when ``placing``'s file failed while ``name`` was read
        into place: damage of the checkpoint in one pass; a change meanwhile after it was verified."""
        if placing.verified:
            return _not_damage(CheckpointError(
                f"{placing.path}: changed while it was read into the live objects, after it was verified ({err}); "
                "they now hold part of this checkpoint: load it (or another) again before training."
                + see("changed-while-placed")))
        return damaged_while_placed(err, name)


def _hand_off(handle: Replaceable) -> Placer:
    """How a read hands an array over to ``handle``: kept as it is (`KeepsHost`), a copy started
    while the next array is read (`Overlapped`: a GPU's), else copied before the next one is read."""
    if handle.keeps_host:
        return safetensors_io.KeepsHost(handle.replace)
    if handle.copies_while_reading:
        return safetensors_io.Overlapped(handle.replace_async, handle.staging_buffer)
    return handle.replace
