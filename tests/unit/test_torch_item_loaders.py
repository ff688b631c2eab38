"""``prepare()`` of a torch ``DataLoader(dataset, batch_size=None)`` (issue 50): automatic batching
off, so each item the sampler draws (an index, or a list of indices when the sampler is a
``BatchSampler``) is already a batch, ``dataset[item]`` passed through the loader's ``collate_fn``.
As Accelerate's ``BatchSamplerShard`` deals them: step ``k`` gives process ``r`` item ``k*P + r``,
an uneven end is filled up with the epoch's first items (marked as repeats for
``gather_for_metrics``), and a checkpoint resumes at the next step without loading a skipped item."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler, default_collate  # noqa: E402

from backends.common import prepare_torch_loader  # noqa: E402
from unified import Accelerator  # noqa: E402
from unified.backend import ForeignLoaders  # noqa: E402

from .memory_backend import MemoryBackend, MemoryGroup, run_threads, unwrap  # noqa: E402


class PreBatched(Dataset):
    """Item ``i`` is a batch of ``rows(i)`` rows holding ``i``: automatic batching is off."""

    def __init__(self, n, rows=lambda i: 2):
        self.n, self.rows = n, rows

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((self.rows(i),), i)}


class Samples(Dataset):
    """Accelerate's DummyDataset: a list of indices gives the list of their samples."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if isinstance(index, int):
            return {"index": index}
        return [{"index": i} for i in index]


class Rank:
    """A process of a group as the loaders see it (no collectives)."""

    uneven_batches, device = True, None

    def __init__(self, rank, processes):
        self.process_index, self.num_processes = rank, processes

    def place_batch(self, batch):
        return batch


def _accelerate_shares(make_loader, processes):
    from accelerate.data_loader import prepare_data_loader

    return [[b["index"].tolist() for b in prepare_data_loader(make_loader(), num_processes=processes,
                                                             process_index=r, put_on_device=False)]
            for r in range(processes)]


def test_one_process_yields_every_item_as_its_own_batch_as_accelerate(torch_accelerator):
    pytest.importorskip("accelerate")
    from accelerate.data_loader import prepare_data_loader

    prepared = torch_accelerator.prepare(DataLoader(PreBatched(5), batch_size=None))
    reference = prepare_data_loader(DataLoader(PreBatched(5), batch_size=None), num_processes=1, process_index=0)
    assert len(prepared) == len(reference) == 5
    assert [b["x"].tolist() for b in prepared] == [b["x"].tolist() for b in reference]


def test_two_processes_share_a_batch_samplers_items_as_accelerate():
    """Accelerate's own case (test_distributed_data_loop.py): a BatchSampler as the sampler, batch_size=None."""
    pytest.importorskip("accelerate")

    def make():
        return DataLoader(Samples(16), sampler=BatchSampler(SequentialSampler(range(16)), 4, False),
                          batch_size=None, collate_fn=default_collate)

    ours = [[b["index"].tolist() for b in prepare_torch_loader(Rank(r, 2), make(), 0)] for r in range(2)]
    assert ours == _accelerate_shares(make, 2) == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]


def test_plain_items_are_dealt_round_robin_and_the_end_is_filled_with_the_first_items():
    loaders = [prepare_torch_loader(Rank(r, 2), DataLoader(PreBatched(5, rows=lambda i: 1), batch_size=None), 0)
               for r in range(2)]
    assert [len(loader) for loader in loaders] == [3, 3]
    assert [[b["x"].tolist() for b in loader] for loader in loaders] == [[[0], [2], [4]], [[1], [3], [0]]]
    assert [loaders[0].padding_in_batch(k) for k in range(3)] == [0, 0, 1]  # items repeated in each step


def test_a_batch_samplers_drop_last_drops_the_incomplete_step_as_accelerate():
    pytest.importorskip("accelerate")

    def make():
        return DataLoader(Samples(10), sampler=BatchSampler(SequentialSampler(range(10)), 4, True),
                          batch_size=None, collate_fn=default_collate)

    ours = [[b["index"].tolist() for b in prepare_torch_loader(Rank(r, 2), make(), 0)] for r in range(2)]
    assert ours == _accelerate_shares(make, 2) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]


def test_resume_mid_epoch_continues_with_the_next_item_without_loading_the_skipped(torch_accelerator):
    loaded = []

    class Counted(PreBatched):
        def __getitem__(self, i):
            loaded.append(i)
            return super().__getitem__(i)

    def make():
        return torch_accelerator.prepare(DataLoader(Counted(7), batch_size=None, shuffle=True))

    first = make()
    seen, state = [], None
    for step, batch in enumerate(first):
        seen.append(int(batch["x"][0]))
        if step == 2:
            state = first.state_dict()
    assert sorted(seen) == list(range(7))  # one epoch, shuffled, every item once
    again = make()
    again.load_state_dict(state)
    loaded.clear()
    assert [int(b["x"][0]) for b in again] == seen[3:]
    assert loaded == seen[3:]  # the skipped items were never read
    assert [int(b["x"][0]) for b in torch_accelerator.skip_first_batches(make(), 5)] == seen[5:]


class _TorchLoadersMemory(MemoryBackend, ForeignLoaders):
    """A memory rank that prepares torch DataLoaders as the torch backend does (NumPy batches)."""

    def prepare_loader(self, loader, seed):
        return prepare_torch_loader(self, loader, seed)

    def place_batch(self, batch):
        return {k: v.numpy() for k, v in batch.items()}


def test_gather_for_metrics_counts_every_item_once_when_the_end_repeats_items_of_other_sizes():
    """Item ``i`` has ``i + 1`` rows; 5 items on 2 processes: the last step repeats item 0 (1 row)
    next to item 4 (5 rows), so the processes' rows differ and only they know them."""
    group = MemoryGroup(2)
    group.backends = [_TorchLoadersMemory(group, r) for r in range(2)]

    def rank(r):
        acc = group.accelerator(r)
        loader = acc.prepare(DataLoader(PreBatched(5, rows=lambda i: i + 1), batch_size=None))
        return [acc.gather_for_metrics(batch)["x"].tolist() for batch in loader]

    gathered = unwrap(run_threads(2, rank, group=group))
    assert gathered[0] == gathered[1]
    assert sorted(np.concatenate(gathered[0]).tolist()) == sorted(i for i in range(5) for _ in range(i + 1))


def test_a_stream_with_batch_size_none_is_still_refused_with_the_reason():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(NotImplementedError, match="batch_size="):
        prepare_torch_loader(Rank(0, 2), DataLoader(Stream(), batch_size=None), 0)


def test_an_accelerator_prepares_it_on_the_torch_backend():
    acc = Accelerator(backend="torch", seed=3)
    try:
        loader = acc.prepare(DataLoader(PreBatched(4), batch_size=None))
        assert [b["x"].tolist() for b in loader] == [[i, i] for i in range(4)]
    finally:
        acc.end_training()
