"""The lease of a checkpoint prefix on a store (issue 46, findings 2 and 3), on moto's S3 server.

Finding 2: a held lease's end is judged by the store's clock (the lease object's Last-Modified
plus its term, against the Date of the store's answer), not by comparing the holder's clock
with the contender's: before, a run whose clock ran 300 s ahead took a live lease at once, and
a run whose clock ran behind could not take over one that had ended.

Finding 3: the lease relies on conditional writes (``If-None-Match: *``, ``If-Match``); a
server that ignores them lets two runs both "create" the lease. `Lease.acquire` now finds out
with one or two probe writes that must be refused, and warns (the run goes on without the
protection it cannot have). Servers that ignore the conditions are simulated by a client that
drops them from its writes.
"""
from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Iterator

import pytest

from unified.checkpoint.lease import LEASE_NAME, Lease
from unified.errors import CheckpointError
from unified.testing.object_store import missing_store_packages, s3_server

pytestmark = pytest.mark.skipif(missing_store_packages() is not None, reason=str(missing_store_packages()))


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    with s3_server() as running:
        yield running


@pytest.fixture
def prefix(server) -> str:
    return f"{server.bucket()}/run"


@pytest.fixture
def fs(server) -> Any:
    return server.filesystem()


def _clock_off_by(monkeypatch, seconds: float) -> None:
    """``time.time()`` of this thread (the contender's) ``seconds`` off; the store's threads
    (moto runs in this process) and the client's keep the true time."""
    true_time, contender = time.time, threading.get_ident()
    monkeypatch.setattr(time, "time", lambda: true_time() + (seconds if threading.get_ident() == contender else 0))


def _ignoring(fs: Any, monkeypatch, conditions=("IfMatch", "IfNoneMatch")) -> None:
    """Make ``fs`` behave as a client of a server that ignores ``conditions``: its writes go out
    without them (and a create is a plain write)."""
    write = fs.pipe_file

    def pipe_file(path, value, **kwargs):
        for name in conditions:
            kwargs.pop(name, None)
        if "IfNoneMatch" in conditions and kwargs.get("mode") == "create":
            kwargs.pop("mode")
        return write(path, value, **kwargs)

    monkeypatch.setattr(fs, "pipe_file", pipe_file)


# -- finding 2: the store's clock ------------------------------------------------------------------

def test_a_contender_whose_clock_is_300s_ahead_does_not_take_a_live_lease(fs, prefix, monkeypatch):
    monkeypatch.setenv("UNIFIED_RUN_ID", "holder")
    holder = Lease.acquire(fs, prefix)
    try:
        monkeypatch.setenv("UNIFIED_RUN_ID", "contender")
        _clock_off_by(monkeypatch, +300)
        with pytest.raises(CheckpointError, match="another live run saves checkpoints here") as raised:
            Lease.acquire(fs, prefix)
        assert "#store-in-use" in str(raised.value) and "by the store's clock" in str(raised.value)
        holder.check()  # still the holder's: its next save goes on
    finally:
        holder.release()
    assert not fs.exists(f"{prefix}/{LEASE_NAME}")


def test_a_lease_ended_by_the_stores_clock_is_taken_over_by_a_contender_300s_behind(fs, prefix, monkeypatch):
    monkeypatch.setenv("UNIFIED_STORE_LEASE_SECONDS", "0.5")
    monkeypatch.setenv("UNIFIED_RUN_ID", "holder")
    holder = Lease.acquire(fs, prefix)
    holder._stop.set()  # as if the run hung: no more renewals
    time.sleep(1.5)  # the store stamps whole seconds: its clock is now past the lease's stamp + term
    monkeypatch.setenv("UNIFIED_RUN_ID", "contender")
    _clock_off_by(monkeypatch, -300)
    contender = Lease.acquire(fs, prefix)
    try:
        with pytest.raises(CheckpointError, match="lost its lease"):
            holder.check()
        contender.check()
    finally:
        contender.release()
    assert not fs.exists(f"{prefix}/{LEASE_NAME}")


def test_the_same_run_takes_its_own_live_lease_over_at_once(fs, prefix, monkeypatch):
    monkeypatch.setenv("UNIFIED_RUN_ID", "job-7")
    first = Lease.acquire(fs, prefix)
    first._stop.set()  # the process that held it was killed
    _clock_off_by(monkeypatch, +300)
    again = Lease.acquire(fs, prefix)  # a restart of the same job: no wait for the term
    try:
        with pytest.raises(CheckpointError, match="lost its lease"):
            first.check()
    finally:
        again.release()


def test_without_a_date_from_the_store_its_time_comes_from_an_object_written_now(fs, prefix, monkeypatch):
    """A server that sends no ``Date`` (HTTP requires one; a proxy may drop it): the store's time
    is then the Last-Modified of a small object written for the purpose, and removed."""
    monkeypatch.setenv("UNIFIED_RUN_ID", "holder")
    holder = Lease.acquire(fs, prefix)
    call = fs.call_s3

    def without_date(method, *args, **kwargs):
        out = call(method, *args, **kwargs)
        out.get("ResponseMetadata", {}).get("HTTPHeaders", {}).pop("date", None)
        return out

    monkeypatch.setattr(fs, "call_s3", without_date)
    monkeypatch.setenv("UNIFIED_RUN_ID", "contender")
    _clock_off_by(monkeypatch, +300)
    try:
        with pytest.raises(CheckpointError, match="another live run saves checkpoints here"):
            Lease.acquire(fs, prefix)
    finally:
        holder.release()
    fs.invalidate_cache()
    assert fs.find(prefix) == []  # the lease released, the object written for the time removed


# -- finding 3: servers that ignore conditional writes ---------------------------------------------

def test_a_server_that_ignores_conditional_writes_is_detected_and_warned_about(fs, prefix, monkeypatch):
    _ignoring(fs, monkeypatch)
    monkeypatch.setenv("UNIFIED_RUN_ID", "first")
    with pytest.warns(UserWarning, match="does not honour conditional writes") as caught:
        first = Lease.acquire(fs, prefix)
    message = str(caught[0].message)
    assert "If-None-Match" in message and "not detected" in message and "#store-ignores-conditions" in message
    monkeypatch.setenv("UNIFIED_RUN_ID", "second")
    with pytest.warns(UserWarning, match="does not honour conditional writes"):
        second = Lease.acquire(fs, prefix)  # the run goes on, warned: there is no lease to hold
    for held in (first, second):
        assert held.lost  # not a holder: the manager deletes nothing that may be another run's save
        held.check()
        held.release()
    assert not fs.exists(f"{prefix}/{LEASE_NAME}")  # nothing left that looks like a lease


def test_a_server_that_ignores_only_if_match_still_refuses_a_second_run(fs, prefix, monkeypatch):
    _ignoring(fs, monkeypatch, conditions=("IfMatch",))
    monkeypatch.setenv("UNIFIED_RUN_ID", "first")
    with pytest.warns(UserWarning, match="does not honour conditional writes") as caught:
        first = Lease.acquire(fs, prefix)
    assert "If-Match" in str(caught[0].message) and "lost" in str(caught[0].message)
    try:
        monkeypatch.setenv("UNIFIED_RUN_ID", "second")
        with pytest.raises(CheckpointError, match="another live run saves checkpoints here"):
            Lease.acquire(fs, prefix)
    finally:
        first.release()


def test_a_server_that_honours_them_gets_no_warning_and_the_probes_stay_cheap(fs, prefix, monkeypatch):
    """At most two probe writes per acquisition (none when another run holds the lease), none per renewal."""
    write, writes = fs.pipe_file, []

    def counted(path, value, **kwargs):
        create = kwargs.get("IfNoneMatch") == "*" or kwargs.get("mode") == "create"
        writes.append("create" if create else "if-match" if "IfMatch" in kwargs else "plain")
        return write(path, value, **kwargs)

    monkeypatch.setattr(fs, "pipe_file", counted)
    monkeypatch.setenv("UNIFIED_RUN_ID", "first")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = Lease.acquire(fs, prefix)
        assert len(writes) <= 3, writes  # the create, then at most two probes
        writes.clear()
        first.check()
        assert writes == ["if-match"]  # a renewal: one conditional write
        writes.clear()
        monkeypatch.setenv("UNIFIED_RUN_ID", "second")
        with pytest.raises(CheckpointError, match="another live run"):
            Lease.acquire(fs, prefix)
        assert writes == ["create"]  # refused: the failed create proved the server honours it
        monkeypatch.setenv("UNIFIED_RUN_ID", "first")
        writes.clear()
        again = Lease.acquire(fs, prefix)  # a restart: the takeover, then one probe of If-Match
        assert len(writes) <= 3, writes
    again.release()
    first.release()
