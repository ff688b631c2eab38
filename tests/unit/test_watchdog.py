"""The watchdog's decisions, with an in-memory channel and threads standing in for processes."""
from __future__ import annotations

import threading
import time
from typing import Dict, List

import pytest

from unified.watchdog import Watchdog


class DictChannel:
    """A shared dict as the key-value service; ``down`` makes every call fail."""

    def __init__(self) -> None:
        self.values: Dict[str, str] = {}
        self.lock = threading.Lock()
        self.down = False

    def post(self, name: str, value: str) -> None:
        if self.down:
            raise ConnectionError("service gone")
        with self.lock:
            self.values[name] = value

    def read(self) -> Dict[str, str]:
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
    # at exit, a process whose group broke leaves without finalizers (exit code 0: no uncaught error)
    assert "exiting without finalizers" in exits.messages[0] and exits.codes == [0]


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


def test_invalid_timeout_is_refused():
    with pytest.raises(ValueError, match="positive number of seconds"):
        Watchdog(DictChannel(), 0, 2, 0)
