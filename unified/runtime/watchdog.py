"""A per-process watchdog for backends whose collectives can block forever.

JAX's device collectives (a jitted step's all-reduce) take no timeout: a process blocked in one
while a peer died cannot raise. The watchdog is a daemon thread that keeps the promise "no
survivor hangs" for such backends, through a small key-value channel the backend provides:

- every ``interval`` it posts its own heartbeat and reads the others' (``alive/<rank>``);
- a process that meets a `DistributedError` (a timed-out barrier, a lost peer) or exits with an
  uncaught exception posts the reason (``failed/<rank>``): the others learn it at once;
- a peer whose heartbeat has not changed for ``timeout`` seconds, without a goodbye
  (``bye/<rank>``), is lost;
- when a peer failed or is lost and this process's own code has not met an error within
  ``grace`` seconds, the process is stuck (or would be at its next collective): the watchdog
  prints why on stderr and ends it with exit code 1;
- at exit, a process whose group broke leaves through ``os._exit(1)`` (exit code 1 even when its
  script caught the error: a launcher and a scheduler must see the run failed): finalizers of
  arrays whose computation waits on a dead peer would otherwise block the interpreter's shutdown;
- a process that saw its group break (its own error, a peer's failure, a lost peer) says so in
  `unified launch`'s status folder, so that the launcher never reports success for the group.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Callable, Dict, Optional, TypeVar

from ..backend import HealthChannel
from ..errors import first_line, see
from .preemption import record_status

__all__ = ["CHANNEL_KINDS", "HealthChannel", "Watchdog"]

T = TypeVar("T")


# What the processes of a group post on their health channel, each under ``<kind>/<process index>``:
# the watchdog's heartbeat, failure and goodbye, and the reason a process could not write its
# part of an asynchronous save (unified.checkpoint.manager). A channel that cannot list what was
# posted reads exactly these names.
CHANNEL_KINDS = ("alive", "failed", "bye", "save-failed")


# After the service stopped answering, the process's own error may come this many graces later.
UNANSWERED_GRACE = 3.0
# How long a process's own call to the channel (its failure, its goodbye) may block it.
POST_WAIT_SECONDS = 1.0


def _bounded(call: Callable[[], T], seconds: float) -> T:
    """``call()``, run in a daemon thread; `TimeoutError` when it has not returned after ``seconds``
    (it is then left blocked: a channel whose service is out of reach blocks, it does not fail)."""
    done = threading.Event()
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            outcome.append((False, err))
        done.set()

    threading.Thread(target=run, name="unified-watchdog-call", daemon=True).start()
    if not done.wait(seconds):
        raise TimeoutError(f"no answer within {seconds:g}s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _hard_exit(message: str, code: int = 1) -> None:
    print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


class Watchdog:
    """Detects a broken group for one process and ends the process when it cannot raise.

    Example:
        >>> dog = Watchdog(channel, process_index=0, num_processes=2, timeout=60)  # doctest: +SKIP
        >>> dog.start()                                                          # doctest: +SKIP
    """

    def __init__(self, channel: HealthChannel, process_index: int, num_processes: int, timeout: float, *,
                 interval: Optional[float] = None, grace: float = 1.0,
                 exit: Callable[[str, int], None] = _hard_exit) -> None:
        if not timeout > 0:
            raise ValueError(f"Invalid timeout: expected a positive number of seconds; received {timeout!r}."
                             + see("invalid-timeout"))
        self.channel = channel
        self.rank = process_index
        self.size = num_processes
        self.timeout = float(timeout)
        # every process reads every other's heartbeat: slow down for large groups
        self.interval = interval if interval is not None else min(0.5, self.timeout / 20) * max(1.0, num_processes / 16)
        self.grace = grace
        self._exit = exit
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._acknowledged = False  # this process's code already met an error: it decides what to do
        self.broken = False
        self._uncaught_seen = False
        # True while this process's code is inside a collective that times out on its own (set by
        # the Accelerator): after a lost peer, the watchdog then lets that collective raise.
        self.in_timed_call: Callable[[], bool] = lambda: False
        self._previous_hook = None

    def _who(self) -> str:
        return f"[process {self.rank}/{self.size}]"

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._post(f"alive/{self.rank}", "0")
        self._thread = threading.Thread(target=self._run, name="unified-watchdog", daemon=True)
        self._thread.start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._uncaught
        atexit.register(self.close)

    def close(self) -> None:
        """Stop watching; say goodbye to the others, or leave at once when the group broke."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)  # no RPC of ours may overlap the backend's shutdown
        if sys.excepthook == self._uncaught:
            sys.excepthook = self._previous_hook
        if self.broken:  # exit code 1 even when the script caught the error: its group broke, the run failed
            self._exit(f"{self._who()} unified: exiting without finalizers because the process group broke "
                       "(they could wait forever on a dead peer); exit code 1.", 1)
        self._post(f"bye/{self.rank}", "1")

    def report(self, error: BaseException) -> None:
        """This process met ``error`` (a broken group): tell the others and stand down."""
        self._acknowledged = self.broken = True
        record_status("broken", self.rank)
        self._post(f"failed/{self.rank}", f"{type(error).__name__}: {first_line(error)[:500]}")

    def _uncaught(self, kind, value, traceback) -> None:
        self._uncaught_seen = True
        if not self._acknowledged and not issubclass(kind, KeyboardInterrupt):
            self._post(f"failed/{self.rank}", f"exited with an uncaught {kind.__name__}: {str(value)[:300]}")
        (self._previous_hook or sys.__excepthook__)(kind, value, traceback)

    def _post(self, name: str, value: str) -> bool:
        try:
            _bounded(lambda: self.channel.post(name, value), POST_WAIT_SECONDS)
            return True
        except Exception:  # the service may be gone or out of reach; the main thread's collectives will say so
            return False

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        beat = 0
        now = time.monotonic()
        seen: Dict[int, str] = {}
        changed_at = {r: now for r in range(self.size) if r != self.rank}
        answered_at = now
        while not self._stop.wait(self.interval):
            beat += 1
            now = time.monotonic()
            try:
                # bounded: a service out of reach (a cut link) blocks a call instead of failing it
                left = max(self.interval, self.timeout - (now - answered_at))
                _bounded(lambda beat=beat: self.channel.post(f"alive/{self.rank}", str(beat)), left)
                posted = _bounded(self.channel.read, left)
                answered_at = now
            except Exception:
                if now - answered_at > self.timeout and not self._acknowledged:
                    # this process's own collective, timed out by the same clock, may first spend a
                    # moment asking the (unreachable) service who is missing: let it raise
                    if self.in_timed_call() and self._stop.wait(UNANSWERED_GRACE * self.grace):
                        return
                    if not self._acknowledged:
                        where = getattr(self.channel, "where", None) or "the coordination service"
                        self._give_up(f"{where} has not answered for {self.timeout:g}s")
                    return
                continue
            if self._acknowledged:
                return
            failures = {r: posted[f"failed/{r}"] for r in changed_at if f"failed/{r}" in posted}
            if failures:
                rank, reason = min(failures.items())
                record_status("broken", self.rank)  # even if this process then ends cleanly
                if not self._stop.wait(self.grace) and not self._acknowledged:
                    self._give_up(f"process {rank} failed: {reason}")
                return
            lost = []
            for r in changed_at:
                if f"bye/{r}" in posted:
                    continue
                value = posted.get(f"alive/{r}")
                if value != seen.get(r):
                    seen[r], changed_at[r] = value, now
                elif now - changed_at[r] > self.timeout:
                    lost.append(r)
            if lost:
                who = ", ".join(map(str, lost))
                reason = f"process {who} stopped responding (no heartbeat for {self.timeout:g}s)"
                self._post(f"failed/{self.rank}", reason)
                # inside a collective that times out by the same clock, this process is about to
                # raise on its own (naming the lost process): let it
                if self.in_timed_call() and self._stop.wait(self.grace):
                    return
                if not self._acknowledged:
                    self._give_up(reason)
                return

    def _give_up(self, reason: str) -> None:
        if self._stop.is_set():
            return
        self.broken = True
        record_status("broken", self.rank)
        self._exit(f"{self._who()} unified: the process group broke - {reason}. This process had not met the "
                   "error itself (it was running or blocked in a computation that cannot time out); exiting "
                   "with code 1." + see("the-process-group-broke"), 1)
