"""Helpers that every backend package uses, written once (framework-free), and the code two
backends share, so that no backend imports another (tests/unit/test_backend_shape.py):

- numbering, handle leaks and timeout errors, for every backend;
- `prepare_torch_loader`: torch DataLoaders prepared by `unified` (the user's dataset, workers,
  collate function and sampler, with our sharding, positions and resume), used by every backend
  that adapts them (the torch backend, and a JAX run that yields ``jax.Array`` batches from the
  same loader). It imports torch only when called. The one private torch attribute it reads is
  behind `draws_one_permutation`, which `backends.torch.private.check()` probes with the others.
"""
from __future__ import annotations

import zlib
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np

from unified.errors import BackendUnavailable, see


# -- torch DataLoaders, for every backend that adapts them ------------------------------------------
def draws_one_permutation(sampler: Any) -> bool:
    """True when a torch `RandomSampler` yields one permutation of the whole dataset per epoch.

    Reads the private ``RandomSampler._num_samples`` (``None`` unless the user set a count): when
    a torch release moves it, this raises `BackendUnavailable` naming the change instead of an
    ``AttributeError`` far from the cause.
    """
    try:
        num_samples = sampler._num_samples
    except AttributeError as err:
        import torch

        raise BackendUnavailable(
            f"torch {torch.__version__} changed RandomSampler: RandomSampler._num_samples is gone. unified relies on "
            "this private torch attribute; install a tested torch version (`unified env` shows the tested range) "
            "or report it." + see("private-api-changed")) from err
    return not sampler.replacement and num_samples is None


def prepare_torch_loader(backend: Any, loader: Any, seed: Optional[int]) -> Any:
    """The prepared form of a torch ``DataLoader`` for ``backend``; ``None`` for anything else.

    ``shuffle=True/False`` use our own order of ``(seed, epoch)``; another ``sampler`` gives the
    order of each epoch (`unified.data.SampledLoader`) and a ``batch_sampler`` the batches
    (`unified.data.BatchSampledLoader`), both drawn as `_SamplerSource` says. ``batch_size=None``
    (no automatic batching) makes every item of the sampler a batch (`unified.data.ItemSampledLoader`).
    """
    import torch
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

    from unified.data import (
        BatchSampledLoader,
        ItemSampledLoader,
        PreparedDataLoader,
        PreparedIterableLoader,
        SampledLoader,
    )

    if not isinstance(loader, DataLoader):
        return None
    from unified.data.streams import HuggingFaceStream, PreparedStreamLoader, is_hf_iterable

    if is_hf_iterable(loader.dataset):  # each process reads its own shards, with the loader's workers
        if loader.batch_size is None:
            raise NotImplementedError("prepare() of a torch DataLoader over a datasets.IterableDataset needs "
                                      "batch_size=." + see("torch-iterable-dataset"))
        stream = HuggingFaceStream(loader.dataset, backend.process_index, backend.num_processes, loader.batch_size,
                                   loader.collate_fn, _stateful_loader_maker(loader))
        return PreparedStreamLoader(stream, backend, loader.drop_last)
    if isinstance(loader.dataset, IterableDataset):
        if loader.batch_size is None:
            raise NotImplementedError("prepare() of a torch DataLoader over an IterableDataset needs batch_size=."
                                      + see("torch-iterable-dataset"))
        if loader.num_workers:  # each worker of each process reads its own part (`unified.data.streams.ReaderStream`)
            return PreparedStreamLoader(_reader_stream(loader, backend, seed), backend, loader.drop_last)
        return PreparedIterableLoader(_LoaderSettings(loader, False), backend, seed)
    loader_seed = int(seed or 0)

    def batches(index_lists, epoch, items=False):  # the user's worker processes, collate_fn and pinning, our indices
        # A DataLoader iterator draws its workers' base seed from the global generator unless it
        # has its own: give it one derived from (seed, epoch), so that iterating (or resuming)
        # never shifts the training's random numbers and worker seeds are reproducible.
        generator = torch.Generator().manual_seed(zlib.crc32(f"{loader_seed}/{epoch}".encode()))
        # items: no automatic batching, each of our items (an index or a list) is one dataset[item]
        order = dict(sampler=index_lists, batch_size=None) if items else dict(batch_sampler=index_lists)
        return iter(DataLoader(
            loader.dataset, **order, num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context, persistent_workers=False,
            prefetch_factor=loader.prefetch_factor if loader.num_workers else None, generator=generator,
        ))

    from torch.utils.data.distributed import DistributedSampler

    inner = getattr(loader.batch_sampler, "sampler", None)
    if any(isinstance(s, DistributedSampler) and s.num_replicas > 1 for s in (loader.sampler, inner)):
        raise ValueError(
            "prepare() got a torch DataLoader with a DistributedSampler, which already gives each process its own "
            "part; unified shards the loader itself, so each process would see a part of a part. Build the loader "
            "with shuffle=True/False (or a sampler that yields the whole epoch) instead."
            + see("torch-distributed-sampler")
        )
    # A torch DataLoader already yields CPU tensors: on a CPU run there is nothing to place.
    on_cpu = getattr(getattr(backend, "device", None), "type", None) == "cpu"
    options = dict(batches=batches, place=(lambda b: b) if on_cpu else None)
    shuffles, batchers = _plain_samplers(RandomSampler, BatchSampler)
    if loader.batch_size is not None and type(loader.batch_sampler) in batchers:
        sampler = loader.sampler
        plain_shuffle = type(sampler) in shuffles and draws_one_permutation(sampler)
        if plain_shuffle or type(sampler) is SequentialSampler:
            return PreparedDataLoader(_LoaderSettings(loader, plain_shuffle), backend, seed, **options)
        return SampledLoader(_LoaderSettings(loader, False), backend, seed, _SamplerSource(sampler, loader_seed, False),
                             **options)
    if loader.batch_sampler is not None:
        settings = _LoaderSettings(loader, False)
        settings.drop_last = bool(getattr(loader.batch_sampler, "drop_last", False))
        return BatchSampledLoader(settings, backend, seed, _SamplerSource(loader.batch_sampler, loader_seed, True),
                                  **options)
    # batch_size=None: no automatic batching, each item of the sampler is a batch (as Accelerate's
    # BatchSamplerShard deals them); a BatchSampler given as the sampler yields lists of indices
    settings = _LoaderSettings(loader, False)
    settings.drop_last = bool(getattr(loader.sampler, "drop_last", False))
    options["batches"] = lambda index_items, epoch: batches(index_items, epoch, items=True)
    return ItemSampledLoader(settings, backend, seed, _SamplerSource(loader.sampler, loader_seed, "items"), **options)


def _plain_samplers(random_sampler: type, batch_sampler: type) -> Tuple[Tuple[type, ...], Tuple[type, ...]]:
    """The sampler types of ``shuffle=True`` and the batch sampler types of ``batch_size=``, torch's
    and torchdata's (``StatefulDataLoader`` makes its own): a loader built from them gets
    unified's order of ``(seed, epoch)``, so a resume is index arithmetic, never a replay of the
    sampler. Exact types: a subclass may draw another order."""
    try:
        from torchdata.stateful_dataloader import sampler as stateful
    except ImportError:
        return (random_sampler,), (batch_sampler,)
    return (random_sampler, stateful.RandomSampler), (batch_sampler, stateful.BatchSampler)


def _stateful_loader_class() -> Optional[Any]:
    """torchdata's ``StatefulDataLoader``, whose ``state_dict`` holds every worker's position;
    ``None`` when torchdata is not installed."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


def _loader_like(loader_class: Any, loader: Any, dataset: Any, **overrides: Any) -> Any:
    """A ``loader_class`` over ``dataset`` with ``loader``'s batching, workers and collation."""
    settings = dict(batch_size=loader.batch_size, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                    pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn,
                    multiprocessing_context=loader.multiprocessing_context,
                    prefetch_factor=loader.prefetch_factor if loader.num_workers else None)
    return loader_class(dataset, **{**settings, **overrides})


def _stateful_loader_maker(loader: Any) -> Optional[Any]:
    """``part -> StatefulDataLoader`` like ``loader``; ``None`` (batch in the process) when the
    loader has no workers and torchdata is not installed."""
    loader_class = _stateful_loader_class()
    if loader_class is None:
        if loader.num_workers:
            raise ImportError(
                "prepare() of a DataLoader with workers over a datasets.IterableDataset checkpoints the workers' "
                "positions through torchdata's StatefulDataLoader: pip install 'unified[torchdata]', or "
                "use num_workers=0." + see("stream-needs-torchdata"))
        return None
    return lambda part: _loader_like(loader_class, loader, part)


# -- iterable datasets read by DataLoader workers: every worker of every process one reader ---------
def _reader_stream(loader: Any, backend: Any, seed: Optional[int]) -> Any:
    """The `unified.data.streams.ReaderStream` of a torch DataLoader with workers over an IterableDataset.
    Without torchdata the loader is torch's own, and a resume reads the taken batches again."""
    import torch

    from unified.data.streams import ReaderStream

    from .torch_readers import AsGlobalReader, Readers, StatefulReaders

    loader_class = _stateful_loader_class()
    stateful = loader_class is not None
    dataset = loader.dataset
    has_state = callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))
    readers = (StatefulReaders if has_state else Readers)(dataset, loader.batch_size)
    rank, world, base = backend.process_index, backend.num_processes, int(seed or 0)
    as_reader = AsGlobalReader(rank, world, loader.worker_init_fn)

    def make(epoch: int) -> Any:
        # the workers' seeds from (seed, epoch, process), not from the training's global generator
        generator = torch.Generator().manual_seed(zlib.crc32(f"{base}/{epoch}/{rank}".encode()))
        return _loader_like(loader_class or torch.utils.data.DataLoader, loader, readers, worker_init_fn=as_reader,
                            generator=generator)

    return ReaderStream(dataset, loader.batch_size, make, stateful)


class _LoaderSettings:
    """The parts of a torch DataLoader that the shared sharding logic reads."""

    def __init__(self, loader: Any, shuffle: bool) -> None:
        self.dataset, self.batch_size, self.shuffle = loader.dataset, loader.batch_size, shuffle
        self.drop_last, self.seed, self.collate_fn = loader.drop_last, None, loader.collate_fn


class _SamplerSource:
    """A torch sampler (or batch sampler) as an `unified.data.OrderSource`.

    Each epoch is drawn reproducibly, the same on every process and again after a resume:
    ``set_epoch(epoch)`` is called where the sampler (or the sampler inside a batch sampler)
    has it; then it is iterated while torch's CPU generator, Python's ``random`` and NumPy's
    global generator are seeded from ``(seed, epoch)`` and afterwards put back, so the training's
    own random numbers do not move. A sampler with ``state_dict``/``load_state_dict`` is
    checkpointed through them (its state before the epoch is drawn); a sampler without them that
    owns a ``torch.Generator`` has it re-seeded from that generator's initial seed and the epoch;
    that seed is process 0's (`agree`) and part of the checkpoint. ``batches``: ``False`` for a
    sampler of indices, ``True`` for a batch sampler, ``"items"`` for the sampler of a loader
    without automatic batching (`_drawn_items`).
    """

    def __init__(self, sampler: Any, seed: int, batches: Union[bool, str]) -> None:
        import torch

        self.sampler, self.seed, self.batches = sampler, int(seed), batches
        self.stateful = (callable(getattr(sampler, "state_dict", None))
                         and callable(getattr(sampler, "load_state_dict", None)))
        owners = [sampler, getattr(sampler, "sampler", None)]
        self._generators = [] if self.stateful else [
            (g, g.initial_seed()) for g in (getattr(o, "generator", None) for o in owners)
            if isinstance(g, torch.Generator)
        ]

    def length(self) -> Optional[int]:
        try:
            return len(self.sampler)
        except TypeError:  # no __len__: the loader counts the drawn epoch
            return None

    def draw(self, epoch: int) -> Any:
        import torch

        from unified.data.orders import derived_seed, seeded_host_rngs

        for owner in (self.sampler, getattr(self.sampler, "sampler", None)):
            if callable(getattr(owner, "set_epoch", None)):
                owner.set_epoch(epoch)
        for generator, initial in self._generators:
            generator.manual_seed(derived_seed(initial, epoch))
        with torch.random.fork_rng(devices=[]), seeded_host_rngs(self.seed, epoch):
            torch.default_generator.manual_seed(derived_seed(self.seed, epoch))  # CPU only: CUDA's untouched
            if self.batches == "items":
                return _drawn_items(self.sampler)
            if self.batches:
                return [[int(i) for i in batch] for batch in self.sampler]
            return np.fromiter((int(i) for i in self.sampler), dtype=np.int64)

    def agree(self, broadcast: Any) -> None:
        """Process 0's initial seeds for the generators re-seeded each epoch: a sampler that seeded
        its own generator from torch's global one (torchdata's ``RandomSampler``) got another seed
        on each process unless the script seeded torch first."""
        self._use_seeds(broadcast([initial for _, initial in self._generators]))

    def _use_seeds(self, seeds: Sequence[Any]) -> None:
        """Draw the epochs from ``seeds`` (one per generator, in order) instead of the generators' own."""
        self._generators = [(generator, int(seed)) for (generator, _), seed in zip(self._generators, seeds)]

    def state(self) -> Optional[Any]:
        if self.stateful:
            return _to_host(self.sampler.state_dict())
        # the seeds the epochs are drawn from: a restarted run whose sampler seeded itself anew resumes the same order
        return {"generator_seeds": [initial for _, initial in self._generators]} if self._generators else None

    def load(self, state: Any) -> None:
        if not self.stateful:
            seeds = state.get("generator_seeds") if isinstance(state, dict) else None
            if seeds is not None and len(seeds) == len(self._generators):
                self._use_seeds(seeds)
            return
        self.sampler.load_state_dict(_like(self.sampler.state_dict(), state))


def _drawn_items(sampler: Any) -> Any:
    """The items a sampler yields to a loader without automatic batching: NumPy indices, or lists
    of indices (a ``BatchSampler`` given as the sampler), never both."""
    drawn = [i.tolist() if hasattr(i, "tolist") else i for i in sampler]  # tensors and NumPy values
    if all(not isinstance(i, (list, tuple)) for i in drawn):
        return np.array([int(i) for i in drawn], dtype=np.int64)
    if all(isinstance(i, (list, tuple)) for i in drawn):
        return [[int(j) for j in i] for i in drawn]
    raise TypeError(
        "prepare() of a torch DataLoader with batch_size=None: its sampler yields both single indices and lists of "
        "indices. Each item is one batch, dataset[item]: make the sampler yield one kind, an index or a list of "
        "indices, for every item." + see("torch-custom-sampler"))


def _to_host(state: Any) -> Any:
    """A copy of a sampler's state with tensors as NumPy arrays (storable on any backend)."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().cpu().numpy().copy()
    if isinstance(state, dict):
        return {k: _to_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_host(v) for v in state)
    return state


def _like(template: Any, state: Any) -> Any:
    """``state`` with NumPy arrays turned back into tensors where the live state has tensors."""
    import torch

    if isinstance(template, torch.Tensor):
        return torch.from_numpy(np.array(state)).to(dtype=template.dtype)
    if isinstance(template, dict) and isinstance(state, dict):
        return {k: _like(template.get(k), v) for k, v in state.items()}
    if isinstance(template, (list, tuple)) and isinstance(state, (list, tuple)) and len(template) == len(state):
        return type(state)(_like(t, v) for t, v in zip(template, state))
    if isinstance(state, np.ndarray):
        return np.array(state)  # writable, not a view of the checkpoint's file
    return state
