"""A prepared torch optimizer and scheduler survive pickle and deepcopy (Accelerate's
tests/test_optimizer.py: ``pickle.loads(pickle.dumps(accelerator.prepare(optimizer)))``; issue
24). Before the fix the wrapper's ``__getattr__`` recursed while ``__setstate__`` ran."""
from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")

from unified import Accelerator  # noqa: E402


def test_a_prepared_optimizer_and_scheduler_pickle_and_copy():
    acc = Accelerator(backend="torch", gradient_accumulation_steps=2)
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    for restored in (pickle.loads(pickle.dumps(optimizer)), copy.deepcopy(optimizer)):
        assert type(restored) is type(optimizer)
        assert restored.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
        assert restored.step_was_skipped is False
    again = pickle.loads(pickle.dumps(scheduler))
    assert again.state_dict() == scheduler.state_dict()
    acc.end_training()
