"""Fixtures shared by the unit tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def torch_accelerator():
    """A one-process torch `Accelerator`, ended after the test."""
    pytest.importorskip("torch")
    from unified import Accelerator

    acc = Accelerator(backend="torch")
    yield acc
    acc.end_training()
