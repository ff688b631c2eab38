"""MLflow's local SQLite store is whole before MLflow opens it. MLflow builds a new store by running
its schema migrations one by one (8 s on this machine under load); two processes opening a store
still being built both migrated it and one failed with ``sqlite3.OperationalError: table ...
already exists``. Seen in tests/test_restarts.py on a loaded machine: a ``--max-restarts`` job whose
process 0 failed so on every attempt, and gave up."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mlflow")

START = textwrap.dedent("""
    import sys, time
    from unified.tracking import MLflowTracker
    tracker = MLflowTracker(experiment_name=sys.argv[2], logging_dir=sys.argv[1])
    while time.time() < float(sys.argv[3]):  # both start building the store at the same moment
        time.sleep(0.001)
    tracker.start()
    tracker.log({"loss": 1.0}, step=1)
    tracker.finish()
    print("started", tracker.tracking_uri)
""")


def test_two_processes_starting_on_a_new_store_at_once_both_start(tmp_path):
    import time

    logs = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    at = str(time.time() + 5)  # after both have imported unified and MLflow
    runs = [subprocess.Popen([sys.executable, "-c", START, str(logs), f"exp{i}", at], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err[-3000:]
        assert "started sqlite:///" in out
    assert sorted(p.name for p in logs.iterdir() if p.name.startswith("mlflow.db")) == ["mlflow.db"]
