"""A checkpoint saved without a GPU loads on one (issue 27): the torch backend has a CUDA
generator there, which the checkpoint cannot hold; `Backend.optional_rng_state` names it, so the
load goes on and `set_rng_state` warns (tests/gpu/test_device_portability.py runs it on a GPU).
Before, the load refused it ("has no state for the random generator(s) torch_cuda"), which the
GPU machine showed. Any other missing generator is still refused before anything is restored."""
from __future__ import annotations

import numpy as np
import pytest

from unified.errors import CheckpointError

torch = pytest.importorskip("torch")


def _saved(tmp_path):
    from unified import Accelerator

    acc = Accelerator(backend="torch")
    acc.prepare(torch.nn.Linear(4, 4))
    acc.save_state(str(tmp_path / "ckpt"))  # on CPU: no torch_cuda
    return acc, type(acc._backend)


def test_a_checkpoint_without_the_gpu_generator_loads_where_there_is_one(tmp_path, monkeypatch):
    acc, backend = _saved(tmp_path)
    real = backend.rng_state
    monkeypatch.setattr(backend, "rng_state", lambda self: {**real(self), "torch_cuda": np.zeros(16, np.uint8)})
    given = []
    monkeypatch.setattr(backend, "set_rng_state", lambda self, state: given.append(sorted(state)))
    acc.load_state(str(tmp_path / "ckpt"))
    assert given == [["torch_cpu"]]
    acc.end_training()


def test_another_missing_generator_is_still_refused(tmp_path, monkeypatch):
    acc, backend = _saved(tmp_path)
    real = backend.rng_state
    monkeypatch.setattr(backend, "rng_state", lambda self: {**real(self), "other": np.zeros(16, np.uint8)})
    with pytest.raises(CheckpointError, match=r"random generator\(s\) other of this run"):
        acc.load_state(str(tmp_path / "ckpt"))
    acc.end_training()
