"""Tensors on a CUDA device filled through two pinned staging buffers taking turns, each copy on
a copy stream of its own while the next array is read (`_FilledOnDevice.replace_async`, issue
48's GPU pipeline). Skipped without CUDA; the CPU side of the rotation is
tests/unit/test_overlapped_placing.py."""
from __future__ import annotations

import numpy as np
import pytest

from .conftest import needs_cuda

torch = pytest.importorskip("torch")
pytestmark = needs_cuda


def test_cuda_tensors_get_exactly_their_bytes_through_pinned_buffers(tmp_path):
    from backends.torch.core import _FilledOnDevice
    from unified.checkpoint import safetensors_io
    from unified.checkpoint.placement import _hand_off
    from unified.checkpoint.safetensors_place import Overlapped

    rng = np.random.default_rng(0)
    arrays = {f"w{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate((1 << 20, 3000, 1 << 18, 7))}
    info = safetensors_io.write(str(tmp_path / "f.safetensors"),
                                {k: safetensors_io.export_numpy(v) for k, v in arrays.items()})
    tensors = {key: torch.zeros(len(value), device="cuda") for key, value in arrays.items()}
    into = {key: _hand_off(_FilledOnDevice(tensor)) for key, tensor in tensors.items()}
    assert all(isinstance(value, Overlapped) for value in into.values())
    _, placed = safetensors_io.read_placed(str(tmp_path / "f.safetensors"), info["size"], info["xxh3"], into)
    assert sorted(placed) == sorted(arrays)
    for key, tensor in tensors.items():  # read on the current stream, which waits for the copies
        assert np.array_equal((tensor * 1).cpu().numpy(), arrays[key]), key


def test_a_resumed_model_on_cuda_holds_the_saved_values(tmp_path):
    from unified import Accelerator

    acc = Accelerator(backend="torch")
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512)))
    acc.save_state(str(tmp_path / "ckpt"))
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), saved))
    acc.end_training()
