"""Conformance: gradient accumulation, mixed precision, clipping and a resume inside an
accumulation window, on both backends, in groups of 2 and 3 (one group per case)."""
from __future__ import annotations

import numpy as np
import pytest

from ..harness import run_group
from ..loop_scenarios import (
    CLIP_GRADS,
    loop_accumulation,
    loop_clipping,
    loop_mixed_precision,
    loop_resume_mid_window,
    loop_start,
    loop_trigger_sync,
)

pytestmark = pytest.mark.multiprocess
SCENARIOS = [loop_start, loop_accumulation, loop_mixed_precision, loop_clipping, loop_resume_mid_window,
             loop_trigger_sync]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}-processes")
def group(request, backend, tmp_path_factory):
    size = request.param
    shared = tmp_path_factory.mktemp("loop")
    return run_group(backend, size, SCENARIOS, shared, deadline=240.0).ok()


def test_accumulated_micro_batches_equal_one_large_batch(group):
    for r in group.scenario(loop_accumulation):
        assert r["moved"] > 1e-3  # training changed the parameters at all
        assert r["max_difference"] < 1e-5, r
        windows = r["micro_batches"] // 2
        assert r["applied"] == r["closed"] == windows, r


def test_applied_steps_per_epoch_are_ceil_of_batches_over_n(group):
    for r in group.scenario(loop_accumulation):
        per_epoch = -(-r["uneven_batches"] // 2)
        assert r["uneven_batches"] % 2 == 1  # the last window of each epoch is incomplete
        assert r["uneven"]["applied"] == r["uneven"]["closed"] == 2 * per_epoch, r
        if r["uneven"]["scheduler_steps"] is not None:  # as Accelerate: num_processes per optimizer step
            assert r["uneven"]["scheduler_steps"] == 2 * per_epoch * group.size, r


def test_bf16_computes_in_bf16_and_keeps_float32_parameters(group):
    for r in group.scenario(loop_mixed_precision):
        assert r["bf16"]["inner"] == "bfloat16", r
        assert r["bf16"]["params"] == ["float32"], r
        assert r["no"]["inner"] == "float32" and r["no"]["output"] == "float32", r
        assert r["bf16"]["output"] == ("float32" if r["returns_float32"] else "bfloat16"), r
        assert r["bf16"].get("optimizer", ["float32"]) == ["float32"], r


def test_fp16(group):
    for r in group.scenario(loop_mixed_precision):
        if not r["fp16_supported"]:
            assert r["fp16_error"] and "bf16" in r["fp16_error"], r
            continue
        assert r["fp16_error"] is None
        overflow = r["fp16_overflow"]
        assert overflow["skipped"] and overflow["unchanged"] and overflow["scheduler_unchanged"], overflow
        assert overflow["scale_after"] < overflow["scale_before"], overflow
        assert not r["fp16_next"]["skipped"] and r["fp16_next"]["changed"], r


def test_clipping_returns_the_reference_norm(group):
    flat = np.concatenate([np.ravel(g) for g in CLIP_GRADS])
    norm = float(np.sqrt((flat ** 2).sum()))
    for r in group.scenario(loop_clipping):
        assert r["small"]["norm"] == pytest.approx(norm, rel=1e-6)
        assert r["large"]["norm"] == pytest.approx(norm, rel=1e-6)
        coefficient = 1.0 / (norm + 1e-6)
        for got, want in zip(r["small"]["clipped"], CLIP_GRADS):
            np.testing.assert_allclose(got, np.asarray(want) * coefficient, rtol=1e-6)
        for got, want in zip(r["large"]["clipped"], CLIP_GRADS):
            np.testing.assert_allclose(got, want, rtol=1e-6)  # under the limit: unchanged


def test_resume_inside_an_accumulation_window_is_exact(group):
    results = group.scenario(loop_resume_mid_window)
    for r in results:
        assert r["position_at_save"] > 0, r  # really inside a window
        assert r["position"] == r["position_at_save"] and r["params_equal"], r
        assert r["moved"] > 1e-3, r
        assert r["difference"] < 1e-5, r
    assert len({r["resumed"] for r in results}) == 1  # every process holds the same parameters


def test_trigger_sync_in_backward_synchronises_inside_no_sync(group):
    """Accelerate's ``trigger_sync_in_backward``: inside ``no_sync`` the backward it wraps reduces
    the gradients, so every process steps to the same parameters. Where ``no_sync`` keeps
    gradients local (torch DDP) the control step leaves the processes apart, which is what the
    trigger must undo; where gradients are global (JAX) both agree."""
    results = group.scenario(loop_trigger_sync)
    assert len({r["triggered"] for r in results}) == 1, results
    assert len({r["local"] for r in results}) in (1, len(results)), results
