"""gather_for_metrics, pad_across_processes and the sampler loaders in one process: groups of
threads on the in-memory backend (fast sweeps over sizes), and single-process torch for samplers."""
from __future__ import annotations

import importlib.util
import itertools
import math

import numpy as np
import pytest

import unified
from unified.data import BatchLayout, BatchSampledLoader

from .memory_backend import run_accelerators, unwrap

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")


class Ids:
    """Map-style data whose samples are their own index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": np.array([i], dtype=np.int64)}


class Stream:
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return ({"x": np.array([i], dtype=np.int64)} for i in range(self.n))


def _evaluate(acc, loader):
    out = []
    for batch in loader:
        got = acc.gather_for_metrics({"x": batch["x"], "pair": (batch["x"] * 2,)})
        np.testing.assert_array_equal(got["pair"][0], got["x"] * 2)
        out += got["x"].ravel().tolist()
    return out


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_gather_for_metrics_gives_each_sample_once_for_any_size(processes):
    cases = list(itertools.product([1, 2, 5, 7, 10, 13], [1, 3, 4], [False, True]))

    def body(acc):
        results = []
        for n, b, shuffle in cases:
            loader = acc.prepare(unified.DataLoader(Ids(n), batch_size=b, shuffle=shuffle, seed=1))
            results.append((_evaluate(acc, loader), np.asarray(loader.epoch_order(0)).tolist()))
            results.append((_evaluate(acc, acc.prepare(unified.DataLoader(Stream(n), batch_size=b))), list(range(n))))
        return results

    _, results = run_accelerators(processes, body, deadline=60.0)
    for rank_results in unwrap(results):
        for got, order in rank_results:
            assert got == order  # every sample once, in the epoch's order (map-style and streams)


def test_plain_gather_still_counts_the_repeats():
    def body(acc):
        loader = acc.prepare(unified.DataLoader(Ids(10), batch_size=3))
        return [len(acc.gather(b["x"])) for b in loader], [len(acc.gather_for_metrics(b["x"])) for b in loader]

    _, results = run_accelerators(3, body)
    for plain, metrics in unwrap(results):
        assert plain == [9, 9] and metrics == [9, 1]


def test_values_without_per_sample_rows_are_refused_only_where_repeats_are():
    def body(acc):
        outcomes = []
        for batch in acc.prepare(unified.DataLoader(Ids(10), batch_size=3)):
            try:
                outcomes.append(acc.gather_for_metrics(np.float32(batch["x"].mean())).shape[0])
            except ValueError as err:
                outcomes.append("gather-for-metrics-rows" in str(err))
        return outcomes

    _, results = run_accelerators(3, body)
    assert unwrap(results) == [[3, True]] * 3


def test_the_innermost_running_loader_decides_and_leaving_a_loop_early_forgets_it():
    def body(acc):
        train = acc.prepare(unified.DataLoader(Ids(5), batch_size=2))
        evaluation = acc.prepare(unified.DataLoader(Ids(3), batch_size=1))
        seen = []
        for batch in train:
            for inner in evaluation:
                seen.append(acc.gather_for_metrics(inner["x"]).ravel().tolist())
            seen.append(acc.gather_for_metrics(batch["x"]).ravel().tolist())
        for inner in evaluation:  # left early: nothing runs afterwards
            del inner
            break
        after = acc.gather_for_metrics(np.array([acc.process_index])).tolist()
        return seen, after

    _, results = run_accelerators(2, body)
    for seen, after in unwrap(results):
        assert seen == [[0, 1], [2], [0, 1, 2, 3], [0, 1], [2], [4]]
        assert after == [0, 1]


def test_per_sample_objects_and_arrays_by_row():
    def body(acc):
        names, rows = [], []
        for batch in acc.prepare(unified.DataLoader(Ids(5), batch_size=2)):
            ids = batch["x"].ravel().tolist()
            names += acc.gather_for_metrics([f"s{i}" for i in ids])
            rows += acc.gather_for_metrics(np.stack([np.arange(3) + i for i in ids]), use_gather_object=True)
        return names, rows

    _, results = run_accelerators(2, body)
    for names, rows in unwrap(results):
        assert names == [f"s{i}" for i in range(5)]
        assert [r.tolist() for r in rows] == [[i, i + 1, i + 2] for i in range(5)]


def test_objects_must_be_a_list_of_per_sample_values():
    _, results = run_accelerators(1, lambda acc: acc.gather_for_metrics({"text": "abc"}))
    assert isinstance(results[0], TypeError) and "gather-for-metrics-objects" in str(results[0])


def test_pad_across_processes_through_the_default_numpy_padding():
    def body(acc):
        r = acc.process_index
        vec = np.arange(r + 1) + 1
        tree = {"grid": np.full((2, r + 1), r, dtype=np.float32), "flat": (np.zeros(()),)}
        return (acc.pad_across_processes(vec, pad_index=-1), acc.pad_across_processes(vec, pad_first=True),
                acc.pad_across_processes(tree, dim=1, pad_index=9), acc.pad_across_processes(vec, dim=3))

    _, results = run_accelerators(3, body)
    for r, (vec, first, tree, untouched) in enumerate(unwrap(results)):
        assert vec.tolist() == list(range(1, r + 2)) + [-1] * (2 - r)
        assert first.tolist() == [0] * (2 - r) + list(range(1, r + 2))
        assert tree["grid"].dtype == np.float32 and tree["grid"].tolist() == [[r] * (r + 1) + [9] * (2 - r)] * 2
        assert tree["flat"][0].shape == () and untouched.shape == (r + 1,)


class _Batches:
    """A framework-neutral `OrderSource` of fixed batches, rotated by the epoch."""

    def __init__(self, batches):
        self.batches = batches

    def draw(self, epoch):
        k = epoch % len(self.batches)
        return [list(b) for b in self.batches[k:] + self.batches[:k]]

    def length(self):
        return len(self.batches)

    def state(self):
        return None

    def load(self, state):
        raise AssertionError("no state to load")


def _batch_loader(acc, batches, drop_last=False):
    source = unified.DataLoader(Ids(sum(len(b) for b in batches)), batch_size=1, drop_last=drop_last)
    loader = BatchSampledLoader(source, acc._backend, 0, _Batches(batches))
    acc._metrics.watch(loader)
    return loader


BUCKETS = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9], [10, 11]]


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_batch_sampler_batches_of_different_sizes_are_gathered_once(processes):
    def body(acc):
        loader = _batch_loader(acc, BUCKETS)
        epochs = []
        for _ in range(2):
            got, layouts = [], []
            for batch in loader:
                got += acc.gather_for_metrics(batch["x"]).ravel().tolist()
                layouts.append(loader.batch_layout())
            epochs.append((got, layouts, len(loader)))
        return epochs

    _, results = run_accelerators(processes, body)
    for rank_results in unwrap(results):
        for epoch, (got, layouts, steps) in enumerate(rank_results):
            k = epoch % len(BUCKETS)
            assert got == [i for b in BUCKETS[k:] + BUCKETS[:k] for i in b]
            assert steps == math.ceil(len(BUCKETS) / processes)
            assert sum(sum(lay.kept) for lay in layouts) == 12
            assert layouts[-1].repeats == sum(lay.rows[r] for lay in layouts[-1:]
                                              for r in range(processes) if lay.kept[r] == 0)


def test_batch_sampler_drop_last_drops_the_incomplete_step():
    def body(acc):
        loader = _batch_loader(acc, BUCKETS, drop_last=True)
        return len(loader), [acc.gather_for_metrics(b["x"]).ravel().tolist() for b in loader]

    _, results = run_accelerators(2, body)
    for steps, got in unwrap(results):
        assert steps == 2 and got == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_a_backend_with_global_batches_refuses_steps_of_unequal_batches():
    def body(acc):
        acc._backend.uneven_batches = False
        return [b["x"].ravel().tolist() for b in _batch_loader(acc, BUCKETS)]

    _, results = run_accelerators(2, body)
    assert all(isinstance(r, ValueError) and "uneven-batches" in str(r) for r in results)


def test_batch_layout_repeats():
    assert BatchLayout((3, 3, 3), (1, 0, 0)).repeats == 8
    assert not BatchLayout((2, 1), (2, 1)).even and BatchLayout((2, 2), (2, 0)).even


# -- torch samplers in one process ---------------------------------------------------------------------
@needs_torch
def test_a_sampler_whose_order_changed_is_a_clear_error_on_resume(tmp_path):
    import torch

    class Drifting(torch.utils.data.Sampler):
        """Another order every time it is drawn, whatever the epoch or seed (a hidden counter)."""

        def __init__(self):
            self.draws = 0

        def __len__(self):
            return 6

        def __iter__(self):
            self.draws += 1
            return iter(np.roll(np.arange(6), self.draws).tolist())

    def run():
        acc = unified.Accelerator(backend="torch")
        loader = acc.prepare(torch.utils.data.DataLoader(Ids(6), batch_size=2, sampler=Drifting()))
        return acc, loader

    acc, loader = run()
    next(iter(loader))
    acc.save_state(str(tmp_path / "ckpt"))
    fresh, again = run()
    again._source.sampler.draws = 5  # its hidden state differs: the epoch's order is not the saved one
    fresh.load_state(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="sampler-order-changed"):
        next(iter(again))


@needs_torch
def test_a_stateful_sampler_resumes_from_its_state_at_the_epoch_start(tmp_path):
    import torch

    class Moving(torch.utils.data.Sampler):
        def __init__(self):
            self.rng = np.random.default_rng(3)

        def __len__(self):
            return 7

        def __iter__(self):
            return iter(self.rng.permutation(7).tolist())

        def state_dict(self):
            return {"rng": self.rng.bit_generator.state, "tensor": torch.arange(3)}

        def load_state_dict(self, state):
            assert isinstance(state["tensor"], torch.Tensor)
            self.rng.bit_generator.state = state["rng"]

    def run():
        acc = unified.Accelerator(backend="torch")
        return acc, acc.prepare(torch.utils.data.DataLoader(Ids(7), batch_size=2, sampler=Moving()))

    acc, loader = run()
    list(loader)
    it = iter(loader)
    next(it)
    acc.save_state(str(tmp_path / "ckpt"))
    expected = [b["x"].ravel().tolist() for b in it] + [b["x"].ravel().tolist() for b in loader]
    fresh, again = run()
    fresh.load_state(str(tmp_path / "ckpt"))
    assert [b["x"].ravel().tolist() for b in again] + [b["x"].ravel().tolist() for b in again] == expected


@needs_torch
def test_drawing_a_sampler_leaves_the_training_random_numbers_alone():
    import random

    import torch

    class UsesEverything(torch.utils.data.Sampler):
        def __len__(self):
            return 4

        def __iter__(self):
            random.random(), np.random.rand(), torch.rand(1)
            return iter(torch.randperm(4).tolist())

    acc = unified.Accelerator(backend="torch", seed=0)
    loader = acc.prepare(torch.utils.data.DataLoader(Ids(4), batch_size=2, sampler=UsesEverything()))
    unified.utils.set_seed(5)
    before = (random.random(), np.random.rand(), torch.rand(1).item())
    unified.utils.set_seed(5)
    first = [b["x"].ravel().tolist() for b in loader]
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == before
    list(loader)  # epoch 1 drawn; epoch 0 is drawn again below
    loader.set_epoch(0)
    assert [b["x"].ravel().tolist() for b in loader] == first  # the same epoch, the same order


@needs_torch
def test_a_distributed_sampler_is_refused_rather_than_sharded_twice():
    import torch

    from backends.common import prepare_torch_loader

    class TwoProcesses:
        process_index, num_processes, uneven_batches, device = 0, 2, True, None

        def place_batch(self, batch):
            return batch

    sampler = torch.utils.data.distributed.DistributedSampler(Ids(8), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="torch-distributed-sampler"):
        prepare_torch_loader(TwoProcesses(), torch.utils.data.DataLoader(Ids(8), batch_size=2, sampler=sampler), 0)
