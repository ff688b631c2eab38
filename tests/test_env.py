"""`unified env`: the bug-report command runs and prints versions, devices and the chosen backend."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("torch", "jax")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _run_env(**overrides: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("UNIFIED_BACKEND", "UNIFIED_LAUNCHER_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(overrides)
    proc = subprocess.run([sys.executable, "-m", "unified", "env"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _fields(output: str) -> Dict[str, str]:
    """``- name: value`` lines as a dict; every line of the report has that form."""
    fields = {}
    for line in output.strip().splitlines():
        match = re.fullmatch(r"- ([^:]+): (.+)", line)
        assert match, f"unexpected line in `unified env`: {line!r}"
        fields[match.group(1)] = match.group(2)
    return fields


def _default_backend() -> Optional[str]:
    installed = [f for f in FRAMEWORKS if _installed(f)]
    if not installed:
        return None
    return installed[0] if len(installed) == 1 else "torch"


def test_env_reports_python_unified_frameworks_and_the_chosen_backend():
    fields = _fields(_run_env())
    python = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    assert fields["Python"].startswith(f"{python} ("), fields["Python"]
    assert platform.system() in fields["Python"]
    assert fields["unified"] == _version("unified") != "not installed"
    for framework in FRAMEWORKS:
        version = _version(framework)
        if version == "not installed":
            assert fields[framework] == version
        else:  # the version, then whether it lies in the range CI tests (README, "Supported versions")
            assert re.fullmatch(rf"{re.escape(version)} \(.*tested: [\w.]+ to [\w.]+\)+", fields[framework]), \
                fields[framework]
    outside = [f"{name} {value.split(' (')[0]}" for name, value in fields.items()
               if re.search(r"\((OLDER|newer) than", value)]
    summary = fields["installed versions inside the tested ranges"]
    assert summary == (f"no ({', '.join(outside)}; see the README's support table)" if outside else "yes"), summary
    expected = _default_backend()
    if expected is None:
        assert fields["backend that would be chosen"].startswith("none (")
    else:
        assert fields["backend that would be chosen"] == expected
    if _installed("torch"):
        assert re.fullmatch(r"cpu, \d+ CUDA GPU\(s\)", fields["torch devices"]), fields["torch devices"]
    if _installed("jax"):
        import jax

        assert fields["jax devices"] == ", ".join(str(d) for d in jax.local_devices())


@pytest.mark.skipif(not _installed("jax"), reason="jax is not installed")
def test_env_honours_unified_backend_jax():
    fields = _fields(_run_env(UNIFIED_BACKEND="jax"))
    assert fields["backend that would be chosen"] == "jax"


def test_env_reports_an_invalid_unified_backend_instead_of_failing():
    fields = _fields(_run_env(UNIFIED_BACKEND="tensorflow"))
    chosen = fields["backend that would be chosen"]
    assert chosen.startswith("none (") and "UNIFIED_BACKEND" in chosen and "'tensorflow'" in chosen
