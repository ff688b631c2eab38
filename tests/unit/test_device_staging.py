"""The CUDA branches of the torch backend that can be exercised without a GPU.

- Async saves of device memory (issue 27): the checkpoint manager hands every array of an async
  save to the backend's `stage_array` first; staged arrays are written only after the function
  `staged()` returned has waited, are not watched for in-place changes (the staged copy is the
  state of the save's moment), and the save commits. Here staging is simulated on CPU tensors
  (a copy made at once, with the wait recorded); tests/gpu runs the real CUDA path.
- The CUDA random generator in checkpoints: only this process's device's state is saved, under
  a device-neutral key; an older checkpoint's per-device keys are read by this device's index;
  a checkpoint without CUDA state warns on a GPU and is silent on CPU.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _staging(backend, calls, root):
    """Make ``backend`` stage every CPU tensor as the CUDA path stages device tensors."""
    def stage_array(value):
        tensor = value.detach().clone().contiguous()
        calls.append("stage")
        return "F32", tuple(tensor.shape), tensor.reshape(-1).view(torch.uint8).numpy()

    def staged():
        calls.append("staged")

        def ready():  # what is already written when the writer waits for the copies
            written = [name for _, _, names in os.walk(root) for name in names if name.endswith(".safetensors")]
            calls.append(("ready", written))
        return ready

    backend.stage_array, backend.staged = stage_array, staged


def test_an_async_save_writes_staged_arrays_after_their_copy_finished(tmp_path, torch_accelerator):
    acc = torch_accelerator
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls: list = []
    _staging(acc._backend, calls, tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    target = tmp_path / "ckpt"
    acc.save_state(str(target), async_save=True)
    with torch.no_grad():  # changed in place at once: the staged copies keep the save's moment
        for p in model.parameters():
            p.add_(100.0)
    acc.wait_for_checkpoint()
    assert calls.count("staged") == 1 and calls.index("staged") > max(i for i, c in enumerate(calls) if c == "stage")
    ready = [c for c in calls if isinstance(c, tuple)]
    assert ready == [("ready", [])], calls  # waited once, before any file of the checkpoint was written
    acc.load_state(str(target))  # committed: the staged arrays were not refused as changed in place
    for name, value in before.items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_synchronous_save_stages_nothing(tmp_path, torch_accelerator):
    acc = torch_accelerator
    acc.prepare(torch.nn.Linear(2, 2))
    calls: list = []
    _staging(acc._backend, calls, tmp_path)
    acc.save_state(str(tmp_path / "ckpt"))
    assert calls == []


def _cuda_backend(monkeypatch, index):
    """A torch backend that believes it runs on ``cuda:<index>``, with a fake device generator."""
    from backends.torch.core import TorchBackend

    backend = TorchBackend()
    backend._device = torch.device("cuda", index)
    generators = {index: torch.arange(8, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: generators[device.index].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: generators.__setitem__(device.index, state))
    return backend, generators


def test_only_this_process_devices_generator_is_saved_and_restored(monkeypatch):
    backend, generators = _cuda_backend(monkeypatch, 1)
    state = backend.rng_state()
    assert sorted(state) == ["torch_cpu", "torch_cuda"] and state["torch_cuda"].tolist() == list(range(8))
    generators[1] = torch.zeros(8, dtype=torch.uint8)
    backend.set_rng_state(state)
    assert generators[1].tolist() == list(range(8))
    # a checkpoint of an older version: every device's state, this device's taken by its index
    old = {"torch_cpu": state["torch_cpu"], "torch_cuda_0": np.full(8, 7, np.uint8),
           "torch_cuda_1": np.full(8, 9, np.uint8)}
    backend.set_rng_state(old)
    assert generators[1].tolist() == [9] * 8


def test_a_checkpoint_without_cuda_state_warns_on_a_gpu_and_not_on_cpu(monkeypatch):
    from backends.torch.core import TorchBackend

    saved_on_cpu = TorchBackend().rng_state()
    assert sorted(saved_on_cpu) == ["torch_cpu"]
    backend, generators = _cuda_backend(monkeypatch, 0)
    with pytest.warns(UserWarning, match="saved without a CUDA device.*cuda-rng-not-saved"):
        backend.set_rng_state(saved_on_cpu)
    assert generators[0].tolist() == list(range(8))  # kept as it was
    saved_on_gpu = backend.rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TorchBackend().set_rng_state(saved_on_gpu)  # on CPU the device's state is not needed
