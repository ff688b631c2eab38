"""The coordination-service behaviour behind the JAX `check_trigger` (backends/jax/control.py).

A real service (recoverable, as the launcher hosts it) and two clients run in a child process
(threads; a JAX runtime that aborts at exit cannot take pytest with it), which reports what
each client saw. If a jax release changes the behaviour, these tests say which part.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_MS = 3000


def _child(port: int) -> None:
    sys.path.insert(0, str(REPO))
    from jax._src.lib import _jax

    from backends.jax.control import flagged_process_ids, is_flagged

    address = f"127.0.0.1:{port}"
    # held by a name although unused: the service stops when its last reference goes
    _service = _jax.get_distributed_runtime_service(address, 2, heartbeat_timeout=100, shutdown_timeout=5,
                                                    recoverable=True)
    clients = [_jax.get_distributed_runtime_client(address, i, init_timeout=30, heartbeat_timeout=100)
               for i in range(2)]
    joins = [threading.Thread(target=c.connect) for c in clients]
    for t in joins:
        t.start()
    for t in joins:
        t.join()

    def one(rank, flagged, delay, out, timeout_ms):
        time.sleep(delay)
        ids = flagged_process_ids(2, rank) if flagged else None
        start = time.monotonic()
        try:
            clients[rank].wait_at_barrier("unified/test/flag", timeout_ms, ids)
            outcome = "passed"
        except Exception as err:  # noqa: BLE001 - reported to the parent
            outcome = "flagged" if is_flagged(err) else "error: " + str(err).splitlines()[0][:200]
        out[rank] = [outcome, round(time.monotonic() - start, 3)]

    def call(flags, delays, timeout_ms=TIMEOUT_MS):
        out = {}
        threads = [threading.Thread(target=one, args=(r, flags[r], delays[r], out, timeout_ms)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [out[0], out[1]]

    report = {
        "prime": call([False, False], [0, 0.1]),
        "flag_first": call([True, False], [0, 0.3]),  # the flag fails it before the other arrives
        "flag_last": call([False, True], [0, 0.3]),  # ... while the other waits
        "both": call([True, True], [0, 0.3]),
        "none": call([False, False], [0.3, 0]),
        "timeout": call([False, False], [0, 3.5], timeout_ms=1000),  # the second arrives well after the deadline
        "healthy_after": call([True, False], [0.2, 0]),
        "healthy_after_none": call([False, False], [0, 0.2]),
    }
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)  # no destructors: the service and clients go with the process


@pytest.fixture(scope="module")
def seen():
    pytest.importorskip("jax")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, __file__, str(port)], capture_output=True, text=True, timeout=120,
                          cwd=str(REPO))
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, f"the child reported nothing (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}"
    return json.loads(lines[-1][len("REPORT "):])


def _outcomes(rows):
    return [row[0] for row in rows]


def test_unflagged_barrier_passes(seen):
    assert _outcomes(seen["prime"]) == ["passed", "passed"]
    assert _outcomes(seen["none"]) == ["passed", "passed"]


def test_a_flag_fails_the_barrier_for_every_caller_whatever_the_order(seen):
    for case in ("flag_first", "flag_last", "both", "healthy_after"):
        assert _outcomes(seen[case]) == ["flagged", "flagged"], (
            f"{case}: {seen[case]}. This jax release no longer fails a barrier called with different participant "
            "lists for every caller (a late caller must get the stored result): backends/jax/control.py "
            "cannot carry the trigger; make control.supported() exclude this release.")
    # A flagged caller that came first does not wait for the others.
    assert seen["flag_first"][0][1] < 0.25, seen["flag_first"]


def test_a_timeout_is_not_taken_for_a_flag_and_the_service_stays_usable(seen):
    first, late = seen["timeout"]
    assert first[0].startswith("error: DEADLINE_EXCEEDED"), seen["timeout"]
    assert late[0].startswith("error:") and late[1] < 0.5, (
        f"the late caller should get the stored timeout at once: {seen['timeout']}")
    assert _outcomes(seen["healthy_after_none"]) == ["passed", "passed"], seen


if __name__ == "__main__":
    _child(int(sys.argv[1]))
