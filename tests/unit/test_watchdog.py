"""The watchdog's decisions, with an in-memory channel and threads standing in for processes."""
from __future__ import annotations

import threading
import time
from typing import Dict, List

import pytest

from unified.runtime.watchdog import Watchdog


class DictChannel:
    """A shared dict as the key-value service; ``down`` makes every call fail."""

    def __init__(self) -> None:
        self.values: Dict[str, str] = {}
        self.lock = threading.Lock()
        self.down = False
        self.hang = threading.Event()  # set: every call blocks, as with a service out of reach
        self.release = threading.Event()

    def post(self, name: str, value: str) -> None:
        if self.hang.is_set():
            self.release.wait(30)
        if self.down:
            raise ConnectionError("service gone")
        with self.lock:
            self.values[name] = value

    def read(self) -> Dict[str, str]:
        if self.hang.is_set():
            self.release.wait(30)
        if self.down:
            raise ConnectionError("service gone")
        with self.lock:
            return dict(self.values)


class Exits:
    def __init__(self) -> None:
        self.messages: List[str] = []
        self.codes: List[int] = []
        self.event = threading.Event()

    def __call__(self, message: str, code: int) -> None:
        self.messages.append(message)
        self.codes.append(code)
        self.event.set()


def make(channel, rank, size=2, timeout=1.0, grace=0.2):
    exits = Exits()
    dog = Watchdog(channel, rank, size, timeout, interval=0.02, grace=grace, exit=exits)
    return dog, exits


def test_peer_failure_ends_a_process_that_did_not_meet_it():
    channel = DictChannel()
    dog, exits = make(channel, 0)
    peer, _ = make(channel, 1)
    dog.start(), peer.start()
    try:
        peer.report(RuntimeError("wait_for_everyone #3 timed out"))
        assert exits.event.wait(5)
        assert "process 1 failed: RuntimeError: wait_for_everyone #3 timed out" in exits.messages[0]
        assert "[process 0/2] unified: the process group broke" in exits.messages[0]
    finally:
        dog.close(), peer.close()


def test_a_process_that_met_the_error_itself_is_left_alone():
    channel = DictChannel()
    dog, exits = make(channel, 0, grace=0.3)
    peer, _ = make(channel, 1)
    dog.start(), peer.start()
    try:
        peer.report(RuntimeError("lost"))
        dog.report(RuntimeError("lost too"))  # within the grace period: this process raises on its own
        assert not exits.event.wait(1.0)
        assert dog.broken
    finally:
        dog.close(), peer.close()
    # at exit, a process whose group broke leaves without finalizers, with exit code 1 even though
    # its script caught the error (a launcher must not report a broken run as a success)
    assert "exiting without finalizers" in exits.messages[0] and exits.codes == [1]


def test_silent_peer_is_lost_after_the_timeout_and_the_reason_is_posted():
    channel = DictChannel()
    dog, exits = make(channel, 0, timeout=0.5)
    dog.start()  # process 1 never beats: it died before its first heartbeat
    try:
        start = time.monotonic()
        assert exits.event.wait(5)
        assert time.monotonic() - start >= 0.5
        assert "process 1 stopped responding (no heartbeat for 0.5s)" in exits.messages[0]
        assert "stopped responding" in channel.values["failed/0"]
    finally:
        dog.close()


def test_a_process_whose_own_collective_times_out_with_the_lost_heartbeat_is_left_alone():
    """A frozen or cut-off peer: the heartbeat and this process's barrier time out on the same clock;
    the barrier's error (which names the missing process) must win, not the watchdog's exit."""
    channel = DictChannel()
    dog, exits = make(channel, 0, timeout=0.3, grace=0.5)
    dog.in_timed_call = lambda: True  # this process waits in a barrier
    dog.start()  # process 1 never beats
    try:
        time.sleep(0.45)  # the peer is declared lost at ~0.3 s; this process raises on its own just after
        dog.report(RuntimeError("wait_for_everyone #4 timed out after 0.3s; process 1 did not arrive"))
        assert not exits.event.wait(1.0), exits.messages
        assert "process 1" in channel.values["failed/0"]
    finally:
        dog.close()


def test_beating_peer_and_goodbye_are_not_failures():
    channel = DictChannel()
    dog, exits = make(channel, 0, timeout=0.4)
    peer, _ = make(channel, 1, timeout=0.4)
    dog.start(), peer.start()
    try:
        assert not exits.event.wait(1.2)  # three timeouts of live heartbeats
        peer.close()  # a normal exit: says goodbye
        assert channel.values["bye/1"] == "1"
        assert not exits.event.wait(1.2)
    finally:
        dog.close(), peer.close()


def test_lost_service_ends_the_process_after_the_timeout():
    channel = DictChannel()
    dog, exits = make(channel, 0, timeout=0.4)
    dog.start()
    try:
        channel.down = True
        assert exits.event.wait(5)
        assert "the coordination service has not answered for 0.4s" in exits.messages[0]
    finally:
        dog.close()


def test_a_service_out_of_reach_blocks_neither_the_report_nor_the_decision():
    """A cut link: calls to the service block (they do not fail). Reporting this process's own
    error returns at once, and a process that met no error is ended after the timeout."""
    channel = DictChannel()
    dog, exits = make(channel, 0, timeout=0.4)
    dog.start()
    try:
        channel.where = "the coordination service at 10.0.0.1:29500 (process 0's machine)"
        channel.hang.set()
        start = time.monotonic()
        assert exits.event.wait(5)  # running, not in a timed collective: ended at the timeout
        assert ("the coordination service at 10.0.0.1:29500 (process 0's machine) has not answered for 0.4s"
                in exits.messages[0])
        assert time.monotonic() - start < 3
        quiet, _ = make(channel, 1, timeout=0.4)
        start = time.monotonic()
        quiet.report(RuntimeError("wait_for_everyone #2 timed out"))
        assert time.monotonic() - start < 2.5
    finally:
        channel.release.set()
        dog.close()


def test_invalid_timeout_is_refused():
    with pytest.raises(ValueError, match="positive number of seconds"):
        Watchdog(DictChannel(), 0, 2, 0)
