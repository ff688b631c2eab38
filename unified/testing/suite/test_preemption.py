"""Conformance: preemption as a coordinated checkpoint, through `unified launch`, on every backend
with 2 and 3 processes.

One chain of runs per (backend, size), each run a real launch that ends as a preempted job ends:
SIGTERM to process 0 at step 3, SIGUSR2 to the last process at step 6, SIGTERM to the launcher at
step 8, then a run to the end (step 10), each resuming from the previous one's checkpoint. Every
launch may restart once (``--max-restarts 1``), and no preempted run is restarted. Every
launch names its preemption signals, ``--preemption-signals SIGTERM,SIGUSR2`` (submitit's), which
the workers' Accelerators take from the launcher, so a configured signal is tested beside the
default SIGTERM (SIGUSR1, the other default, in tests/unit/test_preemption.py). An
uninterrupted run of 10 steps is the reference. Every preempted run must stop at the signalled
step on every process, commit exactly one checkpoint of that step, exit through
``exit_if_preempted`` (no process killed by the signal) and make the launcher exit with
``unified.PREEMPTED_EXIT_CODE``; the last run must reach the reference's parameters bit for bit.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

import unified
from unified.testing.plugin import selected_backends

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc")]
SCRIPT = Path(__file__).resolve().parents[1] / "preemption_run.py"
STEPS = 10
# (tag, step, signal, whom): whom is a process index ("last": the last one) or "launcher"
CHAIN = [("to-first", 3, signal.SIGTERM, "0"), ("to-last", 6, signal.SIGUSR2, "last"),
         ("to-launcher", 8, signal.SIGTERM, "launcher")]
LAUNCH_DEADLINE = 240


def _launch(backend: str, size: int, shared: Path, tag: str, *args: str) -> subprocess.Popen:
    log = open(shared / f"{tag}.log", "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", "unified", "launch", "-n", str(size), "--backend", backend,
                                 "--grace-period", "60", "--preemption-signals", "SIGTERM,SIGUSR2",
                                 "--max-restarts", "1", str(SCRIPT), str(shared), tag, "--steps", str(STEPS), *args],
                                cwd=shared, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def _wait(proc: subprocess.Popen, shared: Path, tag: str) -> int:
    try:
        return proc.wait(timeout=LAUNCH_DEADLINE)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"run {tag!r} did not end\n{_log(shared, tag)}")


def _log(shared: Path, tag: str) -> str:
    return (shared / f"{tag}.log").read_text(errors="replace")[-6000:]


def _results(shared: Path, tag: str, size: int) -> List[dict]:
    found = []
    for rank in range(size):
        path = shared / f"{tag}-result-{rank}.json"
        assert path.exists(), f"process {rank} of {tag!r} wrote no result\n{_log(shared, tag)}"
        found.append(json.loads(path.read_text()))
    return found


def _signalled_run(backend: str, size: int, shared: Path, tag: str, step: int, sig: int, whom: str) -> Dict:
    target = str(size - 1) if whom == "last" else whom
    launcher = _launch(backend, size, shared, tag, "--signal-at", str(step),
                       "--expect-signal", "all" if whom == "launcher" else target)
    ready = [shared / f"{tag}-ready-{rank}" for rank in range(size)]
    deadline = time.monotonic() + LAUNCH_DEADLINE
    while not all(path.exists() for path in ready):
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            pytest.fail(f"run {tag!r} never reached step {step}\n{_log(shared, tag)}")
        time.sleep(0.02)
    pid = launcher.pid if whom == "launcher" else int(ready[int(target)].read_text())
    sent_at = time.time()
    os.kill(pid, sig)
    (shared / f"{tag}-go").write_text("go")
    code = _wait(launcher, shared, tag)
    listing = sorted(os.listdir(shared / "project" / "checkpoints"))
    return {"code": code, "results": _results(shared, tag, size), "listing": listing, "sent_at": sent_at,
            "log": _log(shared, tag)}


# A chain is five launches: each backend runs it at one size, the sizes alternating over the
# backends (torch with 2 processes, JAX with 3), so that both sizes and both backends are covered
# within CI's time (the signal handling does not depend on the size; the launcher's forwarding to
# every worker and the all-reduce of the flag are what the other size adds).
@pytest.fixture(scope="module")
def chain(backend, tmp_path_factory):
    size = (2, 3)[selected_backends().index(backend) % 2]
    reference_dir = tmp_path_factory.mktemp(f"reference-{backend}-{size}")
    reference = _launch(backend, size, reference_dir, "reference")
    reference_code = _wait(reference, reference_dir, "reference")
    shared = tmp_path_factory.mktemp(f"preempted-{backend}-{size}")
    runs = {tag: _signalled_run(backend, size, shared, tag, step, sig, whom) for tag, step, sig, whom in CHAIN}
    last = _launch(backend, size, shared, "to-the-end")
    last_code = _wait(last, shared, "to-the-end")
    return {"size": size, "reference": (reference_code, _results(reference_dir, "reference", size),
                                        _log(reference_dir, "reference")),
            "runs": runs, "last": (last_code, _results(shared, "to-the-end", size), _log(shared, "to-the-end"))}


def test_every_process_stops_at_the_signalled_step_and_the_launcher_says_preempted(chain):
    previous_step = 0
    for number, (tag, step, _, _) in enumerate(CHAIN):
        run = chain["runs"][tag]
        assert run["code"] == unified.PREEMPTED_EXIT_CODE, f"{tag}: exit {run['code']}\n{run['log']}"
        for rank, result in enumerate(run["results"]):
            assert result["preempted"] and result["stopped"] == step, (tag, rank, result)
            assert result["start"] == previous_step, (tag, rank, result)  # resumed from the previous run's save
            assert result["saved"] == f"checkpoint_{number}", (tag, rank, result)
        assert len({r["hash"] for r in run["results"]}) == 1, tag  # one state, saved at one step
        assert "starting the group again" not in run["log"], run["log"]  # a preemption is not a failure
        # no worker crashed (torchrun itself prints its ChildFailedError summary for the exit codes 75)
        assert not [line for line in run["log"].splitlines() if line[:1] == "[" and line[1:2].isdigit()
                    and "Traceback" in line], run["log"]
        previous_step = step


def test_one_complete_checkpoint_per_preemption(chain):
    for number, (tag, _, _, _) in enumerate(CHAIN):
        listing = chain["runs"][tag]["listing"]
        assert listing == [f"checkpoint_{i}" for i in range(number + 1)], (tag, listing)  # no temporaries


def test_the_resumed_run_reaches_the_uninterrupted_parameters(chain):
    reference_code, reference, reference_log = chain["reference"]
    last_code, last, last_log = chain["last"]
    assert reference_code == 0, reference_log
    assert last_code == 0, last_log
    assert all(not r["preempted"] and r["steps"] == STEPS for r in reference + last)
    assert all(r["start"] == CHAIN[-1][1] for r in last)
    assert [r["hash"] for r in last] == [r["hash"] for r in reference]
