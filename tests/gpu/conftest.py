"""The GPU path (issue 27): tests that run where a CUDA device is, and are skipped, with the
reason, where none is (CI runs on CPU and counts them as skipped).

`benchmarks/gpu_check.py` runs these on a GPU machine and times saves and loads of device state.
"""
from __future__ import annotations

import os

import pytest

# JAX takes 75% of the GPU's memory on its first use unless told otherwise; torch's tests share it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False): this runs on a GPU machine, see docs/gpu.md"
NO_JAX_GPU = "no GPU for JAX here (jax.devices('gpu') found none; pip install 'unified[cuda]'): see docs/gpu.md"


def torch_cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def jax_gpus() -> int:
    try:
        import jax

        return len(jax.devices("gpu"))
    except (ImportError, RuntimeError):  # RuntimeError: no GPU platform in this jaxlib
        return 0


needs_cuda = pytest.mark.skipif(torch_cuda_devices() == 0, reason=NO_CUDA)
needs_jax_gpu = pytest.mark.skipif(jax_gpus() == 0, reason=NO_JAX_GPU)
