"""A checkpoint saved before the optimizer's first step loads into an optimizer that has stepped,
as torch's ``Optimizer.load_state_dict`` and Accelerate accept it (issue 24, regression 3): the
optimizer comes back without state, as it was saved. A real mismatch (another model's optimizer,
other shapes) is still refused before anything is restored."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from unified import Accelerator, CheckpointError  # noqa: E402


def _objects(layers_optimized=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    return model, torch.optim.Adam(model[:layers_optimized].parameters(), lr=0.1)


def _step(model, optimizer):
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_step_zero_checkpoint_loads_into_a_stepped_optimizer(tmp_path, torch_accelerator):
    model, optimizer = torch_accelerator.prepare(*_objects())
    saved_params = copy.deepcopy(model.state_dict())
    torch_accelerator.save_state(str(tmp_path / "step0"), safe_serialization=True)
    _step(model, optimizer)
    assert optimizer.state_dict()["state"]  # Adam now holds step, exp_avg, exp_avg_sq
    torch_accelerator.load_state(str(tmp_path / "step0"))
    assert optimizer.state_dict()["state"] == {}  # as torch's load_state_dict leaves it
    assert all(torch.equal(v, saved_params[k]) for k, v in model.state_dict().items())
    _step(model, optimizer)  # and it trains on from there
    assert set(optimizer.state_dict()["state"]) == {0, 1, 2, 3}


def test_an_optimizer_over_other_parameters_is_refused_before_anything_changes(tmp_path):
    saving = Accelerator(backend="torch")
    saving.prepare(*_objects(layers_optimized=1))  # not stepped: no state, two parameters
    saving.save_state(str(tmp_path / "other"))
    saving.end_training()
    acc = Accelerator(backend="torch")
    model, optimizer = acc.prepare(*_objects(layers_optimized=2))  # the same model, four parameters
    _step(model, optimizer)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match=r"optimizer_0.*parameter group 0 .*2 parameters.*4"):
        acc.load_state(str(tmp_path / "other"))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing restored
    assert set(optimizer.state_dict()["state"]) == {0, 1, 2, 3}
    acc.end_training()
