"""Scenario functions of the conformance suite, written once for every backend.

Each takes the per-process ``state`` dict (``state["acc"]`` is the Accelerator) and returns
JSON-serialisable observations; tests in the parent assert across processes. Scenarios that
break the group (a dead or stuck process) must come last in a run.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np

import unified
from unified import Accelerator
from unified.testing.scenario import scenario

SLOW_MAIN_S = 0.4


@scenario
def start(state: dict) -> dict:
    acc = Accelerator(timeout=60)
    state["acc"] = acc
    return {"ok": True}


@scenario
def identity(state: dict) -> dict:
    acc = state["acc"]
    return {
        "backend": acc.backend, "process_index": acc.process_index, "num_processes": acc.num_processes,
        "local_process_index": acc.local_process_index, "is_main_process": acc.is_main_process,
        "is_local_main_process": acc.is_local_main_process, "is_last_process": acc.is_last_process,
        "distributed_type": str(acc.distributed_type), "device": str(acc.device), "pid": os.getpid(),
    }


@scenario
def barrier_order(state: dict) -> dict:
    acc = state["acc"]
    acc.wait_for_everyone()  # start together, so that the sleeps below stagger the arrivals
    time.sleep(0.15 * acc.process_index)
    arrive = time.time()
    acc.wait_for_everyone()
    return {"arrive": arrive, "leave": time.time()}


def _ordered(state: dict, context: str, goes_first: bool) -> dict:
    acc = state["acc"]
    with getattr(acc, context)():
        enter = time.time()
        if goes_first:
            time.sleep(SLOW_MAIN_S)
        body_exit = time.time()
    return {"enter": enter, "body_exit": body_exit, "leave": time.time(), "first": goes_first}


@scenario
def main_first_order(state: dict) -> dict:
    return _ordered(state, "main_process_first", state["acc"].is_main_process)


@scenario
def local_main_first_order(state: dict) -> dict:
    return _ordered(state, "local_main_process_first", state["acc"].is_local_main_process)


@scenario
def trigger(state: dict) -> dict:
    acc = state["acc"]
    quiet = acc.check_trigger()
    if acc.is_last_process:
        acc.set_trigger()
    fired = acc.check_trigger()
    after_reset = acc.check_trigger()
    return {"quiet": quiet, "fired": fired, "after_reset": after_reset}


@scenario
def trigger_late_peer(state: dict) -> dict:
    """Process 0 sets the trigger and checks at once; the last process checks a second later.
    Everyone gets True in that call (also the one that arrives after the flag is known), and the
    next two checks, one right away and one with the last process late again, are quiet."""
    acc = state["acc"]
    if acc.is_main_process:
        acc.set_trigger()
    if acc.is_last_process:
        time.sleep(1.0)
    fired = acc.check_trigger()
    again = acc.check_trigger()
    if acc.is_last_process:
        time.sleep(1.0)
    quiet = acc.check_trigger()
    return {"fired": fired, "again": again, "quiet": quiet}


@scenario
def collectives(state: dict) -> dict:
    acc = state["acc"]
    rank = acc.process_index
    gathered = acc.gather({"rows": np.array([rank, rank], dtype=np.int32), "scalar": np.float32(rank)})
    summed = acc.reduce({"v": np.array([1.0, rank], dtype=np.float32)}, "sum")
    mean = acc.reduce(np.array([float(rank)], dtype=np.float32), "mean")
    sent = acc.broadcast([np.full((2,), 10 + rank, dtype=np.int64)], from_process=acc.num_processes - 1)
    return {
        "gather_rows": np.asarray(gathered["rows"]).tolist(),
        "gather_scalar": np.asarray(gathered["scalar"]).tolist(),
        "sum": np.asarray(summed["v"]).tolist(),
        "mean": np.asarray(mean).tolist(),
        "broadcast": np.asarray(sent[0]).tolist(),
        "objects": acc.gather_object({"rank": rank}),
        "framework_arrays": all(acc._backend.is_array(v) for v in (gathered["rows"], summed["v"], mean, sent[0])),
    }


@scenario
def main_first_exception(state: dict) -> dict:
    acc = state["acc"]
    caught = None
    start_t = time.time()
    try:
        with acc.main_process_first():
            if acc.is_main_process:
                raise ValueError("boom in main body")
    except ValueError as err:
        caught = f"ValueError: {err}"
    except unified.DistributedError as err:
        caught = f"DistributedError: {err}"
    elapsed = time.time() - start_t
    acc.wait_for_everyone(timeout=20)  # the group is still usable afterwards
    return {"caught": caught, "elapsed": elapsed}


@scenario
def dead_at_barrier(state: dict) -> dict:
    """The last process dies (SIGKILL); the others must raise BarrierTimeout quickly."""
    acc = state["acc"]
    if acc.is_last_process:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    return _expect_barrier_timeout(acc, timeout=15)


@scenario
def stuck_at_barrier(state: dict) -> dict:
    """The last process is alive but never arrives; the others time out naming it, and the
    watchdog then ends it with their reason (its sleep never finishes)."""
    acc = state["acc"]
    if acc.is_last_process:
        time.sleep(8)
        return {"stuck": True, "exit_at": time.time()}
    return _expect_barrier_timeout(acc, timeout=3)


def _expect_barrier_timeout(acc: Accelerator, timeout: float) -> dict:
    start_t = time.monotonic()
    try:
        acc.wait_for_everyone(timeout=timeout)
        outcome = {"raised": None}
    except unified.BarrierTimeout as err:
        outcome = {"raised": "BarrierTimeout", "missing": err.missing, "message": str(err),
                   "is_timeout_error": isinstance(err, TimeoutError)}
    outcome["elapsed"] = time.monotonic() - start_t
    outcome["exit_at"] = time.time()
    return outcome


def _shared(*parts: str) -> str:
    return os.path.join(os.environ["UNIFIED_TEST_SHARED"], *parts)
