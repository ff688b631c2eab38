"""torch's control plane, mixed into `TorchBackend`: barriers, flags and small bytes over a gloo
group, each wait bounded by the Accelerator's timeout; a failed collective names the processes that
did not arrive through arrival notes in the rendezvous store (torchrun's agent hosts it), which
also carries the watchdog's channel."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from unified.backend.toolkit import keep_alive_forever, timeout_error
from unified.errors import DistributedError, first_line, see
from unified.runtime.watchdog import CHANNEL_KINDS

__all__ = ["TorchControlPlane"]

# A wait that has not finished after this long publishes the process's arrival in the
# rendezvous store, so that a timeout can name the processes that never arrived.
_ARRIVAL_PROBE_S = 1.0
# how long `_wait` polls a collective (yielding the core between polls) before it sleeps on an event
_SPIN_S = 0.002
_yield_core = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))
# After a peer's disconnection, how long survivors wait for each other's arrival notes.
_DIAGNOSE_GRACE_S = 2.0
# How long a failed collective waits for the rendezvous store's answer about who arrived.
_STORE_ANSWER_S = 2.0


class _StoreChannel:
    """The watchdog's channel: keys in the rendezvous store (hosted by torchrun's agent)."""

    def __init__(self, store: Any, size: int) -> None:
        self._store, self._size = store, size
        self.where = (f"the rendezvous store at {os.environ.get('MASTER_ADDR', '?')}:"
                      f"{os.environ.get('MASTER_PORT', '?')} (process 0's machine)")

    def post(self, name: str, value: str) -> None:
        self._store.set(name, value)

    def read(self) -> Dict[str, str]:
        names = [f"{kind}/{rank}" for kind in CHANNEL_KINDS for rank in range(self._size)]
        present = [name for name in names if self._store.check([name])]  # get() would block on a missing key
        return {name: value.decode() for name, value in zip(present, self._store.multi_get(present))} if present else {}


class TorchControlPlane:
    """The control plane of `TorchBackend` (``barrier``, ``any_flag``, ``all_gather_bytes``,
    ``broadcast_bytes``, the health channel), the timed waits its collectives share (the array
    collectives' too) and the diagnosis of a failed collective (``peer_errors`` for DDP's)."""

    def health_channel(self) -> Optional["_StoreChannel"]:
        if self._store is None:
            return None
        return _StoreChannel(dist.PrefixStore(f"health/{self._instance}/", self._store), self.num_processes)

    # -- timed waiting ----------------------------------------------------------------------------
    def _wait(self, work: Any, key: str, timeout: float) -> None:
        """Wait for ``work``; on timeout or a lost peer raise `BarrierTimeout` naming the missing.

        For the first _SPIN_S the wait polls ``is_completed()`` and gives the core away between
        polls (``sched_yield``, so that gloo's own thread runs even on a busy machine): most
        collectives complete within it, without the 130-160 us that waking from an event costs
        (gloo's thread must take the GIL to run the callback that sets it). A spin that did not
        yield was measured and dropped: it took the core gloo's thread needs (5x a raw barrier on
        2 cores). After that the wait sleeps on an event that the work's future sets when it
        completes (or fails), costing no CPU, rather than calling ``work.wait(timeout=...)``:
        with gloo a timed wait sometimes makes the process abort at exit ("terminate called
        without an active exception"), while an untimed ``wait()`` after completion does not.
        """
        spin_until = time.perf_counter() + min(_SPIN_S, timeout)
        while not work.is_completed():
            if time.perf_counter() >= spin_until:
                break
            _yield_core()
        else:
            self._finish(work, key, timeout)
            return
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())  # set by gloo's thread, failure included
        if not done.wait(min(_ARRIVAL_PROBE_S, timeout)):
            # in a thread: a store out of reach must not block us
            threading.Thread(target=self._publish_arrival, args=(key,), daemon=True).start()
            if not done.wait(max(0.0, timeout - _ARRIVAL_PROBE_S)):
                self._fail(key, timeout, TimeoutError(f"not completed after {timeout:g}s"), grace=0.0)
        self._finish(work, key, timeout)

    def _finish(self, work: Any, key: str, timeout: float) -> None:
        try:
            work.wait()
        except RuntimeError as err:  # a peer died or disconnected
            self._fail(key, timeout, err, grace=_DIAGNOSE_GRACE_S)

    def _publish_arrival(self, key: str) -> None:
        try:
            self._store.set(f"{key}/{self.process_index}", "1")
        except Exception:  # the store may be gone with its host; naming is best effort
            pass

    def _fail(self, key: str, timeout: float, err: Exception, grace: float) -> None:
        self._mark_broken()
        missing, unreachable = self._diagnose(key, grace)
        source = f"{unreachable}; torch.distributed" if unreachable else "torch.distributed"
        raise timeout_error(self, key, timeout, err, missing, source) from err

    def _diagnose(self, key: str, grace: float) -> Tuple[Optional[List[int]], Optional[str]]:
        """After a failed collective: the processes that did not note their arrival at ``key``
        within ``grace`` (`_missing`), or why the store could not be asked."""
        found: Dict[str, Optional[List[int]]] = {}
        # The store lives on the main process's machine: when this machine lost its link to it,
        # every call blocks (for the store's own timeout, minutes). Ask from a thread, wait a bit.
        asking = threading.Thread(target=self._missing, args=(key, grace, found), daemon=True)
        asking.start()
        asking.join(grace + _STORE_ANSWER_S)
        if asking.is_alive():
            address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            return None, (f"the rendezvous store at {address} (process 0's machine) did not answer within "
                          f"{_STORE_ANSWER_S:g}s: this machine may have lost its network link to it")
        return found.get("missing"), None

    def _missing(self, key: str, grace: float, found: Dict[str, Optional[List[int]]]) -> None:
        """The processes that did not publish their arrival at ``key`` (waiting up to ``grace`` for
        late notes), into ``found["missing"]``; nothing when the store cannot be asked."""
        self._publish_arrival(key)
        names = [f"{key}/{rank}" for rank in range(self.num_processes)]
        deadline = time.monotonic() + grace
        while True:
            try:
                missing = [r for r, name in enumerate(names) if not self._store.check([name])]
            except Exception:
                return
            if not missing or time.monotonic() >= deadline:
                found["missing"] = missing or None
                return
            time.sleep(0.05)

    def _mark_broken(self) -> None:
        """Keep the process groups alive forever: their destructors wait for the failed
        collective to finish, which would make this process hang at exit behind a stuck peer."""
        if not self._broken:
            self._broken = True
            keep_alive_forever(*{id(g): g for g in (dist.group.WORLD, self._group) if g is not None}.values())

    # -- control plane --------------------------------------------------------------------------
    def barrier(self, key: str, timeout: float) -> None:
        self._wait(dist.barrier(group=self._group, async_op=True), key, timeout)

    def any_flag(self, flag: bool, key: str, timeout: float) -> bool:
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._wait(dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._group, async_op=True), key, timeout)
        return bool(value.item())

    def all_gather_bytes(self, data: bytes, key: str, timeout: float) -> List[bytes]:
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.num_processes)]
        self._wait(dist.all_gather(sizes, torch.tensor([len(data)]), group=self._group, async_op=True),
                   f"{key} (sizes)", timeout)
        longest = int(max(s.item() for s in sizes))
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.num_processes)]
        self._wait(dist.all_gather(parts, mine, group=self._group, async_op=True), key, timeout)
        return [p[: int(s.item())].numpy().tobytes() for p, s in zip(parts, sizes)]

    def broadcast_bytes(self, data: Optional[bytes], src: int, key: str, timeout: float) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self._wait(dist.broadcast(size, src=src, group=self._group, async_op=True), f"{key} (size)", timeout)
        buffer = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.process_index == src and data:
            buffer[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._wait(dist.broadcast(buffer, src=src, group=self._group, async_op=True), key, timeout)
        return buffer.numpy().tobytes()

    # -- failures inside DDP's own collectives ----------------------------------------------------
    @contextlib.contextmanager
    def peer_errors(self, what: str) -> Iterator[None]:
        """Turn a communication failure inside DDP's own collectives into a `DistributedError`
        naming the processes that did not answer (every process enters ``what`` as often as the
        others, so the n-th entry is the same collective everywhere: its arrival notes, see
        `_diagnose`), or saying that this machine cannot reach process 0's."""
        count = self._peer_calls[what] = self._peer_calls.get(what, 0) + 1
        try:
            yield
        except RuntimeError as err:
            if self.num_processes == 1 or isinstance(err, DistributedError) or not _is_communication_error(err):
                raise
            self._mark_broken()
            # after gloo's own timeout (the Accelerator's) every live peer had the time to note its
            # arrival; a disconnect comes at once, before the other survivors may have noted theirs
            timed_out = "timed out" in str(err).lower()
            missing, unreachable = self._diagnose(f"{what} #{count}", 0.0 if timed_out else _DIAGNOSE_GRACE_S)
            if missing:
                lost = (f"{'process' if len(missing) == 1 else 'processes'} {', '.join(map(str, missing))} did not "
                        "answer (died, frozen or cut off)")
            else:
                lost = unreachable or "a peer process died or disconnected"
            raise DistributedError(
                f"[process {self.process_index}/{self.num_processes}] {what} failed: {lost} (torch.distributed: "
                f"{first_line(err)}). Check the other processes' logs for an earlier error." + see("distributederror")
            ) from err


def _is_communication_error(err: RuntimeError) -> bool:
    text = str(err)
    return isinstance(err, dist.DistError) or any(
        marker in text for marker in ("gloo", "NCCL", "Connection closed", "Connection reset", "Broken pipe"))
