"""Importing `unified` (and its launcher and CLI) must not import torch or jax."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

CHECK = (
    "import sys; heavy = sorted(m for m in ('torch', 'jax', 'jaxlib') if m in sys.modules); "
    "assert not heavy, 'imported: ' + ', '.join(heavy); print('ok')"
)


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("imports", [
    "import unified",
    "import unified, unified.launcher.launch, unified.launcher.cli",
    "import unified.utils, unified.runtime.tree, unified.runtime.rng, unified.runtime.collectives, "
    "unified.launcher.report, unified.backend.registry, unified.launcher.launch",
    "from unified import Accelerator, ProjectConfiguration, available_backends; available_backends()",
])
def test_import_does_not_pull_frameworks(imports):
    result = _run(f"{imports}; {CHECK}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_check_detects_a_heavy_import():
    """The probe above can fail: a module that is imported is reported."""
    result = _run("import sys; sys.modules['jax'] = object(); " + CHECK)
    assert result.returncode != 0 and "imported: jax" in result.stderr
