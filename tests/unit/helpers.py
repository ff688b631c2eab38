"""Helpers the unit tests share: a torch training step and parameter snapshots, and the peak
memory of a call (for the bounds on hostile input)."""
from __future__ import annotations

import tracemalloc
from typing import Any, Callable, Dict, Tuple


def train_step(acc: Any, model: Any, optimizer: Any) -> None:
    """One step of a prepared torch ``model`` (a ``Linear``) and ``optimizer`` on ones."""
    import torch

    acc.backward(model(torch.ones(2, model.in_features)).sum())
    optimizer.step()
    optimizer.zero_grad()


def params_of(model: Any) -> Dict[str, Any]:
    """A copy of ``model``'s state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_params(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def peak_of(fn: Callable[[], Any]) -> Tuple[int, Any]:
    """(peak bytes allocated while ``fn`` ran, its result or the exception it raised)."""
    tracemalloc.start()
    try:
        try:
            outcome = fn()
        except Exception as err:  # noqa: BLE001 - the caller asserts on it
            outcome = err
        return tracemalloc.get_traced_memory()[1], outcome
    finally:
        tracemalloc.stop()
