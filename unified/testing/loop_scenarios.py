"""Conformance scenarios of the training loop (contract Part 2): gradient accumulation, mixed
precision, clipping and a resume inside an accumulation window, written once for both backends.

Each backend's side is a tiny `Setup` (model, optimizer, one micro-step); the scenarios and
their checks are shared. Run by unified/testing/suite/test_training_loop.py.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

import unified
from unified import Accelerator
from unified.testing.scenario import scenario

FEATURES, SAMPLES = 4, 24


class Regression:
    """A fixed regression dataset: sample ``i`` is ``{"x": 4 floats, "y": 1 float}``."""

    def __init__(self, n: int = SAMPLES) -> None:
        rng = np.random.default_rng(3)
        self.x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        self.y = (self.x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def _setup(acc: Accelerator, **kwargs):
    from .kit import kit_of

    setup = kit_of(acc.backend).loop
    if setup is None:
        raise LookupError(f"the {acc.backend!r} backend has TrainingLoop but its testing kit has no loop setup "
                          "(Kit.loop) (docs/certify-a-backend.md)")
    return setup(acc, **kwargs)


def _loss_scaling(acc: Accelerator) -> bool:
    """fp16 with a loss scaler (torch); otherwise fp16 is refused and bf16 is the mixed precision."""
    return "fp16" in acc._loop.mixed_precisions


def _loader(acc: Accelerator, batch_size: int, n: int = SAMPLES, shuffle: bool = True):
    return acc.prepare(unified.DataLoader(Regression(n), batch_size=batch_size, shuffle=shuffle, seed=0))


def _train(acc: Accelerator, setup, loader, micro_steps: int, done: int = 0) -> dict:
    """``micro_steps`` micro-batches in ``accumulate``, across epochs; counts the optimizer
    steps that changed the parameters and the windows ``sync_gradients`` closed."""
    applied = closed = 0
    while done < micro_steps:
        for batch in loader:
            before = setup.params()
            with acc.accumulate(setup.model):
                setup.micro_step(batch)
            closed += acc.sync_gradients
            applied += not np.array_equal(before, setup.params())
            done += 1
            if done == micro_steps:
                break
    return {"applied": applied, "closed": closed}


def _digest(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values, np.float32).tobytes()).hexdigest()[:16]


@scenario
def loop_start(state: dict) -> dict:
    state["acc"] = Accelerator(timeout=60)
    return {"ok": True}


@scenario(requires=("TrainingLoop",))
def loop_accumulation(state: dict) -> dict:
    """N micro-batches of b against one batch of N*b; applied steps per epoch with a last,
    incomplete window (closed by the loader's end)."""
    steps, b = 2, 2
    reference = Accelerator(timeout=60)
    ref_setup = _setup(reference)
    ref_loader = _loader(reference, steps * b)
    _train(reference, ref_setup, ref_loader, len(ref_loader))

    acc = Accelerator(timeout=60, gradient_accumulation_steps=steps)
    setup = _setup(acc)
    loader = _loader(acc, b)
    counts = _train(acc, setup, loader, len(loader))
    # 18 samples: 5 global batches with 2 processes, 3 with 3; windows of 2 -> ceil(batches / 2)
    uneven = Accelerator(timeout=60, gradient_accumulation_steps=steps)
    uneven_loader = _loader(uneven, b, n=18)
    uneven_setup = _setup(uneven)
    uneven_counts = _train(uneven, uneven_setup, uneven_loader, 2 * len(uneven_loader))
    uneven_counts["scheduler_steps"] = uneven_setup.scheduler_steps()
    return {"max_difference": float(np.abs(ref_setup.params() - setup.params()).max()),
            "moved": float(np.abs(ref_setup.params() - _setup(Accelerator(timeout=60)).params()).max()),
            "micro_batches": len(loader), **counts,
            "uneven_batches": len(uneven_loader), "uneven": uneven_counts}


@scenario(requires=("TrainingLoop",))
def loop_mixed_precision(state: dict) -> dict:
    bf16 = _setup(Accelerator(timeout=60, mixed_precision="bf16"))
    out = {"bf16": bf16.compute_dtypes(), "returns_float32": bf16.returns_float32,
           "no": _setup(Accelerator(timeout=60)).compute_dtypes(), "fp16_supported": _loss_scaling(state["acc"])}
    try:
        Accelerator(timeout=60, mixed_precision="fp16")
        out["fp16_error"] = None
    except ValueError as err:
        out["fp16_error"] = str(err)
    if out["fp16_supported"]:  # an overflowing step is skipped and the scale lowered
        acc = Accelerator(timeout=60, mixed_precision="fp16")
        setup = _setup(acc)
        loader = _loader(acc, 2)
        batch = next(iter(loader))
        scale = acc._loop._scaler.get_scale()
        before, scheduled = setup.params(), setup.scheduler_steps()
        setup.micro_step(batch, loss_scale=1e30)  # inf in float16
        out["fp16_overflow"] = {"skipped": acc.optimizer_step_was_skipped,
                                "unchanged": bool(np.array_equal(before, setup.params())),
                                "scheduler_unchanged": setup.scheduler_steps() == scheduled,
                                "scale_before": scale, "scale_after": acc._loop._scaler.get_scale()}
        # the scale halves at each overflow until the gradients fit
        for attempt in range(1, 31):  # noqa: B007 - read after the loop: the attempts it took
            setup.micro_step(batch)
            if not acc.optimizer_step_was_skipped:
                break
        out["fp16_next"] = {"skipped": acc.optimizer_step_was_skipped, "attempts": attempt,
                            "changed": not np.array_equal(before, setup.params())}
    return out


@scenario(requires=("TrainingLoop",))
def loop_trigger_sync(state: dict) -> dict:
    """One step on each process's own batch inside ``no_sync``: without
    ``trigger_sync_in_backward`` the gradients stay local (torch DDP: the processes' parameters
    part), with it they are synchronised (the parameters agree on every process)."""
    out = {}
    for case in ("local", "triggered"):
        acc = Accelerator(timeout=60)
        setup = _setup(acc)
        batch = next(iter(_loader(acc, 2, shuffle=False)))  # each process its own rows
        with acc.no_sync(setup.model):
            if case == "triggered":
                with acc.trigger_sync_in_backward(setup.model):
                    setup.micro_step(batch)
            else:
                setup.micro_step(batch)
        out[case] = _digest(setup.params())
    return out


CLIP_GRADS = [[[3.0, 4.0], [0.0, -12.0]], [1.0, 2.0, -2.0]]


@scenario(requires=("TrainingLoop",))
def loop_clipping(state: dict) -> dict:
    setup = _setup(Accelerator(timeout=60))
    return {"small": setup.clip(CLIP_GRADS, 1.0), "large": setup.clip(CLIP_GRADS, 100.0)}


@scenario(requires=("TrainingLoop",))
def loop_resume_mid_window(state: dict) -> dict:
    """Uninterrupted against stopped inside an accumulation window, saved, restored into fresh
    objects and continued, with mixed precision (torch fp16 with its loss scale, JAX bf16)."""
    precision = "fp16" if _loss_scaling(state["acc"]) else "bf16"
    steps, b, n = 3, 2, 20
    directory = os.path.join(os.environ["UNIFIED_TEST_SHARED"], "loop_mid_window")

    def fresh():
        acc = Accelerator(timeout=60, seed=1, mixed_precision=precision, gradient_accumulation_steps=steps)
        return acc, _setup(acc), _loader(acc, b, n=n)

    acc, setup, loader = fresh()
    total = 4 * len(loader)
    _train(acc, setup, loader, total)
    uninterrupted = setup.params()

    # The second micro-batch of the third epoch: inside a window (the loader's end closed the
    # last one), after fp16's first overflowing steps have brought the loss scale down.
    stop = 2 * len(loader) + 1
    acc, setup, loader = fresh()
    _train(acc, setup, loader, stop)
    position = acc.gradient_state.step
    acc.save_state(directory)
    at_save = setup.params()

    acc, setup, loader = fresh()
    acc.load_state(directory)
    restored = {"position": acc.gradient_state.step, "params_equal": bool(np.array_equal(at_save, setup.params()))}
    if precision == "fp16":
        restored["scale"] = acc._loop._scaler.get_scale()
    _train(acc, setup, loader, total, done=stop)
    resumed = setup.params()
    return {"position_at_save": position, **restored, "difference": float(np.abs(uninterrupted - resumed).max()),
            "uninterrupted": _digest(uninterrupted), "resumed": _digest(resumed),
            "moved": float(np.abs(uninterrupted - at_save).max())}
