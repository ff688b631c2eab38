"""The examples run end to end under the launcher: examples/digits.py trains, checkpoints and resumes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import BACKENDS

pytest.importorskip("sklearn")
ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits.py"


def _launch_digits(backend, *args):
    run = subprocess.run([sys.executable, "-m", "unified", "launch", "-n", "2", "--backend", backend,
                          "--mixed-precision", "bf16", str(DIGITS),
                          *args], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    return run.stdout + run.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", BACKENDS)
def test_digits_trains_checkpoints_and_resumes(backend, tmp_path):
    project = str(tmp_path / "digits")
    # with the training loop's features on: bf16, 2 micro-batches per step, clipping
    loop = ["--grad-accum", "2", "--max-grad-norm", "1.0"]
    _launch_digits(backend, "--project-dir", project, "--max-steps", "30", "--save-every", "10", *loop)
    checkpoints = tmp_path / "digits" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert (tmp_path / "digits" / "final" / "model.safetensors").is_file()

    output = _launch_digits(backend, "--project-dir", project, "--resume", "--max-steps", "40", *loop)
    assert "resumed from checkpoint_2 at step 30" in output, output
    assert "step 40: saved the final model" in output, output
