"""``DataLoaderConfiguration(dispatch_batches=True)`` (issue 50): process 0 reads the loader, each
step concatenates ``P`` of its batches and broadcasts them, and process ``r`` keeps its rows, as
Accelerate 1.15's ``DataLoaderDispatcher`` (`unified.data.dispatch`).

The processes of a group are threads here (`memory_backend.MemoryGroup`, torch tensors), with the
Accelerator's real collectives. ``ACCELERATE`` holds what Accelerate 1.15 gave each process, run
under ``torchrun --nproc-per-node 2`` and ``3`` on gloo (CPU), for a torch ``DataLoader`` over
``list(range(n))`` and over an ``IterableDataset`` of the same items (the same batches), with
``even_batches`` True and False (the same batches: the dispatcher does not read it).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

from backends.common import prepare_torch_loader  # noqa: E402
from backends.torch.tensors import export_tensor, tensor_from_numpy  # noqa: E402
from unified import DataLoaderConfiguration  # noqa: E402
from unified.backend import ForeignLoaders  # noqa: E402
from unified.checkpoint import codec  # noqa: E402
from unified.data import prepare_loader, skip_first_batches  # noqa: E402
from unified.runtime.collectives import Collectives  # noqa: E402

from .memory_backend import MemoryBackend, MemoryGroup, run_threads, unwrap  # noqa: E402

# (processes, items, batch_size, drop_last): (each process's batches, "/" between processes and
# "|" between batches; len(); end_of_dataloader after each batch), from Accelerate 1.15
ACCELERATE = {
    (2, 13, 2, False): ('0 1|4 5|8 9|12 / 2 3|6 7|10 11|0', 4, 'FFFT'),
    (2, 13, 2, True): ('0 1|4 5|8 9 / 2 3|6 7|10 11', 3, 'FFT'),
    (2, 13, 4, False): ('0 1 2 3|8 9 10 / 4 5 6 7|11 12 0', 2, 'FT'),
    (2, 13, 4, True): ('0 1 2 3 / 4 5 6 7', 1, 'T'),
    (2, 11, 2, False): ('0 1|4 5|8 9 / 2 3|6 7|10 0', 3, 'FFT'),
    (2, 11, 2, True): ('0 1|4 5 / 2 3|6 7', 2, 'FT'),
    (2, 11, 4, False): ('0 1 2 3|8 9 / 4 5 6 7|10 0', 2, 'FT'),
    (2, 11, 4, True): ('0 1 2 3 / 4 5 6 7', 1, 'T'),
    (2, 10, 2, False): ('0 1|4 5|8 / 2 3|6 7|9', 3, 'FFT'),
    (2, 10, 2, True): ('0 1|4 5 / 2 3|6 7', 2, 'FT'),
    (2, 10, 4, False): ('0 1 2 3|8 / 4 5 6 7|9', 2, 'FT'),
    (2, 10, 4, True): ('0 1 2 3 / 4 5 6 7', 1, 'T'),
    (2, 16, 2, False): ('0 1|4 5|8 9|12 13 / 2 3|6 7|10 11|14 15', 4, 'FFFT'),
    (2, 16, 2, True): ('0 1|4 5|8 9|12 13 / 2 3|6 7|10 11|14 15', 4, 'FFFT'),
    (2, 16, 4, False): ('0 1 2 3|8 9 10 11 / 4 5 6 7|12 13 14 15', 2, 'FT'),
    (2, 16, 4, True): ('0 1 2 3|8 9 10 11 / 4 5 6 7|12 13 14 15', 2, 'FT'),
    (2, 1, 2, False): ('0 / 0', 1, 'T'),
    (2, 1, 4, False): ('0 / 0', 1, 'T'),
    (3, 13, 2, False): ('0 1|6 7|12 / 2 3|8 9|0 / 4 5|10 11|1', 3, 'FFT'),
    (3, 13, 2, True): ('0 1|6 7 / 2 3|8 9 / 4 5|10 11', 2, 'FT'),
    (3, 13, 4, False): ('0 1 2 3|12 / 4 5 6 7|0 / 8 9 10 11|1', 2, 'FT'),
    (3, 13, 4, True): ('0 1 2 3 / 4 5 6 7 / 8 9 10 11', 1, 'T'),
    (3, 11, 2, False): ('0 1|6 7 / 2 3|8 9 / 4 5|10 0', 2, 'FT'),
    (3, 11, 2, True): ('0 1 / 2 3 / 4 5', 1, 'T'),
    (3, 11, 4, False): ('0 1 2 3 / 4 5 6 7 / 8 9 10 0', 1, 'T'),
    (3, 10, 2, False): ('0 1|6 7 / 2 3|8 9 / 4 5|0 1', 2, 'FT'),
    (3, 10, 2, True): ('0 1 / 2 3 / 4 5', 1, 'T'),
    (3, 10, 4, False): ('0 1 2 3 / 4 5 6 7 / 8 9 0 1', 1, 'T'),
    (3, 16, 2, False): ('0 1|6 7|12 13 / 2 3|8 9|14 15 / 4 5|10 11|0 1', 3, 'FFT'),
    (3, 16, 2, True): ('0 1|6 7 / 2 3|8 9 / 4 5|10 11', 2, 'FT'),
    (3, 16, 4, False): ('0 1 2 3|12 13 / 4 5 6 7|14 15 / 8 9 10 11|0 1', 2, 'FT'),
    (3, 16, 4, True): ('0 1 2 3 / 4 5 6 7 / 8 9 10 11', 1, 'T'),
    (3, 1, 2, False): ('0 / 0 / ', 1, 'T'),
    (3, 1, 4, False): ('0 / 0 / ', 1, 'T'),
}
# Accelerate 1.15, 5 items {"x": [i, 10 i], "y": (i, float(i))}, batch_size=2 (the tuple collated to a list)
ACCELERATE_NESTED = {
    2: [[{"x": [[0, 0], [1, 10]], "y": [[0, 1], [0.0, 1.0]]}, {"x": [[4, 40]], "y": [[4], [4.0]]}],
        [{"x": [[2, 20], [3, 30]], "y": [[2, 3], [2.0, 3.0]]}, {"x": [[0, 0]], "y": [[0], [0.0]]}]],
    3: [[{"x": [[0, 0], [1, 10]], "y": [[0, 1], [0.0, 1.0]]}], [{"x": [[2, 20], [3, 30]], "y": [[2, 3], [2.0, 3.0]]}],
        [{"x": [[4, 40], [0, 0]], "y": [[4, 0], [4.0, 0.0]]}]],
}
# Accelerate 1.15, gather_for_metrics of each batch of 13 items, batch_size=2: the last step's repeats dropped
ACCELERATE_GATHERED = {2: [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12]],
                       3: [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12]]}


def _expected(text):
    return [[[int(x) for x in batch.split()] for batch in process.split("|")] for process in text.split(" / ")]


class Items(IterableDataset):
    """``range(n)`` as a stream (no ``__len__``); counts what it yields."""

    def __init__(self, n):
        self.n, self.reads = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.reads += 1
            yield i


class StatefulItems(Items):
    """torchdata's protocol: the position lives in the dataset."""

    def __init__(self, n):
        super().__init__(n)
        self.next = 0

    def __iter__(self):
        while self.next < self.n:
            i, self.next = self.next, self.next + 1
            self.reads += 1
            yield i
        self.next = 0

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


class TorchThreads(MemoryBackend, ForeignLoaders):
    """A `MemoryBackend` rank whose arrays are torch tensors and which adapts torch DataLoaders."""

    def is_array(self, value):
        return isinstance(value, torch.Tensor)

    def _arrays(self, arrays):
        return [a.clone() for a in arrays]

    def broadcast_arrays(self, arrays, src, key, timeout):
        sent = self._exchange("broadcast_arrays", key, timeout, self._arrays(arrays), src)[src]
        assert [(a.shape, a.dtype) for a in sent] == [(a.shape, a.dtype) for a in arrays]
        return [a.clone() for a in sent]

    def from_numpy(self, value, like=None):
        return tensor_from_numpy(np.array(value))

    def to_numpy(self, value):
        return value.numpy().copy()

    def export_array(self, value):
        return export_tensor(value)

    def prepare_loader(self, loader, seed):
        return prepare_torch_loader(self, loader, seed)


def _group(processes):
    group = MemoryGroup(processes, timeout_default=20.0)
    group.backends = [TorchThreads(group, rank) for rank in range(processes)]
    return group


def _dispatched(group, rank, make_loader, seed=0):
    backend = group.backends[rank]
    loader = prepare_loader(make_loader(), backend, seed, dispatch=True)
    if not hasattr(backend, "collectives"):  # one per process, as an Accelerator's (its keys count its calls)
        backend.collectives = Collectives(backend, group.timeout_default)
    loader.connect(backend.collectives)
    return loader


def _on_every_process(processes, body):
    """``body(rank, group)`` on ``processes`` threads; each one's result (raises the first failure)."""
    group = _group(processes)
    results = unwrap(run_threads(processes, lambda rank: body(rank, group), deadline=60.0, group=group))
    assert not group.key_errors, group.key_errors
    return results


def _ids(batch):
    return batch.tolist()


def _saved(state):
    """``state`` through the checkpoint's encoding (JSON + arrays, no pickle), as `load_state` gets it."""
    structure, arrays = codec.encode(state, lambda v: isinstance(v, torch.Tensor), "dataloader_0")
    structure = json.loads(json.dumps(structure))
    return codec.decode(structure, {k: np.array(v) for k, v in arrays.items()}, lambda a: a)


@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "IterableDataset"])
@pytest.mark.parametrize("case", sorted(ACCELERATE), ids=lambda c: "P{}-n{}-bs{}-drop{}".format(*c))
def test_every_process_gets_accelerates_batches(case, iterable):
    processes, n, batch_size, drop_last = case
    text, length, ends = ACCELERATE[case]

    def body(rank, group):
        loader = _dispatched(group, rank, lambda: DataLoader(Items(n) if iterable else list(range(n)),
                                                             batch_size=batch_size, drop_last=drop_last))
        last = []
        loader.on_batch = last.append
        batches = [_ids(b) for b in loader]
        return batches, "".join("T" if x else "F" for x in last), None if iterable else len(loader)

    results = _on_every_process(processes, body)
    assert [batches for batches, _, _ in results] == _expected(text)
    assert {flags for _, flags, _ in results} == {ends}  # the step Accelerate marks end_of_dataloader
    if not iterable:
        assert {size for _, _, size in results} == {length}


@pytest.mark.parametrize("processes", [2, 3])
def test_nested_batches_keep_their_nesting_and_the_repeats_are_marked(processes):
    def make():
        return DataLoader([{"x": torch.tensor([i, 10 * i]), "y": (torch.tensor(i), torch.tensor(float(i)))}
                           for i in range(5)], batch_size=2)

    def body(rank, group):
        loader = _dispatched(group, rank, make)
        out = []
        for batch in loader:
            assert type(batch) is dict and type(batch["y"]) is list and batch["y"][1].dtype == torch.float32
            out.append({"x": batch["x"].tolist(), "y": [batch["y"][0].tolist(), batch["y"][1].tolist()]})
        return out

    assert _on_every_process(processes, body) == ACCELERATE_NESTED[processes]


@pytest.mark.parametrize("processes", [2, 3])
def test_the_layout_marks_the_rows_that_fill_up_the_last_step_as_accelerates_gather_for_metrics(processes):
    def body(rank, group):
        loader = _dispatched(group, rank, lambda: DataLoader(list(range(13)), batch_size=2))
        return [(_ids(b), loader.batch_layout().kept) for b in loader]

    results = _on_every_process(processes, body)
    gathered = [[x for rank in range(processes) for x in results[rank][k][0][:results[rank][k][1][rank]]]
                for k in range(len(results[0]))]
    assert gathered == ACCELERATE_GATHERED[processes]


@pytest.mark.parametrize("processes", [2, 3])
def test_skip_first_batches_counts_steps_and_keeps_the_epochs_first_rows(processes):
    """As Accelerate's dispatcher over an IterableDataset (``skip_batches`` counts steps; its map-style
    one skips the loader's batches instead: see docs/migration.md): the rest of the epoch, the
    last step filled up with the epoch's first rows; the next epoch whole. A map-style loader loads
    only the epoch's first step to skip."""
    def body(rank, group):
        reads = []

        class Counted(list):
            def __getitem__(self, i):
                reads.append(i)
                return list.__getitem__(self, i)

        loader = _dispatched(group, rank, lambda: DataLoader(Counted(range(13)), batch_size=2))
        stream = _dispatched(group, rank, lambda: DataLoader(Items(13), batch_size=2))
        skipped = [_ids(b) for b in skip_first_batches(loader, 2)]
        loaded = sorted(reads)
        return skipped, loaded, [_ids(b) for b in loader], [_ids(b) for b in skip_first_batches(stream, 2)]

    full = _expected(ACCELERATE[(processes, 13, 2, False)][0])
    for rank, (skipped, loaded, after, streamed) in enumerate(_on_every_process(processes, body)):
        assert skipped == streamed == full[rank][2:]
        assert after == full[rank]
        # process 0: the epoch's first step (for its first rows), then from step 2 (the loader's own last
        # batch, [12], is read as its one-process form makes it: [12, 0]); the others read nothing
        assert loaded == (sorted([*range(2 * processes), *range(4 * processes, 13), 0]) if rank == 0 else [])


@pytest.mark.parametrize("kind", ["map-style", "stream", "stateful stream"])
@pytest.mark.parametrize("processes", [2, 3])
def test_a_mid_epoch_state_resumes_with_exactly_the_remaining_batches(processes, kind):
    """state_dict (process 0's, written by save_state) after 2 steps; fresh loaders on every process
    load it and yield exactly what the uninterrupted loader yields, the last step filled up with
    the epoch's first rows (from the checkpoint), then the next epoch."""
    datasets = {}

    def make(rank, tag):
        if kind == "map-style":
            return DataLoader(list(range(13)), batch_size=2)
        datasets[rank, tag] = (StatefulItems if kind == "stateful stream" else Items)(13)
        return DataLoader(datasets[rank, tag], batch_size=2)

    shared = {}

    def body(rank, group):
        loader = _dispatched(group, rank, lambda: make(rank, "first"))
        seen = []
        for batch in loader:
            seen.append(_ids(batch))
            if len(seen) == 2:
                shared[rank] = loader.state_dict()
                break
        rest = [_ids(b) for b in loader] + [_ids(b) for b in loader]
        fresh = _dispatched(group, rank, lambda: make(rank, "fresh"))
        state = _saved(_wait_for(shared, 0))  # what save_state wrote: process 0's
        fresh.check_state_dict(state)
        fresh.load_state_dict(state)
        resumed = [_ids(b) for b in fresh] + [_ids(b) for b in fresh]
        return seen, rest, resumed

    full = _expected(ACCELERATE[(processes, 13, 2, False)][0])
    for rank, (seen, rest, resumed) in enumerate(_on_every_process(processes, body)):
        assert seen == full[rank][:2]
        assert rest == full[rank][2:] + full[rank]
        assert resumed == rest
    if kind == "stateful stream":  # continued from the dataset's own state: the first 2 steps not read again
        assert datasets[0, "fresh"].reads == 2 * 13 - 2 * 2 * processes
    assert all(datasets.get((rank, tag)) is None or datasets[rank, tag].reads == 0
               for rank in range(1, processes) for tag in ("first", "fresh"))  # only process 0 reads


def _wait_for(shared, rank):
    import time

    deadline = time.monotonic() + 30
    while rank not in shared and time.monotonic() < deadline:
        time.sleep(0.01)
    return shared[rank]


def test_a_state_resumes_with_another_process_count_at_the_same_batch():
    """Saved by 2 processes after 3 steps (6 of the loader's batches), loaded by 3: 2 steps taken;
    the last step is filled up with the epoch's first 3 rows (read again: the checkpoint holds 2)."""
    def make():
        return DataLoader(list(range(26)), batch_size=2)

    def save(rank, group):
        loader = _dispatched(group, rank, make)
        for step, _ in enumerate(loader, 1):
            if step == 3:
                return _saved(loader.state_dict())

    state = _on_every_process(2, save)[0]

    def load(rank, group):
        loader = _dispatched(group, rank, make)
        loader.check_state_dict(state)
        loader.load_state_dict(state)
        return loader.position, [_ids(b) for b in loader]

    results = _on_every_process(3, load)
    assert {position for position, _ in results} == {2}
    rest = [x for k in range(len(results[0][1])) for rank in range(3) for x in results[rank][1][k]]
    assert rest == list(range(12, 26)) + [0]  # 14 items left: the last step of 3 rows filled up with item 0


def test_a_failure_on_the_main_process_reaches_every_process():
    class Broken(list):
        def __getitem__(self, i):
            if i == 5:
                raise KeyError("sample 5 is missing")
            return list.__getitem__(self, i)

    def body(rank, group):
        loader = _dispatched(group, rank, lambda: DataLoader(Broken(range(13)), batch_size=2))
        return [_ids(b) for b in loader]

    group = _group(2)
    main, other = run_threads(2, lambda rank: body(rank, group), deadline=60.0, group=group)
    assert isinstance(main, KeyError)
    assert isinstance(other, RuntimeError) and "sample 5 is missing" in str(other) and "dispatch-main-failed" in str(
        other)


def test_batches_that_are_not_arrays_are_refused_on_every_process_as_accelerate_cannot_dispatch_them():
    def body(rank, group):
        loader = _dispatched(group, rank, lambda: DataLoader(["a", "b", "c"], batch_size=2))
        return [b for b in loader]

    group = _group(2)
    main, other = run_threads(2, lambda rank: body(rank, group), deadline=60.0, group=group)
    assert isinstance(main, TypeError) and "dispatch-batch-types" in str(main)
    assert isinstance(other, RuntimeError) and "TypeError" in str(other)


def test_batches_of_different_shapes_are_refused_as_accelerate():
    def collate(items):
        return torch.zeros(len(items), items[0] + 1)  # each batch as wide as its first item

    def body(rank, group):
        return [b.shape for b in _dispatched(group, rank, lambda: DataLoader(list(range(5)), batch_size=2,
                                                                               collate_fn=collate))]

    group = _group(2)
    main, _ = run_threads(2, lambda rank: body(rank, group), deadline=60.0, group=group)
    assert isinstance(main, RuntimeError) and "batches of different size" in str(main)


def test_bfloat16_and_the_loader_attributes():
    def body(rank, group):
        loader = _dispatched(group, rank, lambda: DataLoader(torch.arange(6, dtype=torch.bfloat16), batch_size=2))
        batches = list(loader)
        return ([b.dtype for b in batches], [b.float().tolist() for b in batches], len(loader), loader.batch_size,
                loader.total_batch_size, loader.total_dataset_length)

    results = _on_every_process(2, body)
    # the last step is one batch of 2 rows: 1 row each, none repeated (2 divides by 2)
    assert results[0] == ([torch.bfloat16] * 2, [[0.0, 1.0], [4.0]], 2, 2, 4, 6)
    assert results[1][1] == [[2.0, 3.0], [5.0]]


def test_one_process_yields_the_loaders_own_batches():
    def body(rank, group):
        return [_ids(b) for b in _dispatched(group, rank, lambda: DataLoader(list(range(5)), batch_size=2))]

    assert _on_every_process(1, body) == [[[0, 1], [2, 3], [4]]]


def test_a_backend_whose_batches_are_global_arrays_names_its_own_way():
    class GlobalArrays(TorchThreads):
        uneven_batches = False

    group = MemoryGroup(2)
    with pytest.raises(NotImplementedError, match="dispatch_batches=True.*global array") as info:
        prepare_loader(DataLoader(list(range(4)), batch_size=2), GlobalArrays(group, 0), 0, dispatch=True)
    assert "dispatch-batches-jax" in str(info.value)
    assert prepare_loader(object(), GlobalArrays(group, 0), 0, dispatch=True) is None  # not a loader


def test_the_configuration_accepts_dispatch_batches_and_even_batches_with_it():
    """Refused before issue 50 (NotImplementedError when the Accelerator was made)."""
    DataLoaderConfiguration(dispatch_batches=True).check()
    DataLoaderConfiguration(dispatch_batches=True, even_batches=False).check()  # no effect, as in Accelerate
    DataLoaderConfiguration(even_batches=False).check()  # and without it (tests/unit/test_accelerate_suite_gaps.py)
    acc = MemoryGroup(1).accelerator(0, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    assert acc.dispatch_batches is True


def test_an_accelerator_with_dispatch_batches_prepares_a_dispatched_loader_and_checkpoints_it(tmp_path):
    """Through `Accelerator.prepare`, `save_state` and `load_state` (two processes as threads)."""
    config = DataLoaderConfiguration(dispatch_batches=True)
    saving, loading = _group(2), _group(2)  # (a fresh Accelerator counts its collectives from 1 again)

    def save(rank):
        acc = saving.accelerator(rank, dataloader_config=config)
        loader = acc.prepare(DataLoader(list(range(13)), batch_size=2))
        assert type(loader).__name__ == "DispatchedLoader"
        seen = []
        for batch in loader:
            seen.append(_ids(batch))
            if len(seen) == 2:
                acc.save_state(str(tmp_path / "ckpt"))
                break
        return seen + [_ids(b) for b in loader]

    def load(rank):
        acc = loading.accelerator(rank, dataloader_config=config)
        again = acc.prepare(DataLoader(list(range(13)), batch_size=2))
        acc.load_state(str(tmp_path / "ckpt"))
        return [_ids(b) for b in again]

    full = _expected(ACCELERATE[(2, 13, 2, False)][0])
    assert unwrap(run_threads(2, save, deadline=90.0, group=saving)) == full
    assert unwrap(run_threads(2, load, deadline=90.0, group=loading)) == [batches[2:] for batches in full]


# Accelerate 1.15 on 2 processes, DataLoaderConfiguration(dispatch_batches=True, split_batches=True):
# (items, batch_size, drop_last) -> (each process's batches, len()), the same for map-style and a stream
ACCELERATE_SPLIT = {
    (13, 4, False): ("0 1|4 5|8 9|12 / 2 3|6 7|10 11|0", 4),
    (13, 4, True): ("0 1|4 5|8 9 / 2 3|6 7|10 11", 3),
    (16, 4, False): ("0 1|4 5|8 9|12 13 / 2 3|6 7|10 11|14 15", 4),
    (10, 2, False): ("0|2|4|6|8 / 1|3|5|7|9", 5),
    (11, 6, False): ("0 1 2|6 7 8 / 3 4 5|9 10 0", 2),
    (3, 2, False): ("0|2 / 1|0", 2),
    (9, 4, False): ("0 1|4 5|8 / 2 3|6 7|0", 3),
}


@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "IterableDataset"])
@pytest.mark.parametrize("case", sorted(ACCELERATE_SPLIT), ids=lambda c: "n{}-bs{}-drop{}".format(*c))
def test_split_batches_splits_each_batch_as_accelerate(case, iterable):
    """Refused before (DataLoaderConfiguration(split_batches=True): NotImplementedError)."""
    n, batch_size, drop_last = case
    text, length = ACCELERATE_SPLIT[case]

    def body(rank, group):
        backend = group.backends[rank]
        loader = prepare_loader(DataLoader(Items(n) if iterable else list(range(n)), batch_size=batch_size,
                                           drop_last=drop_last), backend, 0, dispatch=True, split_batches=True)
        backend.collectives = Collectives(backend, group.timeout_default)
        loader.connect(backend.collectives)
        return [_ids(b) for b in loader], None if iterable else len(loader)

    results = _on_every_process(2, body)
    assert [batches for batches, _ in results] == _expected(text)
    if not iterable:
        assert {size for _, size in results} == {length}
    DataLoaderConfiguration(dispatch_batches=True, split_batches=True).check()


def test_split_batches_needs_a_batch_size_that_divides_by_the_processes():
    def body(rank, group):
        with pytest.raises(ValueError, match=r"batch size \(3\) needs to be a round multiple .* \(2\)"):
            prepare_loader(DataLoader(list(range(8)), batch_size=3), group.backends[rank], 0, dispatch=True,
                           split_batches=True)

    _on_every_process(2, body)


def test_slice_fn_for_dispatch_picks_each_process_part():
    """Accelerate 1.15 gives [[0, 100], [400, 500]] / [[201, 301], [601, 101]] here: its fill rows
    (the epoch's first, on process 1's last step) went through slice_fn already (a documented
    difference, docs/migration.md); unified passes them raw."""
    def slice_fn(batch, part, process_index, num_processes):
        return batch[part] * 100 + process_index

    def body(rank, group):
        loader = _dispatched(group, rank, lambda: DataLoader(list(range(7)), batch_size=2))
        loader.slice_fn = slice_fn
        return [_ids(b) for b in loader]

    assert _on_every_process(2, body) == [[[0, 100], [400, 500]], [[201, 301], [601, 1]]]
