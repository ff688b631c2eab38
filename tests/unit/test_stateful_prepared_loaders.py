"""``DataLoaderConfiguration(use_stateful_dataloader=True)`` (issue 50): as in Accelerate, the
loaders ``prepare`` returns are torchdata ``StatefulDataLoader`` instances, whose ``state_dict()``
taken during an iteration and ``load_state_dict()`` later resume at the next batch; unified's
prepared loaders keep their own exact resume (no sample loaded to skip it)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata.stateful_dataloader")

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, TensorDataset  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from unified import Accelerator, DataLoaderConfiguration  # noqa: E402
from unified.data import PreparedDataLoader, prepare_loader  # noqa: E402


class Stream(IterableDataset):
    def __init__(self, values):
        self.values = values

    def __iter__(self):
        return iter(self.values)


def _loaders():
    values = torch.arange(32)
    return {
        "shuffle": DataLoader(TensorDataset(values), batch_size=4, shuffle=True),
        "batch_sampler": DataLoader(TensorDataset(values), batch_sampler=BatchSampler(RandomSampler(values), 4, False)),
        "items": DataLoader(TensorDataset(values), batch_size=None),
        "iterable": DataLoader(Stream(values), batch_size=4),
    }


@pytest.mark.parametrize("kind", ["shuffle", "batch_sampler", "items", "iterable"])
def test_every_prepared_torch_loader_is_a_stateful_dataloader_that_resumes_as_accelerates_test(
        torch_accelerator, kind):
    """Accelerate's _test_stateful_dataloader_resume: state_dict() at step 2, load_state_dict() after
    the epoch, the next iteration gives exactly the batches after step 2."""
    loader = prepare_loader(_loaders()[kind], torch_accelerator._backend, 0, stateful=True)
    assert isinstance(loader, StatefulDataLoader) and isinstance(loader, DataLoader)
    untrained, state = [], None
    for step, batch in enumerate(loader):
        if step == 2:
            state = loader.state_dict()
        if step > 2:
            untrained.append(batch)
    loader.load_state_dict(state)
    resumed = list(loader)
    assert len(resumed) == len(untrained) > 0
    for b1, b2 in zip(untrained, resumed):
        for v1, v2 in zip(b1, b2):
            assert torch.equal(v1, v2)


def test_it_keeps_unifieds_loader_and_shows_the_users_loader_settings(torch_accelerator):
    user = DataLoader(TensorDataset(torch.arange(10)), batch_size=4, shuffle=True, num_workers=0)
    loader = prepare_loader(user, torch_accelerator._backend, 0, stateful=True)
    assert isinstance(loader, PreparedDataLoader)
    assert len(loader) == 3 and loader.batch_size == 4 and loader.dataset is user.dataset
    assert loader.num_workers == 0 and loader.sampler is user.sampler and loader.collate_fn is user.collate_fn
    assert set(loader.state_dict()) >= {"epoch", "position"}  # unified's position, not torchdata's snapshot


def test_without_the_option_a_prepared_loader_is_not_a_stateful_dataloader(torch_accelerator):
    loader = prepare_loader(_loaders()["shuffle"], torch_accelerator._backend, 0)
    assert not isinstance(loader, StatefulDataLoader)


def test_a_framework_neutral_loader_is_left_as_it_is(torch_accelerator):
    import numpy as np

    from unified import DataLoader as NeutralLoader

    loader = prepare_loader(NeutralLoader(np.arange(8), batch_size=2), torch_accelerator._backend, 0, stateful=True)
    assert not isinstance(loader, StatefulDataLoader)


def test_the_accelerator_option_reaches_prepare_as_in_accelerates_test_prepared_objects():
    acc = Accelerator(backend="torch", dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    try:
        train, valid = acc.prepare(DataLoader(TensorDataset(torch.tensor([1, 2, 3]))),
                                   DataLoader(TensorDataset(torch.tensor([4, 5, 6]))))
        assert isinstance(train, StatefulDataLoader) and isinstance(valid, StatefulDataLoader)
    finally:
        acc.end_training()
