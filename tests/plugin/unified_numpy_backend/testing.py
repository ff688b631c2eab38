"""The NumPy backend's testing kit: the tiny training setup the conformance suite
(`unified.testing`) runs on it (`unified.testing.Kit.training`: step, draws, param_hash,
edit_in_place, change_first_layer). Named by the backend's spec (``testing_kit``)."""
from __future__ import annotations

import hashlib
import random

import numpy as np

from unified.testing import Kit
from unified.testing.training import Counter  # the registered object every kit trains with

from .core import NumpyModel, NumpySGD


class NumpyTraining:
    """A linear model trained by SGD on noise; gradients averaged over processes by `reduce`."""

    def __init__(self, acc) -> None:
        self.acc = acc
        init = np.random.default_rng(0)
        model = NumpyModel(w=init.standard_normal((6, 1)), b=np.zeros(1))
        self.model, self.optimizer = acc.prepare(model, NumpySGD(model, lr=0.05))
        self.counter = Counter()
        acc.register_for_checkpointing(self.counter)

    def step(self) -> None:
        x = self.acc._backend.rng.standard_normal((4, 6)).astype(np.float32) * (random.random() + np.random.rand())
        params = self.model.params
        err = x @ params["w"] + params["b"]
        grads = {"w": x.T @ err / len(x), "b": err.mean(axis=0)}
        self.optimizer.step(self.acc.reduce(grads, "mean"))
        self.counter.steps += 1
        self.counter.history[self.counter.steps % 4] = self.counter.steps * 0.5

    def draws(self) -> list:
        return [random.random(), float(np.random.rand()), float(self.acc._backend.rng.random())]

    def edit_in_place(self, delta: float, tracked: bool = True) -> None:
        for value in self.model.params.values():
            value += delta

    def change_first_layer(self, change: str) -> None:
        params = self.model.params
        if change == "dtype":
            params["b"] = params["b"].astype(np.float64)
        else:
            params["w"] = np.zeros((7, 1), np.float32)

    def param_hash(self) -> str:
        digest = hashlib.sha256()
        for name in sorted(self.model.params):
            digest.update(self.model.params[name].tobytes())
        digest.update(repr(self.counter.history.tolist()).encode())
        return digest.hexdigest()


class NumpyKit(Kit):
    training = NumpyTraining
