"""`python -m benchmarks.gpu_check` (issue 27) stays runnable where no GPU is: without a device it says so
in one line and exits 0; with ``--allow-cpu`` its timing parts run end to end on CPU and print the
table (every load in them is checked)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "benchmarks.gpu_check"]


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="a CUDA device is here: the check would run for real")
def test_without_a_device_it_skips_in_one_line_and_exits_0():
    done = subprocess.run(COMMAND, capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("gpu_check: no CUDA device"), done.stdout


def test_its_timing_parts_run_on_cpu(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    done = subprocess.run([*COMMAND, "--allow-cpu", "--skip-tests", "--gb", "0.005", "--hidden", "128",
                           "--repeats", "1", "--doc", str(tmp_path / "gpu.md")],
                          capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    text = (tmp_path / "gpu.md").read_text()
    for row in ("| unified | save |", "| unified | async blocked |", "| unified | load |",
                "| raw copy + write + fsync | save |"):
        assert text.count(row) == 2, (row, text)  # torch and JAX
    assert "| orbax" in text
