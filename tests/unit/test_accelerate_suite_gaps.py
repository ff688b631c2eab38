"""What Accelerate 1.15's own tests use that unified lacked (issue 50, measured by
``python -m tests.upstream.accelerate_suite``): each test here is the smallest form of one of them,
on one process."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


def _loader(n: int, batch_size: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size)


def test_active_dataloader_is_the_innermost_loader_being_iterated(torch_accelerator):
    """Accelerate's test_sync.py test_dataloader_break: an evaluation loop inside a training loop."""
    acc = torch_accelerator
    first, second = acc.prepare(_loader(10, 2), _loader(6, 2))
    state = acc.gradient_state
    assert state.active_dataloader is None and not state.in_dataloader
    for i, _ in enumerate(first):
        assert state.active_dataloader is first and state.in_dataloader
        if i == 1:
            for j, _ in enumerate(second):
                assert state.active_dataloader is second
                assert state.end_of_dataloader == (j == len(second) - 1)
            assert state.active_dataloader is first
        assert state.end_of_dataloader == (i == len(first) - 1)  # the inner loop's end is not the outer's
    assert state.active_dataloader is None


def test_state_waits_and_destroys_the_process_group_as_accelerates():
    """Accelerate's test_script.py / test_sync.py end with ``accelerator.state.destroy_process_group()``
    after ``state.wait_for_everyone()`` calls."""
    from unified import Accelerator

    acc = Accelerator(backend="torch")
    acc.state.wait_for_everyone()
    with pytest.raises(NotImplementedError, match="sub-groups"):
        acc.state.destroy_process_group(group=object())
    acc.state.destroy_process_group()
    acc.state.destroy_process_group()  # as end_training(): once is enough, twice is harmless


# Accelerate 1.15's BatchSamplerShard(even_batches=False) over BatchSampler(range(n), b, drop_last)
# on P processes: (n, b, P, drop_last) -> each process's batches ("/" between processes, "|" between batches)
UNEVEN = {
    (3, 1, 2, False): "0|2 / 1",
    (7, 2, 2, False): "0 1|4 5 / 2 3|6",
    (7, 2, 3, False): "0 1|6 / 2 3 / 4 5",
    (10, 4, 3, False): "0 1 2 3 / 4 5 6 7 / 8 9",
    (10, 2, 3, True): "0 1 / 2 3 / 4 5",
    (1, 2, 2, False): "0 / ",
}


class _Rank:
    """Process ``r`` of ``p`` as a prepared loader sees it (batches left on the host)."""

    uneven_batches, device = True, None

    def __init__(self, rank, processes):
        self.process_index, self.num_processes = rank, processes

    def place_batch(self, batch):
        return batch

    def prepare_loader(self, loader, seed):
        from backends.common import prepare_torch_loader

        return prepare_torch_loader(self, loader, seed)


def _shown(batches):
    return "|".join(" ".join(str(int(x)) for x in (b[0] if isinstance(b, list) else b)) for b in batches)


@pytest.mark.parametrize("kind", ["unified", "torch", "batch_sampler"])
@pytest.mark.parametrize("case", sorted(UNEVEN))
def test_even_batches_false_gives_each_process_accelerates_batches(case, kind):
    """Accelerate's test_distributed_data_loop.py test_can_disable_even_batches, and more shapes."""
    import numpy as np
    from torch.utils.data import BatchSampler, SequentialSampler

    from unified import DataLoader as UnifiedLoader
    from unified.backend import ForeignLoaders
    from unified.data import prepare_loader

    ForeignLoaders.register(_Rank)
    n, b, p, drop_last = case
    shown = []
    for rank in range(p):
        if kind == "unified":
            loader = UnifiedLoader(np.arange(n), batch_size=b, drop_last=drop_last)
        elif kind == "torch":
            loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=b, drop_last=drop_last)
        else:
            loader = DataLoader(TensorDataset(torch.arange(n)),
                                batch_sampler=BatchSampler(SequentialSampler(range(n)), b, drop_last))
        prepared = prepare_loader(loader, _Rank(rank, p), 0, even_batches=False)
        batches = list(prepared)
        assert len(prepared) == len(batches)
        shown.append(_shown(batches))
    assert " / ".join(shown) == UNEVEN[case]


@pytest.mark.parametrize("kind", ["unified", "torch", "batch_sampler"])
def test_even_batches_false_ends_the_epoch_on_every_process_at_the_same_position(kind):
    """13 samples in batches of 2 on 3 processes: process 1 has 2 batches ([2 3] [8 9]), process 0 three.
    Stopped after 2 batches, process 1's next iteration is the rest of this epoch (no batch), as
    Accelerate's skip_first_batches(loader, 2) gives it (measured on 1.15: []), then the next epoch:
    the same after a resume and with skip_first_batches. Before, process 1 went on into the next
    epoch one iteration ahead of process 0 (the epoch's end was its own len())."""
    import numpy as np
    from torch.utils.data import BatchSampler, SequentialSampler

    from unified import DataLoader as UnifiedLoader
    from unified.backend import ForeignLoaders
    from unified.data import prepare_loader, skip_first_batches

    ForeignLoaders.register(_Rank)

    def prepared():
        if kind == "unified":
            loader = UnifiedLoader(np.arange(13), batch_size=2)
        elif kind == "torch":
            loader = DataLoader(TensorDataset(torch.arange(13)), batch_size=2)
        else:
            loader = DataLoader(TensorDataset(torch.arange(13)),
                                batch_sampler=BatchSampler(SequentialSampler(range(13)), 2, False))
        return prepare_loader(loader, _Rank(1, 3), 0, even_batches=False)

    live = prepared()
    assert _shown(live) == "2 3|8 9"
    for i, _ in enumerate(live):
        if i == 1:
            break
    state = live.state_dict()
    assert (_shown(live), _shown(live)) == ("", "2 3|8 9")
    resumed = prepared()
    resumed.load_state_dict(state)
    assert (_shown(resumed), _shown(resumed)) == ("", "2 3|8 9")
    skipping = prepared()
    skipping.load_state_dict(state)
    assert (_shown(skip_first_batches(skipping, 2)), _shown(skipping)) == ("", "2 3|8 9")


def test_even_batches_false_is_accepted_and_join_uneven_inputs_overrides_it(torch_accelerator):
    """Refused before (NotImplementedError); Accelerate 1.15 takes it (and join_uneven_inputs's override)."""
    from unified import Accelerator, DataLoaderConfiguration

    config = DataLoaderConfiguration(even_batches=False)
    config.check()
    acc = Accelerator(backend="torch", dataloader_config=config)
    loader = acc.prepare(_loader(3, 2))
    assert [len(b[0]) for b in loader] == [2, 1]
    assert loader.even_batches is False
    with torch_accelerator.join_uneven_inputs([], even_batches=False):  # one process: nothing to join
        pass
    acc.end_training()


def test_a_batch_sampler_as_sampler_tells_every_process_the_same_rows_of_a_short_last_step():
    """Accelerate's test_distributed_data_loop.py, 'sampler as an instance of BatchSampler': 22 items in
    batches of 4 on 2 processes, the last step holds 4 and 2 rows. Before, each process took its own
    rows for every process's (4, 4) and (2, 2): gather_for_metrics's collectives disagreed (gloo aborted)."""
    from torch.utils.data import BatchSampler, SequentialSampler, default_collate

    from unified.backend import ForeignLoaders
    from unified.data import prepare_loader

    ForeignLoaders.register(_Rank)
    class Rows(torch.utils.data.Dataset):  # dataset[list of indices] is those rows, as Accelerate's DummyDataset
        def __len__(self):
            return 22

        def __getitem__(self, items):
            return [{"index": i} for i in items]

    layouts = []
    for rank in range(2):
        loader = DataLoader(Rows(), sampler=BatchSampler(SequentialSampler(range(22)), 4, False), batch_size=None,
                            collate_fn=default_collate)
        prepared = prepare_loader(loader, _Rank(rank, 2), 0)
        layouts.append([(prepared.batch_layout().rows, prepared.batch_layout().kept) for _ in prepared])
    assert layouts[0] == layouts[1]
    assert layouts[0][-1] == ((4, 2), (4, 2))


def test_prepare_data_loader_takes_slice_fn_for_dispatch():
    """Refused before (NotImplementedError); Accelerate 1.15 uses it with dispatch_batches=True, else ignores it."""
    from unified import Accelerator, DataLoaderConfiguration

    def slice_fn(batch, part, process_index, num_processes):
        return [b[part] * 10 for b in batch]

    acc = Accelerator(backend="torch", dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = acc.prepare_data_loader(_loader(4, 2), slice_fn_for_dispatch=slice_fn)
    assert [b[0].tolist() for b in loader] == [[0, 10], [20, 30]]
    plain = Accelerator(backend="torch").prepare_data_loader(_loader(4, 2), slice_fn_for_dispatch=slice_fn)
    assert [b[0].tolist() for b in plain] == [[0, 1], [2, 3]]
    acc.end_training()


def test_set_epoch_reaches_the_users_batch_sampler_at_once(torch_accelerator):
    """Accelerate's test_data_loader.py test_set_epoch_in_batch_sampler: before, the sampler's own
    set_epoch ran only when the epoch was iterated (batch_sampler.epoch stayed 0 here)."""
    from torch.utils.data import BatchSampler

    class EpochBatchSampler(BatchSampler):
        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

    sampler = EpochBatchSampler(range(16), 4, False)
    loader = torch_accelerator.prepare_data_loader(DataLoader(list(range(16)), batch_sampler=sampler))
    assert sampler.epoch == 0
    loader.set_epoch(1)
    assert sampler.epoch == 1
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_mlflow_nested_run_variable_is_read_as_a_bool(monkeypatch):
    """Accelerate's test_tracking.py test_nested_run_env_var_is_read_as_a_bool (before: not read at all)."""
    from unified.tracking import MLflowTracker

    for value, expected in (("False", False), ("0", False), ("off", False), ("True", True), ("1", True),
                            ("yes", True)):
        monkeypatch.setenv("MLFLOW_NESTED_RUN", value)
        assert MLflowTracker(experiment_name="e", logging_dir=".", nested_run=not expected).nested_run is expected
    monkeypatch.setenv("MLFLOW_NESTED_RUN", "maybe")
    with pytest.raises(ValueError, match="MLFLOW_NESTED_RUN"):
        MLflowTracker()


def test_a_tracker_without_logging_directory_is_refused_in_accelerates_words(monkeypatch):
    """Accelerate's test_tracking.py test_project_dir matches "Logging with `tensorboard` requires a `logging_dir`"."""
    from unified.tracking.registry import resolve_log_with

    monkeypatch.setattr("unified.tracking.registry._installed", lambda module: True)
    with pytest.raises(ValueError, match="Logging with `tensorboard` requires a `logging_dir`"):
        resolve_log_with("tensorboard", None)
