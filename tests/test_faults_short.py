"""The fault trials (tests/faults/) in CI mode: every fault row must pass 100% on every installed backend.

Rows 3 and 4 (damaged and hostile checkpoints), 5 damaged copies: the conformance suite checks
every row's promise on its own (test_process_group's lost process, test_checkpoint's crash
during save, damaged and hostile checkpoints and full disk, test_resize, test_preemption,
test_multihost_netns); here the trials themselves must run and agree, in the time of their two
fastest rows, on the first installed backend (CI's time: the rows' promises are checked on every
backend by the suite). `python -m tests.faults` runs 20 trials per row (docs/benchmarks/faults.md).

What it guarantees on a loaded machine: the planned faults happen as planned (before a planned
kill the collectives wait up to 60 s, so a slow peer is not mistaken for the fault), and after
the fault every survivor raises within the trial's timeout + 2 s.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import BACKENDS

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not BACKENDS, reason="neither torch nor jax is installed")
def test_fault_benchmark_short_mode_passes_every_row():
    run = subprocess.run([sys.executable, "-m", "tests.faults", "--short", "--no-picture", "--rows", "3,4",
                          "--damage-cases", "5", "--seed", "11", "--backends", BACKENDS[0]],
                         cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-12000:]
    assert "FAILED" not in run.stdout, run.stdout[-12000:]
