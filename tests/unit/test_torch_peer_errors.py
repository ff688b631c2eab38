"""A collective inside DDP (the gradient all-reduce of ``backward()``) that fails because a peer is
gone names the peer, as a failed barrier does: the fault benchmark's row 10 (a link cut during
training and saves, 2 machines) found torch processes saying only "a peer process died or
disconnected" (2 of 20 trials). Each process notes its arrival at the n-th entry of the same
operation in the rendezvous store and names the processes whose note is missing, or says that
the store (process 0's machine) does not answer. In one process, with an in-memory store."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import backends.torch.control as control  # noqa: E402
import backends.torch.core as core  # noqa: E402
from unified import DistributedError  # noqa: E402

WHAT = "backward() (the gradient all-reduce)"
GLOO_TIMEOUT = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                            "5000ms for recv operation to complete")


def _backend(store, rank=0, size=2):
    backend = core.TorchBackend()
    backend.process_index, backend.num_processes, backend._store = rank, size, store
    return backend


def _fail_in_backward(backend, calls=1):
    for _ in range(calls - 1):
        with backend.peer_errors(WHAT):
            pass
    with pytest.raises(DistributedError) as caught:
        with backend.peer_errors(WHAT):
            raise GLOO_TIMEOUT
    return str(caught.value)


@pytest.fixture(autouse=True)
def short_waits(monkeypatch):
    monkeypatch.setattr(control, "_DIAGNOSE_GRACE_S", 0.3)
    monkeypatch.setattr(control, "_STORE_ANSWER_S", 0.3)
    monkeypatch.setattr(control, "keep_alive_forever", lambda *groups: None)


def test_the_peer_that_never_noted_its_arrival_is_named():
    message = _fail_in_backward(_backend(dist.HashStore()), calls=3)
    assert "process 1 did not answer" in message, message
    assert "Timed out waiting 5000ms" in message, message


def test_a_peer_that_failed_at_the_same_collective_is_not_named():
    store = dist.HashStore()
    store.set(f"{WHAT} #2/1", "1")  # process 1 reached the same (2nd) gradient all-reduce and noted it
    message = _fail_in_backward(_backend(store), calls=2)
    assert "did not answer" not in message and "a peer process died or disconnected" in message, message


class _Unreachable:
    """A store on a machine this one lost its link to: every call blocks."""

    def __init__(self):
        self.released = threading.Event()

    def set(self, *args):
        self.released.wait(30)

    check = set


def test_a_process_cut_off_from_the_store_names_process_0s_machine(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.231.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    store = _Unreachable()
    try:
        message = _fail_in_backward(_backend(store, rank=1))
    finally:
        store.released.set()
    assert "the rendezvous store at 10.231.0.1:29500 (process 0's machine) did not answer" in message, message


def test_after_a_disconnect_a_late_note_is_waited_for():
    """A peer's death reaches every survivor at once, before the others may have noted their
    arrival: the diagnosis waits for late notes (a gloo timeout does not: everyone had the time)."""
    store = dist.HashStore()
    backend = _backend(store, size=3)
    late = threading.Timer(0.1, lambda: store.set(f"{WHAT} #1/1", "1"))  # survivor 1, a moment later
    late.start()
    with pytest.raises(DistributedError) as caught:
        with backend.peer_errors(WHAT):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    late.join()
    assert "process 2 did not answer" in str(caught.value), caught.value  # the dead one, not survivor 1
