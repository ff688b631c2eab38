"""torch DataLoaders prepared by `unified`: the user's dataset, workers and collate function, with
our sharding, shuffle order and resumable positions. Used by every backend that adapts them
(a JAX run yields ``jax.Array`` batches from the same loader)."""
from __future__ import annotations

import zlib
from typing import Any, Optional

from unified.errors import see

__all__ = ["prepare_torch_loader"]


def prepare_torch_loader(backend: Any, loader: Any, seed: Optional[int]) -> Any:
    """The prepared form of a torch ``DataLoader`` for ``backend``; ``None`` for anything else."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

    from unified.data import PreparedDataLoader

    if not isinstance(loader, DataLoader):
        return None
    if isinstance(loader.dataset, IterableDataset):
        from unified.data import PreparedIterableLoader

        if loader.batch_size is None:
            raise NotImplementedError("prepare() of a torch DataLoader over an IterableDataset needs batch_size=."
                                      + see("torch-iterable-dataset"))
        return PreparedIterableLoader(_LoaderSettings(loader, False), backend, seed)
    if loader.batch_size is None or not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        raise NotImplementedError(
            "prepare() supports torch DataLoaders built with batch_size= and shuffle=True/False; a custom "
            f"sampler ({type(loader.sampler).__qualname__}) or batch_sampler is not supported yet." + see("torch-custom-sampler")
        )
    source = _LoaderSettings(loader, isinstance(loader.sampler, RandomSampler))
    loader_seed = int(seed or 0)

    def batches(index_lists, epoch):  # the user's worker processes, collate_fn and pinning, our indices
        # A DataLoader iterator draws its workers' base seed from the global generator unless it
        # has its own: give it one derived from (seed, epoch), so that iterating (or resuming)
        # never shifts the training's random numbers and worker seeds are reproducible.
        generator = torch.Generator().manual_seed(zlib.crc32(f"{loader_seed}/{epoch}".encode()))
        return iter(DataLoader(
            loader.dataset, batch_sampler=index_lists, num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context, persistent_workers=False,
            prefetch_factor=loader.prefetch_factor if loader.num_workers else None, generator=generator,
        ))

    # A torch DataLoader already yields CPU tensors: on a CPU run there is nothing to place.
    on_cpu = getattr(getattr(backend, "device", None), "type", None) == "cpu"
    return PreparedDataLoader(source, backend, seed, batches=batches, place=(lambda b: b) if on_cpu else None)


class _LoaderSettings:
    """The parts of a torch DataLoader that the shared sharding logic reads."""

    def __init__(self, loader: Any, shuffle: bool) -> None:
        self.dataset, self.batch_size, self.shuffle = loader.dataset, loader.batch_size, shuffle
        self.drop_last, self.seed, self.collate_fn = loader.drop_last, None, loader.collate_fn
