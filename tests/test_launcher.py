"""The launcher: rank-prefixed output, failure propagation, multi-machine flags on loopback."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import BACKENDS
from .loopback import launch_machines

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[1]
IDENTITY = ROOT / "tests" / "scripts" / "identity.py"


def _launch(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "unified", "launch", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _results(output):
    found = {}
    for line in output.splitlines():
        match = re.match(r"^\[(\d+)\] RESULT (.*)$", line)
        if match:
            found[int(match.group(1))] = json.loads(match.group(2))
    return found


@pytest.fixture(scope="module", params=BACKENDS)
def identity_run(request):
    """tests/scripts/identity.py launched on 2 processes, output into pipes (once per backend)."""
    return _launch("-n", "2", "--backend", request.param, str(IDENTITY), *SCRIPT_FLAGS)


# the script's own flags, which abbreviate or repeat the launcher's and torchrun's options (issue 46)
SCRIPT_FLAGS = ["--num", "3", "--preempt", "--nnodes=2", "--", "-n", "--max-restarts"]


def test_launch_prefixes_output_with_the_process_index(identity_run):
    run = identity_run
    assert run.returncode == 0, run.stdout + run.stderr
    results = _results(run.stdout)
    assert sorted(results) == [0, 1]
    assert all(r["index"] == i and r["num"] == 2 and r["everyone"] == [0, 1] for i, r in results.items())
    assert all(r["argv"] == SCRIPT_FLAGS for r in results.values()), results  # the script's, untouched
    # the logger: the main-only message once, the per-process one from each process
    assert run.stdout.count("main-only message") == 1
    assert run.stdout.count("every-process message") == 2


def test_progress_bars_in_a_pipe_print_their_first_and_last_state_only(identity_run):
    """Not a line (nor a carriage-return redraw) per update: text mode turns each "\\r" into a line."""
    run = identity_run
    assert run.returncode == 0, run.stdout + run.stderr
    for desc in ("unified-bar", "plain-bar"):
        lines = [line for line in run.stdout.splitlines() if desc in line]
        assert 2 <= len(lines) <= 3, f"{desc}: {len(lines)} lines\n" + "\n".join(lines)
        assert all(line.startswith("[0] ") for line in lines), lines       # the main process only
        assert "| 50/50" in lines[-1] and "| 0/50" in lines[0], lines


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_failure_stops_the_group_with_a_nonzero_exit(backend, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import time, sys, unified\n"
        "acc = unified.Accelerator(timeout=120)\n"
        "if acc.process_index == 1:\n    sys.exit(3)\n"
        "time.sleep(100)\n"
    )
    start = time.monotonic()
    run = _launch("-n", "2", "--backend", backend, str(script), timeout=120)
    assert run.returncode != 0
    assert time.monotonic() - start < 60, "the sleeping process was not stopped"


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_machines_on_loopback(backend):
    runs = launch_machines(2, ["-n", "1", "--backend", backend], [IDENTITY], timeout=180)
    for run in runs:
        assert run.returncode == 0, run.stdout
    outputs = [run.stdout for run in runs]
    results = {**_results(outputs[0]), **_results(outputs[1])}
    assert sorted(results) == [0, 1], outputs
    assert all(r["num"] == 2 and r["local"] == 0 and r["everyone"] == [0, 1] for r in results.values())
    assert 0 in _results(outputs[0]) and 1 in _results(outputs[1])


@pytest.mark.skipif("jax" not in BACKENDS, reason="jax is not installed")
def test_jax_launch_inside_a_slurm_job_uses_the_launcher_values():
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NODELIST": "localhost",
             "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    run = subprocess.run([sys.executable, "-m", "unified", "launch", "-n", "2", "--backend", "jax",
                          str(ROOT / "tests" / "scripts" / "slurm_detection.py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=180, env={**os.environ, **slurm})
    assert run.returncode == 0, run.stdout + run.stderr
    results = _results(run.stdout)
    assert sorted(results) == [0, 1], run.stdout
    assert all(r["num"] == 2 and r["index"] == i and r["detections"] == [] for i, r in results.items()), results


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_machine_whose_processes_caught_a_broken_group_does_not_exit_0(backend, tmp_path):
    """Machine 0's process dies; machine 1's catches the error and exits 0. Its launcher must
    still report the broken group (it used to exit 0: every process it started exited with 0)."""
    script = tmp_path / "broken.py"
    script.write_text(
        "import os, unified\n"
        "acc = unified.Accelerator(timeout=30)\n"
        "if acc.process_index == 0:\n    os._exit(3)\n"
        "try:\n    acc.wait_for_everyone(timeout=20)\n"
        "except unified.DistributedError as err:\n    print('caught', type(err).__name__, flush=True)\n"
    )
    machines = launch_machines(2, ["-n", "1", "--backend", backend], [script], timeout=180)
    outputs = [run.stdout for run in machines]
    assert machines[0].returncode != 0, outputs[0]
    assert machines[1].returncode != 0, outputs[1]
    if "[1] caught" in outputs[1]:  # the process exited 0 itself: the launcher said why it did not
        assert "the process group broke" in outputs[1], outputs[1]


def test_a_main_port_in_use_is_refused_with_its_number(tmp_path):
    """Not a backend's traceback from inside its store or coordinator."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        run = _launch("-n", "1", "--main-process-port", str(port), str(IDENTITY), timeout=60)
    assert run.returncode != 0
    assert f"port {port} on this machine is in use" in run.stderr, run.stderr
    assert "RESULT" not in run.stdout and "Traceback" not in run.stderr, run.stdout + run.stderr
