"""JAX's control plane, mixed into `JaxBackend`: barriers, flags and small bytes through the
coordination service's barrier and key-value store, which take deadlines. Each call runs on a
caller thread (`_Caller`), so that a service out of reach cannot block it past its deadline; the
service's keys also carry the watchdog's channel.

A flag is carried by the outcome of one coordination-service barrier (the JAX `check_trigger`).
Every process waits at the same barrier. An unflagged process names no participants (the
whole group); a flagged one names every process and itself a second time. The service compares
the lists by size, so a flagged arrival fails the barrier with ``INVALID_ARGUMENT: Conflicting
tasks specified ...`` for every caller, those waiting and those still to come (the service
keeps the result and repeats it to a late caller), while a barrier that nobody flagged passes
normally. No flag: one round trip, exactly a plain barrier. Flag: the failure, then one
ordinary barrier so that nobody moves on before everyone has seen it (and a dead peer still
raises `BarrierTimeout` naming it).

Two behaviours of the service (jax 0.10, xla ``coordination_service.cc``) this relies on; the
unit test tests/unit/test_jax_flag_barrier.py checks both against a real service:

* a conflicting participant list fails the barrier with a status we can tell from a timeout;
* a caller that arrives after the barrier failed gets the stored result, provided its
  barrier *counter* is not 0. With recoverable tasks (``jax_enable_recoverability``, which we
  switch on), a call with counter 0 to a barrier that already passed is taken for a restarted
  task and opens a new instance that then waits until its deadline. The client counts calls
  per barrier id, so the backend reuses one barrier id for all its flags and meets there once
  (`prime`) before the first flag.
"""
from __future__ import annotations

import os
import queue
import re
import threading
from typing import Any, Dict, List, Optional

from unified.backend.toolkit import timeout_error
from unified.errors import DistributedError, see
from unified.runtime.environment import ProcessEnvironment

__all__ = ["JaxControlPlane"]

# The jax releases whose service was checked to behave as described above (the backend uses the
# two-round-trip protocol, keys then a barrier, with any other).
CHECKED_FROM = (0, 10)

# The start of the service's message for a barrier called with different participant lists.
_CONFLICT = ("INVALID_ARGUMENT", "Conflicting tasks specified")


def flagged_process_ids(num_processes: int, process_index: int) -> List[int]:
    """The participant list a flagged process passes to ``wait_at_barrier``: everyone, and
    itself twice (a list of a different size than the whole group's, that still names only
    members of the group)."""
    return list(range(num_processes)) + [process_index]


def is_flagged(error: BaseException) -> bool:
    """True if ``error`` from ``wait_at_barrier`` says a process arrived with the flagged list."""
    text = str(error)
    return text.startswith(_CONFLICT[0]) and _CONFLICT[1] in text


def supported() -> bool:
    """True if the installed jax is a release this protocol was checked with."""
    import jax

    try:
        return tuple(int(part) for part in jax.__version__.split(".")[:2]) >= CHECKED_FROM
    except ValueError:
        return False


# -- the coordination service's calls, bounded ---------------------------------------------------
# A coordination-service call gets its answer at its deadline at the latest; past this margin
# the service is out of reach.
_SERVICE_MARGIN_S = 2.0


def _missing_from_message(message: str) -> Optional[List[int]]:
    """Parse the coordination service's "Some timed out task names:" list."""
    match = re.search(r"timed out task names:\s*\n((?:.*\n?)*?)(?:\n\n|$)", message)
    if not match:
        return None
    tasks = [int(n) for n in re.findall(r"(?:task:)?(\d+)\s*$", match.group(1), re.MULTILINE)]
    return tasks or None


class _NoAnswer(Exception):
    pass


class _Caller:
    """Runs calls one at a time on a daemon thread (never joined at exit, unlike an executor's),
    so that the caller can stop waiting for one that blocks. The hand-off is a `SimpleQueue` and
    a plain lock per call (about 17 µs against 42 µs for `Queue` + `Event` on the CI machine):
    it sits in every control-plane collective.

    The thread is kept on the core its caller runs on (`_SameCore`): the caller sleeps while the
    call runs, so both hand-offs become a switch on one core instead of a wake-up of another, idle
    one (35-71 µs less per barrier than a thread left where the scheduler puts it, side by side
    in benchmarks/collectives.py on the 2-core CI VM)."""

    def __init__(self) -> None:
        self._work: "queue.SimpleQueue" = queue.SimpleQueue()
        started = threading.Event()
        self._core = _SameCore()
        threading.Thread(target=self._run, args=(started,), name="unified-jax-call", daemon=True).start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        self._core.thread_id = threading.get_native_id()
        started.set()
        while True:
            call, done, outcome = self._work.get()
            try:
                outcome.append((True, call()))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                outcome.append((False, err))
            done.release()

    def call(self, call: Any, seconds: float) -> Any:
        self._core.follow_caller()
        done, outcome = threading.Lock(), []
        done.acquire()
        self._work.put((call, done, outcome))
        if not done.acquire(timeout=seconds):
            raise _NoAnswer()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


class _SameCore:
    """Keeps one thread on the core the calling thread runs on (Linux; elsewhere it does nothing).
    A caller that moved to another core moves the thread with it at its next call; a core the
    process may not use is never chosen, since the caller runs on it."""

    def __init__(self) -> None:
        self.thread_id: Optional[int] = None
        self._core: Optional[int] = None
        self._current_core = _current_core_function()

    def follow_caller(self) -> None:
        if self._current_core is None or self.thread_id is None:
            return
        core = self._current_core()
        if core != self._core and core >= 0:
            try:
                os.sched_setaffinity(self.thread_id, {core})
                self._core = core
            except OSError:  # a core taken away meanwhile (cgroup change): leave the thread where it is
                self._current_core = None


def _current_core_function() -> Optional[Any]:
    """``sched_getcpu`` of the C library (a vDSO call, well under a microsecond), or None."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return None
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    function.restype, function.argtypes = ctypes.c_int, []
    return function


class _KeyValueChannel:
    """The watchdog's channel: keys under ``prefix`` in the coordination service."""

    def __init__(self, client: Any, prefix: str) -> None:
        self._client, self._prefix = client, prefix
        address = ProcessEnvironment.from_env().coordinator
        self.where = f"the coordination service at {address} (process 0's machine)" if address else None

    def post(self, name: str, value: str) -> None:
        self._client.key_value_set(self._prefix + name, value, allow_overwrite=True)

    def read(self) -> Dict[str, str]:
        return {key.rsplit(self._prefix, 1)[-1]: value for key, value in self._client.key_value_dir_get(self._prefix)}


class JaxControlPlane:
    """The control plane of `JaxBackend` (``barrier``, ``any_flag``, ``all_gather_bytes``,
    ``broadcast_bytes``, the health channel), over the coordination client ``self._client``."""

    def health_channel(self) -> Optional["_KeyValueChannel"]:
        return _KeyValueChannel(self._client, f"{self._prefix}health/") if self._client is not None else None

    # -- control plane --------------------------------------------------------------------------
    def _timeout_error(self, key: str, timeout: float, err: Exception, missing: Optional[List[int]]) -> Exception:
        return timeout_error(self, key, timeout, err, missing, "jax coordination service")

    def _answered(self, call: Any, key: str, timeout: float) -> Any:
        """``call()``, bounded: the coordination client's calls carry no deadline of their own on
        the wire, so on a machine that lost its link to the service they block for good."""
        if self._calls is None:
            self._calls = _Caller()
        try:
            return self._calls.call(call, timeout + _SERVICE_MARGIN_S)
        except _NoAnswer:
            address = ProcessEnvironment.from_env().coordinator or "?"
            err = TimeoutError(f"the coordination service at {address} (process 0's machine) did not answer "
                               f"within {timeout + _SERVICE_MARGIN_S:g}s: this machine may have lost its network "
                               "link to it")
            raise self._timeout_error(key, timeout, err, None) from None

    def barrier(self, key: str, timeout: float) -> None:
        self._meet(self._prefix + key, key, timeout)
        self._drop_stale_keys()

    def _meet(self, name: str, key: str, timeout: float, process_ids: Optional[List[int]] = None) -> bool:
        """Wait at barrier ``name``; True if it failed because a process flagged it (see the module docstring)."""
        try:
            self._answered(lambda: self._client.wait_at_barrier(name, int(timeout * 1000), process_ids), key, timeout)
        except DistributedError:
            raise
        except Exception as err:  # JaxRuntimeError: DEADLINE_EXCEEDED or a lost coordinator
            if is_flagged(err):
                return True
            raise self._timeout_error(key, timeout, err, _missing_from_message(str(err))) from err
        return False

    def _drop_stale_keys(self) -> None:
        """Delete keys this process wrote before the barrier just passed: everyone has read them."""
        for stale in self._stale_keys:
            try:
                self._client.key_value_delete(stale)
            except Exception:
                pass
        self._stale_keys.clear()

    def any_flag(self, flag: bool, key: str, timeout: float) -> bool:
        """One barrier whose outcome carries the flag (see the module docstring): a single round trip
        of the coordination service when no process is flagged."""
        if not supported():
            return self._any_flag_two_trips(flag, key, timeout)
        name = f"{self._prefix}flag"  # one id for every call: see the module docstring on counters
        if not self._flag_primed:
            self._meet(name, f"{key} (first flag)", timeout)
            self._flag_primed = True
        ids = flagged_process_ids(self.num_processes, self.process_index) if flag else None
        if not self._meet(name, key, timeout, ids):
            if flag:  # the service accepted the conflicting list: the others answered False
                raise DistributedError(
                    f"{key}: the JAX coordination service let a flagged process pass the trigger's barrier, so the "
                    "processes disagree on the answer; this jax release changed the behaviour unified relies on."
                    + see("jax-flag-barrier"))
            self._drop_stale_keys()
            return False
        self.barrier(f"{key} (flag seen)", timeout)  # nobody moves on before everyone saw it
        return True

    def _any_flag_two_trips(self, flag: bool, key: str, timeout: float) -> bool:
        """Flags as keys set before a barrier and read after it (jax releases not checked with the flag barrier)."""
        directory = f"{self._prefix}flag/{key}/"
        if flag:
            mine = f"{directory}{self.process_index}"
            self._answered(lambda: self._client.key_value_set(mine, "1"), key, timeout)
        self.barrier(key, timeout)
        if flag:
            self._stale_keys.append(mine)
            return True
        return bool(self._client.key_value_dir_get(directory))

    def _get_bytes(self, name: str, owner: int, key: str, timeout: float) -> bytes:
        try:
            return self._answered(lambda: self._client.blocking_key_value_get_bytes(name, int(timeout * 1000)),
                                  key, timeout)
        except DistributedError:
            raise
        except Exception as err:
            raise self._timeout_error(key, timeout, err, [owner]) from err

    def all_gather_bytes(self, data: bytes, key: str, timeout: float) -> List[bytes]:
        directory = f"{self._prefix}bytes/{key}/"
        mine = f"{directory}{self.process_index}"
        self._client.key_value_set_bytes(mine, data)
        self._stale_keys.append(mine)
        return [data if r == self.process_index else self._get_bytes(f"{directory}{r}", r, key, timeout)
                for r in range(self.num_processes)]

    def broadcast_bytes(self, data: Optional[bytes], src: int, key: str, timeout: float) -> bytes:
        name = f"{self._prefix}bytes/{key}"
        if self.process_index == src:
            self._client.key_value_set_bytes(name, data or b"")
            self._stale_keys.append(name)
            return data or b""
        return self._get_bytes(name, src, key, timeout)
