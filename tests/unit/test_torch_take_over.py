"""A torch model's `load_state` gives its parameters the verified buffers instead of copying them
(issue 15: one pass over the bytes), and keeps every Parameter object that optimizers and DDP hold."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backends.torch.core import TorchBackend, _take_over  # noqa: E402


def _model() -> "torch.nn.Module":
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


def _verified_state(model):
    return {k: np.full(tuple(v.shape), 7, dtype=v.detach().numpy().dtype) for k, v in model.state_dict().items()}


def test_parameters_take_the_verified_buffers_over_and_stay_the_same_objects():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    params = list(model.parameters())
    state = _verified_state(model)
    TorchBackend.load_state_into(TorchBackend.__new__(TorchBackend), "model", model, state)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    weight = model[0].weight
    assert weight.data_ptr() == state["0.weight"].ctypes.data  # taken over: no copy
    assert torch.equal(weight, torch.full((3, 4), 7.0))
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # the optimizer still updates the module's parameters
    assert torch.equal(model[1].bias, torch.full((3,), 7.0 - 2.0))  # d(sum)/d(bias) = batch size


def test_modules_with_load_hooks_or_mismatching_state_are_copied_into():
    model = _model()
    model[0]._register_load_state_dict_pre_hook(lambda *args, **kwargs: None)
    state = {k: torch.from_numpy(v) for k, v in _verified_state(model).items()}
    assert not _take_over(model, state)
    assert not torch.equal(model[0].weight, torch.full((3, 4), 7.0))  # nothing changed
    plain = _model()
    del state["1.running_mean"]
    assert not _take_over(plain, state)
    wrong = dict(state, **{"0.weight": torch.zeros(4, 3)})
    assert not _take_over(plain, wrong)
    assert not torch.equal(plain[0].weight, torch.zeros(3, 4))
