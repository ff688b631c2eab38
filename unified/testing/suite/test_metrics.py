"""Conformance: evaluation over processes (`gather_for_metrics`, `pad_across_processes`) and torch
DataLoaders with their own samplers, in groups of 2 and 3 processes, one group per backend and size."""
from __future__ import annotations

import pytest

from ..harness import run_group
from ..metrics_scenarios import (
    EVAL_SIZES,
    _lengths,
    metrics_iterable,
    metrics_objects_and_nesting,
    metrics_pad,
    metrics_torch_loader,
    metrics_unified_loader,
    sampler_epochs,
    sampler_resume,
)
from ..scenarios import start

pytestmark = pytest.mark.multiprocess
SCENARIOS = [start, metrics_unified_loader, metrics_torch_loader, metrics_iterable, metrics_objects_and_nesting,
             metrics_pad, sampler_epochs, sampler_resume]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}-processes")
def group(request, backend, tmp_path_factory):
    size = request.param
    shared = tmp_path_factory.mktemp("metrics")
    return run_group(backend, size, SCENARIOS, shared, deadline=180.0).ok()


def _check_evaluation(run, expected_ids):
    assert run["ids"] == expected_ids                      # each sample once, in the epoch's order
    assert run["local_ids"] == expected_ids                # per-process NumPy rows: the same
    assert run["nested_ok"]
    assert sum(run["counts"]) == len(expected_ids)


@pytest.mark.parametrize("scenario", [metrics_unified_loader, metrics_torch_loader, metrics_iterable],
                         ids=lambda f: f.__name__)
def test_gather_for_metrics_returns_exactly_the_evaluation_set(group, scenario):
    for r in group.scenario(scenario):
        for n, b in EVAL_SIZES:
            run = r[f"{n}/{b}"]
            expected = run["order"] if scenario == metrics_unified_loader else list(range(n))
            assert sorted(expected) == list(range(n))
            _check_evaluation(run, expected)
            g = b * group.size
            assert len(run["counts"]) == -(-n // g)           # the last, padded batch is there ...
            if n % g:
                assert run["counts"][-1] == n % g             # ... and gives only its new samples


def test_gather_for_metrics_objects_nesting_and_refusal(group):
    for r in group.scenario(metrics_objects_and_nesting):
        assert r["names"] == [f"sample-{i}" for i in range(10)]
        assert r["inner"] == list(range(10))
        assert r["as_rows"] == [[i] for i in range(10)]  # an array (global on JAX) row by row
        assert r["outer"] == list(range(10))  # after the inner loop, the training loader's batch again
        assert r["refused"] == [True]         # a per-process scalar on the batch with repeats
        assert r["after"] == list(range(group.size))


def test_pad_across_processes_pads_to_the_largest_size(group):
    p = group.size
    for r in group.scenario(metrics_pad):
        assert r["shape"] == [p]
        assert r["padded"] == [x for k in range(p) for x in list(range(1, k + 2)) + [0] * (p - k - 1)]
        assert r["first"] == [x for k in range(p) for x in [-1] * (p - k - 1) + list(range(1, k + 2))]
        assert r["grid"] == [[k + 1.0] * (k + 2) + [7.0] * (p - k - 1) for k in range(p) for _ in range(2)]
        assert r["untouched"] == [[1], [3]] or r["untouched"][1] == [3]
        assert r["negative_shape"] == [2, p + 1]
        assert "int" in r["dtype"]


def _epoch_samples(rows_per_process, steps):
    return [x for k in range(steps) for rows in rows_per_process for x in rows[k]]


def test_custom_samplers_shard_each_sample_once_per_epoch(group):
    rows = group.scenario(sampler_epochs)
    assert rows[0]["type"] == {"buckets": "BatchSampledLoader", "subset": "SampledLoader", "stateful": "SampledLoader"}
    n = rows[0]["n"]
    lengths = _lengths(n)
    wanted = {"subset": sorted(list(range(0, 20, 2)) + [21, 23, 25]), "stateful": list(range(15))}
    for name in ("buckets", "subset", "stateful"):
        runs = [r[name] for r in rows]
        steps = runs[0]["len"]
        orders = []
        for epoch in range(2):
            gathered = runs[0]["gathered"][epoch]
            assert all(r["gathered"][epoch] == gathered for r in runs)   # the same on every process
            samples = _epoch_samples([r["epochs"][epoch] for r in runs], steps)
            assert set(samples) == set(gathered)                         # repeats aside, what was yielded
            if name == "buckets":
                assert len(gathered) == len(set(gathered))               # each sample once
                # the bucket sampler's own batches: on JAX full batches of 2 only (equal sizes)
                assert len(gathered) == (26 if n == 28 else 25)
                for r in runs:                                           # a batch holds one length
                    assert all(len({lengths[i] for i in batch}) == 1 for batch in r["epochs"][epoch])
            else:
                assert sorted(gathered) == wanted[name]                  # exactly the sampler's samples
            orders.append(gathered)
        assert orders[0] != orders[1]                                    # a new order every epoch
        assert all(len(r["skipped"]) == steps - 1 for r in runs)


def test_custom_samplers_resume_exactly_mid_epoch(group):
    for r in group.scenario(sampler_resume):
        for name in ("buckets", "subset", "stateful"):
            assert r["expected"][name], name
            assert r["resumed"][name] == r["expected"][name], name
            assert r["with_skip"][name] == r["expected"][name], name
