"""A torch job that ends without `end_training` leaves its process group in an exit hook while
the interpreter is still whole (a group left to finalization can abort the process with
"terminate called without an active exception"), except after an uncaught exception, when a
peer may still be inside a collective with it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess


def test_a_normal_exit_leaves_the_group_and_an_uncaught_exception_does_not(tmp_path):
    run = subprocess.run([sys.executable, "-m", "unified", "launch", "-n", "2", "--backend", "torch",
                          str(ROOT / "tests" / "scripts" / "exit_hook.py"), str(tmp_path / "left")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert "[0] group at exit: left" in out, out[-4000:]
    assert "[1] group at exit: still there" in out, out[-4000:]
    assert "an uncaught error on process 1" in out and run.returncode != 0, out[-4000:]
    assert "terminate called" not in out, out[-4000:]
