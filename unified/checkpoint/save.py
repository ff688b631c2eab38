"""A save's first stages, on every process: the snapshot (host copies of everything this process
writes), the save-state hooks, each process's files written and reported, and the sequence of a
synchronous save (`Saving.save_snapshot`) and of an asynchronous one's background
(`Saving.save_in_background`, which waits for every process's part marker).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

import numpy as np

from ..backend import ShardedWrite, WriteGuards
from ..config import is_url
from ..errors import CheckpointError, see
from ..runtime.rng import capture_host_rng
from . import codec, safetensors_io
from .agreement import Agreement
from .failures import _commit_error, _raise_reported
from .manifest import check_file_name
from .safetensors_io import verify_file
from .store import Folder, ObjectStore, location_of
from .types import PART_FAILED, Snapshot


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


class Saving(Agreement):
    """Snapshot, write and report each process's part (mixed into `CheckpointManager`)."""

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
            if main:  # every array's device-to-host copy starts before the first is waited for
                self.backend.begin_host_copies([v for v in arrays.values() if not self._is_sharded(v)])
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
            store, uploaded = ObjectStore(tmp), {}
            try:
                for name in _tree(local, ""):
                    check_file_name(local, name)
                    uploaded[name] = store.upload(os.path.join(local, name), f"{tmp.rstrip('/')}/{name}")
            except (OSError, CheckpointError) as err:
                return skip, {}, f"process {self.backend.process_index}: a save-state hook's file: {err}"
            return skip, uploaded, None
        finally:
            shutil.rmtree(local, ignore_errors=True)

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

    def save_snapshot(self, final: str, snap: Snapshot, begun: Optional[Tuple[str, str]] = None) -> str:
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
