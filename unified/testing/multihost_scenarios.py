"""Scenarios of the multi-host tests (`tests/test_multihost_netns.py`) and of the network rows of
the fault benchmark (`python -m tests.faults`): one `unified launch` per network namespace runs
`worker.py` with UNIFIED_TEST_SCENARIOS="multihost_scenarios,scenarios".

The fault scenarios write ``ready-<process index>`` (pid and time) into the shared folder once
the group works, then loop until the fault (chosen and caused by the parent) makes a collective
raise; they return what was raised and when, and return normally: a script that catches the error
must still exit non-zero, because its group broke.
"""
from __future__ import annotations

import json
import os
import time

import unified
from unified import Accelerator
from unified.testing.scenario import scenario


def _shared(*parts: str) -> str:
    return os.path.join(os.environ["UNIFIED_TEST_SHARED"], *parts)


def _timeout() -> float:
    return float(os.environ.get("MULTIHOST_TIMEOUT", "5"))


def _acc(state: dict, timeout: float) -> Accelerator:
    acc = Accelerator(timeout=timeout, seed=7, project_config=unified.ProjectConfiguration(
        _shared("project"), automatic_checkpoint_naming=True, total_limit=3))
    state["acc"] = acc
    return acc


def _ready(acc: Accelerator) -> None:
    tmp = _shared(f".ready-{acc.process_index}")
    with open(tmp, "w") as handle:
        json.dump({"pid": os.getpid(), "t": time.time()}, handle)
    os.replace(tmp, _shared(f"ready-{acc.process_index}"))


def _raised(err: BaseException, **extra) -> dict:
    return {"raised": type(err).__name__, "unified": isinstance(err, unified.UnifiedError),
            "timeout_error": isinstance(err, TimeoutError), "message": str(err)[:2000], "error_at": time.time(),
            **extra}


@scenario(requires=("TrainingObjects",))
def mh_normal(state: dict) -> dict:
    """Barrier, collectives, save_state and load_state across machines (checkpoint folder shared)."""
    from .training import make

    acc = _acc(state, 60.0)
    acc.wait_for_everyone()
    everyone = acc.gather_object(acc.process_index)
    run = make(acc)
    total = acc.reduce(acc._backend.from_numpy(__import__("numpy").array([acc.process_index + 1.0])), "sum")
    run.step()
    saved_hash = run.param_hash()
    path = acc.save_state()
    run.step()
    moved_hash = run.param_hash()
    loaded = acc.load_state()
    hashes = acc.gather_object(run.param_hash())
    return {"index": acc.process_index, "num": acc.num_processes, "everyone": everyone,
            "sum": float(acc._backend.to_numpy(total)[0]), "saved": path, "loaded": loaded,
            "saved_hash": saved_hash, "moved_hash": moved_hash, "loaded_hashes": hashes,
            "files": sorted(os.listdir(path))}


@scenario
def mh_barrier_loop(state: dict) -> dict:
    """``wait_for_everyone`` back to back until one raises (the parent cuts a link or freezes a process)."""
    acc = _acc(state, _timeout())
    acc.wait_for_everyone(timeout=120)
    _ready(acc)
    calls = 0
    try:
        while True:
            acc.wait_for_everyone()
            calls += 1
    except Exception as err:  # noqa: BLE001 - the observation is what was raised
        return _raised(err, calls=calls)


@scenario(requires=("TrainingObjects",))
def mh_save_loop(state: dict) -> dict:
    """Train a step and ``save_state`` in a loop until one raises; process 0 records the parameter
    hash of every checkpoint it begins (``expected.jsonl``)."""
    from .training import make

    acc = _acc(state, _timeout())
    # Until the first checkpoint, a slow peer (a loaded machine) is no fault: collectives wait 60 s.
    acc._collectives.timeout = 60.0
    run = make(acc)
    saves = 0
    try:
        while True:
            if saves == 1:
                acc._collectives.timeout = _timeout()
            run.step()
            if acc.is_main_process:
                with open(_shared("expected.jsonl"), "a") as handle:
                    handle.write(json.dumps({"iteration": acc.project_configuration.iteration,
                                             "hash": run.param_hash()}) + "\n")
            acc.save_state()
            saves += 1
            if saves == 1:
                acc.wait_for_everyone(timeout=60)
                _ready(acc)
    except Exception as err:  # noqa: BLE001
        return _raised(err, saves=saves)
