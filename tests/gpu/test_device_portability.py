"""A checkpoint written on a GPU loads on CPU, and one written on CPU loads on a GPU, on both
backends: the same parameters come back, and the training goes on (issue 27). Each side is a
fresh process; the CPU side hides the devices (``CUDA_VISIBLE_DEVICES=""``, ``JAX_PLATFORMS=cpu``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import needs_cuda, needs_jax_gpu

RUN = Path(__file__).with_name("portable_run.py")
ROOT = Path(__file__).resolve().parents[2]
# backend, the platform name of its GPU, whether a checkpoint without GPU generator state warns
CASES = [pytest.param("torch", "cuda", True, marks=needs_cuda, id="torch"),
         pytest.param("jax", "gpu", False, marks=needs_jax_gpu, id="jax")]


def _run(backend: str, mode: str, path: Path, on_gpu: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if not on_gpu:
        env.update(CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(RUN), backend, mode, str(path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend, gpu_platform, warns_without_gpu_generator", CASES)
def test_a_checkpoint_moves_between_gpu_and_cpu(backend, gpu_platform, warns_without_gpu_generator, tmp_path):
    saved = _run(backend, "save", tmp_path / "on_gpu", on_gpu=True)
    assert saved["platform"] == gpu_platform, saved
    loaded = _run(backend, "load", tmp_path / "on_gpu", on_gpu=False)
    assert loaded["platform"] == "cpu" and loaded["hash"] == saved["hash"], (saved, loaded)
    assert not [w for w in loaded["warnings"] if "CUDA" in w], loaded  # the GPU's generator is not needed on CPU

    saved = _run(backend, "save", tmp_path / "on_cpu", on_gpu=False)
    loaded = _run(backend, "load", tmp_path / "on_cpu", on_gpu=True)
    assert loaded["platform"] == gpu_platform and loaded["hash"] == saved["hash"], (saved, loaded)
    # no GPU generator state in a CPU checkpoint (torch keeps one per device): said, not silently skipped
    assert any("saved without a CUDA device" in w for w in loaded["warnings"]) == warns_without_gpu_generator, loaded
