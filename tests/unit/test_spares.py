"""`unified.launcher.processes.Spares`: under --max-restarts the next attempt's slow-starting worker (torchrun)
is started ahead, and a restart hands it its arguments instead of starting a new process. Here a
spare is a small Python program that reads its order and prints it: the group's output comes from
the spare (not from the worker's own command) with the worker's environment; a spare that died
before the restart is replaced by the worker's own command; unused spares are killed."""
from __future__ import annotations

import os
import sys
import time

from unified.launcher.processes import Spares, Worker, run_group_outcome

SPARE = """
import json, os, sys
order = json.loads(sys.stdin.readline())
parent_ok = order["env"]["UNIFIED_PARENT_PID"] == str(os.getppid())  # the launcher started it
print("warm", order["args"], order["env"]["MARK"], "parent_ok" if parent_ok else "parent?", flush=True)
"""


def _worker() -> Worker:
    return Worker([sys.executable, "-c", "print('cold', flush=True)"], {**os.environ, "MARK": "attempt-2"},
                  spare=([sys.executable, "-c", SPARE], ["--the", "args"]))


def _started(spares: Spares, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with spares._lock:
            ready = list(spares._ready.values())
        if ready:
            return ready[0]
        time.sleep(0.02)
    raise AssertionError("no spare started")


def test_a_restart_takes_the_spare_and_hands_it_the_worker_s_arguments_and_environment(capfd):
    spares = Spares()
    try:
        spares.prepare([_worker()], delay=0.0)
        spare = _started(spares)
        code, outcome = run_group_outcome([_worker()], spares=spares)
        out = capfd.readouterr().out
        assert (code, outcome) == (0, "finished")
        assert "warm ['--the', 'args'] attempt-2 parent_ok" in out and "cold" not in out, out
        assert spare.poll() == 0 and spares.take(_worker().spare[0]) is None  # taken once
    finally:
        spares.close()


def test_a_spare_that_died_is_replaced_by_the_worker_s_own_command(capfd):
    spares = Spares()
    try:
        spares.prepare([_worker()], delay=0.0)
        spare = _started(spares)
        spare.kill()
        spare.wait()
        code, _ = run_group_outcome([_worker()], spares=spares)
        out = capfd.readouterr().out
        assert code == 0 and "cold" in out and "warm" not in out, out
    finally:
        spares.close()


def test_unused_spares_are_killed_and_none_starts_after_close():
    spares = Spares()
    spares.prepare([_worker()], delay=0.0)
    spare = _started(spares)
    spares.prepare([_worker()], delay=0.3)  # a later attempt's, not yet started
    spares.close()
    assert spare.poll() is not None
    time.sleep(0.6)
    assert spares._ready == {}
