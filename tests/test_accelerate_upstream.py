"""Accelerate 1.15's own tests/test_state_checkpointing.py (kept as it is in tests/upstream/)
passes against unified with only ``Accelerator`` and ``ProjectConfiguration`` redirected (issue
24): 16 of 16, and the 2 it skips on a CPU machine are skipped on Accelerate too. Everything else
the file imports (``accelerate.test_utils``, ``set_seed``, ``DistributedType``) stays Accelerate's,
so the ``peers`` extra must be installed (CI and the README's test command install it)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = REPO / "tests" / "upstream" / "accelerate_1_15_test_state_checkpointing.py"
REDIRECTS = {
    "from accelerate import Accelerator\n": "from unified import Accelerator\n",
    "from accelerate.utils import DistributedType, ProjectConfiguration, patch_environment, set_seed\n":
        "from accelerate.utils import DistributedType, patch_environment, set_seed\n"
        "from unified import ProjectConfiguration\n",
}

needs_peers = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("accelerate", "parameterized", "torch")),
    reason="needs the peers extra (accelerate==1.15.0, parameterized) and torch")


def redirected(source: str) -> str:
    """``source`` with exactly the `REDIRECTS` applied, each once."""
    for before, after in REDIRECTS.items():
        assert source.count(before) == 1, f"the upstream file no longer has {before!r}"
        source = source.replace(before, after)
    return source


def test_the_upstream_copy_is_unchanged():
    digest = hashlib.sha256(UPSTREAM.read_bytes()).hexdigest()
    assert digest in (REPO / "tests" / "upstream" / "README.md").read_text()


@needs_peers
@pytest.mark.multiprocess
def test_accelerates_state_checkpointing_tests_pass_on_unified(tmp_path):
    script = tmp_path / "test_state_checkpointing.py"
    script.write_text(redirected(UPSTREAM.read_text()))
    assert "from accelerate import Accelerator" not in script.read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNIFIED_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert re.search(r"\b16 passed, 2 skipped\b", output), output[-3000:]
