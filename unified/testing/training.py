"""What every backend's checkpoint training shares (`unified.testing.Kit.training`).

Each step of a kit's training draws from Python's `random`, NumPy's global generator and the
framework's RNG (`host_noise` covers the first two), so a resumed run matches the uninterrupted
one only if every generator was restored. `Counter` is the registered object every kit trains with.
"""
from __future__ import annotations

import random

import numpy as np


class Counter:
    """A registered object with array and plain state."""

    def __init__(self) -> None:
        self.steps = 0
        self.history = np.zeros(4, dtype=np.float64)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "history": self.history.copy(), "note": ("ok", 1)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        self.history = np.array(state["history"])


def host_noise() -> float:
    """A factor drawn from Python's and NumPy's global generators."""
    return random.random() + float(np.random.rand())


def make(acc):
    """The training of ``acc``'s backend's kit."""
    from .kit import make_training

    return make_training(acc)
