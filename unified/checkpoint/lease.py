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

Whether a held lease ended is judged by the store's clock alone: the lease object's
Last-Modified (stamped by the store at the holder's last renewal) plus the term the holder
wrote in it, against the ``Date`` of the store's answer to the same request (one HEAD). No
machine's clock is compared with another's, so a run whose clock is off neither takes a live
lease nor waits for an ended one. The store stamps whole seconds: a lease may end up to a
second early, which a term of 120 s renewed every 30 s never comes near.

A server that ignores the conditions (some S3-compatible ones do) would let two runs both
"create" the lease, so acquiring one probes them: a second create of the lease, and a write
with an ETag that is not the lease's, must both be refused (at most two requests per
acquisition, none per renewal). Where they are not, the run warns and goes on: without a lease
(If-None-Match ignored), or with one that still refuses a second run but cannot tell a run
that lost it (If-Match ignored). docs/object-storage.md#one-run-per-prefix says why a warning
rather than a refusal.

Example:
    >>> lease = Lease.acquire(fs, "s3://bucket/run")     # raises CheckpointError when held
    >>> lease.check()                                     # before each save
    >>> lease.release()
"""
from __future__ import annotations

import contextlib
import datetime
import email.utils
import json
import os
import socket
import threading
import time
import warnings
from typing import Any, Dict, Optional, Tuple

from ..errors import CheckpointError, see
from ..runtime.environment import run_identity

LEASE_NAME = "unified-lease.json"
LEASE_VARIABLE = "UNIFIED_STORE_LEASE_SECONDS"  # the term of a lease (default 120 s)


def lease_seconds() -> float:
    """How long a lease lasts unless renewed: ``UNIFIED_STORE_LEASE_SECONDS``, else 120."""
    return float(os.environ.get(LEASE_VARIABLE) or 120)


def supported(fs: Any) -> bool:
    """Whether ``fs`` can write conditionally (an S3 client, through s3fs)."""
    return hasattr(fs, "call_s3")


class Lease:
    """A held lease (see the module's docstring). ``protected`` is False where the store ignores
    ``If-None-Match``: there is then no lease object, nothing to renew or release, and ``lost``
    says why (what only the prefix's holder may do, such as deleting what crashed saves left,
    is not done)."""

    def __init__(self, fs: Any, url: str, path: str, etag: str, protected: bool = True) -> None:
        self.fs, self.url, self.path, self.etag, self.protected = fs, url, path, etag, protected
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._guard = threading.Lock()
        self._thread = threading.Thread(target=self._renew_until_released, name="unified-lease", daemon=True)
        if protected:
            self._thread.start()

    @classmethod
    def acquire(cls, fs: Any, project_dir: str) -> "Lease":
        """Hold the lease of ``project_dir`` for this run: create it, or take it over where it
        ended by the store's clock or this run holds it (a restart of the same job). Raises
        `CheckpointError` where another live run holds it; warns where the store ignores
        conditional writes (then the lease cannot protect the prefix).

        Example:
            >>> lease = Lease.acquire(s3fs.S3FileSystem(), "s3://bucket/run")
        """
        url = f"{project_dir.rstrip('/')}/{LEASE_NAME}"
        path = fs._strip_protocol(url)
        created = True
        try:
            etag = _put(fs, path, IfNoneMatch="*")
        except OSError as err:
            if not _refused(err):
                raise
            created = False  # the store refused a create: it honours If-None-Match
            etag = _take_over(fs, project_dir, url, path)
        etag, ignored = _probe(fs, path, etag, probe_create=created)
        if not ignored:
            return cls(fs, url, path, etag)
        if "If-None-Match" in ignored:  # a lease object would protect nothing: none is left behind
            with contextlib.suppress(Exception):
                if fs.info(path, refresh=True)["ETag"] == etag:
                    fs.rm_file(path)
            held = cls(fs, url, path, etag, protected=False)
            held.lost = "the store ignores If-None-Match: no lease is held"  # nothing is done as the prefix's holder
            effect = ("two runs saving checkpoints to this prefix are not detected: this run holds no lease. Give each "
                      "run its own project_dir")
        else:
            held = cls(fs, url, path, etag)
            effect = ("a second run is still refused, but a run whose lease was taken over after it stopped renewing "
                      "for a whole term (the store out of reach, the process stopped) is not told that it lost it")
        warnings.warn(f"{project_dir}: the store does not honour conditional writes ({'; '.join(ignored.values())}); "
                      f"{effect}." + see("store-ignores-conditions"), UserWarning, stacklevel=2)
        return held

    def check(self) -> None:
        """Renew now (before a save); raise `CheckpointError` when the lease was lost."""
        if not self.protected:
            return
        self._renew()
        if self.lost:
            raise CheckpointError(f"{self.url}: this run lost its lease on the checkpoint prefix ({self.lost}); "
                                  "another run may be saving there. Nothing was saved." + see("store-in-use"))

    def release(self) -> None:
        if not self.protected:
            return
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
                if _refused(err, conflicts=False):
                    self.lost = f"it was replaced: {err}"
            except Exception:  # noqa: BLE001 - a store out of reach: try again at the next renewal
                pass

    def _renew_until_released(self) -> None:
        while not self._stop.wait(lease_seconds() / 4):
            self._renew()


def _take_over(fs: Any, project_dir: str, url: str, path: str) -> str:
    """The ETag of the lease at ``path`` once taken over (it exists): where it ended by the store's
    clock or is this run's own; raises `CheckpointError` where another live run holds it."""
    try:  # the ETag first: a renewal after it makes the takeover below fail, never succeed wrongly
        etag, renewed, now = _stamps(fs, path)
        text = fs.cat_file(path)
    except FileNotFoundError:  # released meanwhile: try once more
        try:
            return _put(fs, path, IfNoneMatch="*")
        except OSError as err:
            if not _refused(err):
                raise
            raise CheckpointError(f"{project_dir}: another run took the lease {url} at the same moment ({err}); "
                                  "give each run its own project_dir." + see("store-in-use")) from err
    try:
        held = json.loads(text)
    except ValueError:
        held = {}
    if not isinstance(held, dict):
        held = {}
    ends_in = renewed + _term(held) - now
    if held.get("run") != run_identity() and ends_in > 0:
        raise CheckpointError(
            f"{project_dir}: another live run saves checkpoints here ({_shown(held, renewed)}); two runs "
            "sharing a prefix would overwrite each other's checkpoints. Give each run its own project_dir, or stop the "
            f"other run. If that run is gone, its lease ends within {ends_in:.0f}s, or delete {url}."
            + see("store-in-use"))
    try:  # ended, or this job's own (a restart): take it over, unless another run just did
        return _put(fs, path, IfMatch=etag)
    except OSError as err:
        raise CheckpointError(f"{project_dir}: another run took the lease {url} at the same moment ({err}); "
                              "give each run its own project_dir." + see("store-in-use")) from err


# An ETag no object has (an MD5 of nothing written): a write conditional on it must be refused.
_NO_SUCH_ETAG = '"00000000000000000000000000000000"'


def _probe(fs: Any, path: str, etag: str, probe_create: bool) -> Tuple[str, Dict[str, str]]:
    """The lease's ETag and the conditions the store ignores (name -> what it did), found by
    writes that must be refused: a second create of the lease just written (``probe_create``:
    unless a refused create already showed that one) and a write conditional on an ETag the
    lease does not have. A probe the store accepts wrote this run's note again."""
    probes = ([("If-None-Match", {"IfNoneMatch": "*"}, "it accepted a second create of the lease")]
              if probe_create else [])
    probes.append(("If-Match", {"IfMatch": _NO_SUCH_ETAG}, "it accepted a write conditional on an ETag the lease "
                                                          "does not have"))
    ignored: Dict[str, str] = {}
    for name, conditions, accepted in probes:
        try:
            etag = _put(fs, path, **conditions)
        except OSError as err:
            if _unsupported(err):
                ignored[name] = f"{name}: it answered that it does not implement it"
            # refused, as it must be; or the store failed otherwise (out of reach): nothing learned
            continue
        ignored[name] = f"{name}: {accepted}"
    return etag, ignored


def _stamps(fs: Any, path: str) -> Tuple[str, float, float]:
    """The lease object's ETag, when the store last wrote it and the store's time now (seconds
    since the epoch, both by the store's clock), from one HEAD request: its Last-Modified and
    the answer's Date. Without a Date (HTTP requires one; a proxy may drop it) the store's time
    is the Last-Modified of a small object written now, then removed."""
    bucket, key, _ = fs.split_path(path)
    out = fs.call_s3("head_object", getattr(fs, "kwargs", {}), Bucket=bucket, Key=key)
    date = ((out.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}).get("date")
    if date:
        now = email.utils.parsedate_to_datetime(date).timestamp()
    else:
        clock = f"{path}.clock"
        fs.pipe_file(clock, b"")
        try:
            now = _modified(fs.call_s3("head_object", getattr(fs, "kwargs", {}), Bucket=bucket, Key=f"{key}.clock"))
        finally:
            fs.rm_file(clock)
    return out["ETag"], _modified(out), now


def _modified(head: Dict[str, Any]) -> float:
    stamp = head["LastModified"]
    return (stamp.timestamp() if isinstance(stamp, datetime.datetime)
            else email.utils.parsedate_to_datetime(stamp).timestamp())


def _term(held: Dict[str, Any]) -> float:
    """The term of the holder's lease: the one it wrote in its note, else this run's."""
    term = held.get("term")
    if isinstance(term, (int, float)) and not isinstance(term, bool) and 0 < term < float("inf"):
        return float(term)
    return lease_seconds()


def _error_code(err: BaseException) -> Tuple[str, Optional[int]]:
    """The S3 error code and HTTP status behind ``err`` (s3fs keeps botocore's error as its cause)."""
    response = getattr(err.__cause__, "response", None) or {}
    return ((response.get("Error") or {}).get("Code") or "",
            (response.get("ResponseMetadata") or {}).get("HTTPStatusCode"))


def _refused(err: OSError, conflicts: bool = True) -> bool:
    """Whether the store refused a write for its condition (412, or the 304 some servers answer
    to a failed If-None-Match; with ``conflicts``, also the 409 S3 answers while another
    conditional write of the object is in flight)."""
    code, status = _error_code(err)
    if isinstance(err, FileExistsError) or code == "PreconditionFailed" or status in (304, 412):
        return True
    if "pre-condition" in str(err) or "PreconditionFailed" in str(err):
        return True
    return conflicts and (code == "ConditionalRequestConflict" or status == 409)


def _unsupported(err: OSError) -> bool:
    """Whether the store answered that it does not implement the condition (501)."""
    code, status = _error_code(err)
    return code == "NotImplemented" or status == 501


def _note() -> bytes:
    return json.dumps({"run": run_identity(), "host": socket.gethostname(), "pid": os.getpid(),
                       "since": datetime.datetime.now().isoformat(timespec="seconds"), "term": lease_seconds(),
                       # read by versions that compared clocks (before 2026-12); this one reads "term"
                       "expires": time.time() + lease_seconds()}).encode()


def _put(fs: Any, path: str, **conditions: Any) -> str:
    """Write a fresh note at ``path`` under ``conditions``; its ETag."""
    out = fs.pipe_file(path, _note(), **conditions)
    etag = out.get("ETag") if isinstance(out, dict) else None
    return etag or fs.info(path, refresh=True)["ETag"]


def _shown(held: Dict[str, Any], renewed: float) -> str:
    if not held:
        return "a lease this version cannot read"
    stamp = datetime.datetime.fromtimestamp(renewed, datetime.timezone.utc).isoformat(timespec="seconds")
    return (f"pid {held.get('pid')} on {held.get('host')}, since {held.get('since')}, lease renewed at {stamp} "
            "by the store's clock")
