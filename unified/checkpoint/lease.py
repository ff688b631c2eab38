"""One live run per checkpoint prefix on an object store: a lease, as `lock` is for a folder.

A store has no ``flock``. The main process of a run therefore holds a lease object,
``{project_dir}/unified-lease.json``, from its first automatic save until ``end_training``:
created only if absent (S3's conditional write, ``If-None-Match: *``), renewed in the
background every quarter of its term with ``If-Match`` on the ETag it last wrote (so a run that
lost its lease learns it instead of overwriting the new holder's), deleted at the end. A second
run's first save finds it and raises, naming the holder and when its lease ends. A run that
crashed leaves its lease until the term ends (`lease_seconds`); the same job started again (a
restart by ``unified launch``, torchrun or a SLURM requeue: the same `run_identity`) takes it
over at once. Only stores whose client can write conditionally (S3) get a lease; on others
there is none, as the docs say.

Example:
    >>> lease = Lease.acquire(fs, "s3://bucket/run")     # raises CheckpointError when held
    >>> lease.check()                                     # before each save
    >>> lease.release()
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from typing import Any, Dict, Optional

from ..environment import run_identity
from ..errors import CheckpointError, see

LEASE_NAME = "unified-lease.json"
LEASE_VARIABLE = "UNIFIED_STORE_LEASE_SECONDS"  # the term of a lease (default 120 s)


def lease_seconds() -> float:
    """How long a lease lasts unless renewed: ``UNIFIED_STORE_LEASE_SECONDS``, else 120."""
    return float(os.environ.get(LEASE_VARIABLE) or 120)


def supported(fs: Any) -> bool:
    """Whether ``fs`` can write conditionally (an S3 client, through s3fs)."""
    return hasattr(fs, "call_s3")


class Lease:
    """A held lease (see the module's docstring)."""

    def __init__(self, fs: Any, url: str, path: str, etag: str) -> None:
        self.fs, self.url, self.path, self.etag = fs, url, path, etag
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._guard = threading.Lock()
        self._thread = threading.Thread(target=self._renew_until_released, name="unified-lease", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, fs: Any, project_dir: str) -> "Lease":
        url = f"{project_dir.rstrip('/')}/{LEASE_NAME}"
        path = fs._strip_protocol(url)
        try:
            return cls(fs, url, path, _put(fs, path, mode="create"))
        except FileExistsError:
            pass
        try:  # the ETag first: a renewal after it makes the takeover below fail, never succeed wrongly
            etag = fs.info(path, refresh=True)["ETag"]
            text = fs.cat_file(path)
        except FileNotFoundError:  # released meanwhile: try once more
            return cls(fs, url, path, _put(fs, path, mode="create"))
        try:
            held = json.loads(text)
        except ValueError:
            held = {}
        if held.get("run") != run_identity() and float(held.get("expires", 0)) > time.time():
            raise CheckpointError(
                f"{project_dir}: another live run saves checkpoints here ({_shown(held)}); two runs sharing a prefix "
                "would overwrite each other's checkpoints. Give each run its own project_dir, or stop the other run. "
                f"If that run is gone, its lease ends within {lease_seconds():g}s, or delete {url}." + see("store-in-use"))
        try:  # expired, or this job's own (a restart): take it over, unless another run just did
            return cls(fs, url, path, _put(fs, path, IfMatch=etag))
        except OSError as err:
            raise CheckpointError(f"{project_dir}: another run took the lease {url} at the same moment ({err}); "
                                  "give each run its own project_dir." + see("store-in-use")) from err

    def check(self) -> None:
        """Renew now (before a save); raise `CheckpointError` when the lease was lost."""
        self._renew()
        if self.lost:
            raise CheckpointError(f"{self.url}: this run lost its lease on the checkpoint prefix ({self.lost}); another "
                                  "run may be saving there. Nothing was saved." + see("store-in-use"))

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.lost is None:
            try:
                if self.fs.info(self.path, refresh=True)["ETag"] == self.etag:  # still ours, not a restart's
                    self.fs.rm_file(self.path)
            except Exception:  # noqa: BLE001 - best effort: an unreleased lease ends with its term
                pass

    def _renew(self) -> None:
        with self._guard:
            if self.lost:
                return
            try:
                self.etag = _put(self.fs, self.path, IfMatch=self.etag)
            except OSError as err:  # a failed precondition among them
                if "pre-condition" in str(err) or "PreconditionFailed" in str(err):
                    self.lost = f"it was replaced: {err}"
            except Exception:  # noqa: BLE001 - a store out of reach: try again at the next renewal
                pass

    def _renew_until_released(self) -> None:
        while not self._stop.wait(lease_seconds() / 4):
            self._renew()


def _note() -> bytes:
    return json.dumps({"run": run_identity(), "host": socket.gethostname(), "pid": os.getpid(),
                       "since": datetime.datetime.now().isoformat(timespec="seconds"),
                       "expires": time.time() + lease_seconds()}).encode()


def _put(fs: Any, path: str, **conditions: Any) -> str:
    """Write a fresh note at ``path`` under ``conditions``; its ETag."""
    out = fs.pipe_file(path, _note(), **conditions)
    etag = out.get("ETag") if isinstance(out, dict) else None
    return etag or fs.info(path, refresh=True)["ETag"]


def _shown(held: Dict[str, Any]) -> str:
    if not held:
        return "a lease this version cannot read"
    ends = datetime.datetime.fromtimestamp(float(held.get("expires", 0))).isoformat(timespec="seconds")
    return f"pid {held.get('pid')} on {held.get('host')}, since {held.get('since')}, lease renewed until {ends}"
