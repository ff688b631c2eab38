"""A third backend from outside: `tests/plugin/unified_numpy_backend` (NumPy arrays, its control plane
over a TCP key-value store) is registered only through the ``unified.backends`` entry-point group
of its ``.dist-info`` folder, and passes every scenario of the shipped conformance suite
(`unified.testing`) that its capabilities allow, with no edit under ``unified/`` (here in groups of 2
processes where the suite has 2 and 3, for CI's time; `.ci/certify-from-wheel` runs all of it)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import unified.backend.registry as registry
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
def test_a_backend_from_outside_passes_the_shipped_conformance_suite(tmp_path):
    """The suite as its author would run it: from a folder outside this checkout, through the pytest
    plugin, on the backend named with --unified-backend; what it cannot run is skipped, naming the
    capability it lacks."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PLUGIN), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        # (for CI's 30 minutes, the parts that test shared code which torch and JAX cover here too: the
        # crash-during-save trials, the groups of 3 processes, the preemption chain, the resizes, object
        # storage and a resume on another process count; .ci/certify-from-wheel runs everything, from a wheel)
        [sys.executable, "-m", "pytest", "--pyargs", "unified.testing", "--unified-backend", "numpy", "-q", "-rs",
         "-p", "no:cacheprovider", "-k", "not crash_during_save and not 3-processes and not preempt and not resize "
         "and not object_storage and not another_process_count"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    summary = run.stdout.splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 30 and "failed" not in summary and "error" not in summary, run.stdout[-3000:]
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    # every skip names what the backend lacks: a capability, or a part of its testing kit
    assert skipped and all("lacks" in line or "testing kit" in line for line in skipped), "\n".join(skipped)
    for capability in ("TrainingLoop", "ShardedTraining", "ForeignLoaders", "HealthChannel"):
        assert any(f"lacks {capability}" in line for line in skipped), (capability, "\n".join(skipped))
