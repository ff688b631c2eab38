"""A third backend from outside: `tests/plugin/unified_numpy_backend` (NumPy arrays, its control plane
over a TCP key-value store) is registered only through the ``unified.backends`` entry-point group
of its ``.dist-info`` folder, and passes the conformance suite's process-control and checkpoint
and evaluation scenarios on 2 processes, with no edit under ``unified/`` or ``tests/conformance/``."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import unified.registry as registry
from unified import Accelerator

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "tests" / "plugin"


@pytest.fixture
def plugin_installed(monkeypatch):
    """The plugin's folder on sys.path (its dist-info is then found as an installed package)."""
    monkeypatch.syspath_prepend(str(PLUGIN))
    registry._registry.cache_clear()
    yield
    registry._registry.cache_clear()


def test_the_entry_point_registers_the_backend(plugin_installed):
    assert "numpy" in registry.backend_names() and "numpy" in registry.available_backends()
    acc = Accelerator(backend="numpy", seed=3)
    assert acc.backend == "numpy" and acc.num_processes == 1
    assert acc.reduce(acc._backend.from_numpy([1.0, 2.0]), "sum").tolist() == [1.0, 2.0]
    with pytest.raises(NotImplementedError, match="KeyStream"):
        acc.next_key()


@pytest.mark.multiprocess
def test_a_backend_from_outside_passes_the_conformance_scenarios():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PLUGIN), str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/conformance/test_process_group.py", "tests/conformance/test_checkpoint.py",
         "tests/conformance/test_metrics.py", "tests/conformance/test_resize.py", "-k", "numpy and not numpy-3", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    summary = re.search(r"(\d+) passed", run.stdout)
    # every process-control test at 2 processes, every checkpoint test but the JAX-only Orbax one,
    # the evaluation tests (its profile leaves out the torch DataLoader scenarios)
    assert summary and int(summary.group(1)) >= 22 and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-3000:]
