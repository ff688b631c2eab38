"""Sharded, resumable data loading written once for every backend.

The global sample order of an epoch depends only on ``(seed, epoch)``. Global batch ``k``
holds samples ``order[k*B*P:(k+1)*B*P]`` (``B`` the per-process batch size, ``P`` the number of
processes) and process ``r`` gets the ``r``-th slice of ``B`` of them. Because the order does
not depend on ``P``, a position (samples consumed) carries over to another process count.

Uneven end (the same on both backends): with ``drop_last=True`` the incomplete global batch is
dropped; otherwise it is filled up by wrapping around to the start of the epoch's order, and
``loader.padding_in_batch(k)`` says how many trailing samples of global batch ``k`` are repeats.
While a prepared loader is iterated, ``loader.batch_layout()`` says where the repeats of the batch
in use are (`BatchLayout`); `unified.training.metrics` reads it to gather each sample exactly once.

A torch ``DataLoader`` with its own sampler or batch sampler keeps it: each epoch's indices (or
batches of indices) are drawn from it once (`SampledLoader`, `BatchSampledLoader`) and sharded
the same way, so positions, resume and `skip_first_batches` work as for the built-in orders. One
without automatic batching (``batch_size=None``) has items that are batches already, dealt one
per process and step (`ItemSampledLoader`).

The package, by concern (each module imports only those above it):

* `layout`: which rows of a global batch are repeats (`BatchLayout`), resume positions.
* `prefetch`: batches made ahead in a background thread.
* `orders`: the global order of an epoch (`ShuffledOrder`) and a sampler's (`OrderSource`).
* `streams`: iterable sources every process reads its own part of (Hugging Face, Grain, readers).
* `stateful`: a prepared loader made a torchdata ``StatefulDataLoader`` (``use_stateful_dataloader``).
* `dispatch`: Accelerate's ``dispatch_batches=True``: process 0 reads, every process gets its rows.
* `loaders`: `DataLoader`, its prepared forms, `prepare_loader`, `skip_first_batches`.
* `samplers`: prepared loaders that keep a torch loader's own sampler or batch sampler, or its items.

It runs in every worker.
"""
from .layout import BatchLayout, resume_position
from .loaders import (
                      DataLoader,
                      PreparedDataLoader,
                      PreparedIterableLoader,
                      default_collate,
                      prepare_loader,
                      skip_first_batches,
)
from .orders import OrderSource, ShuffledOrder
from .samplers import BatchSampledLoader, ItemSampledLoader, SampledLoader

__all__ = ["DataLoader", "PreparedDataLoader", "PreparedIterableLoader", "SampledLoader", "BatchSampledLoader",
           "ItemSampledLoader", "BatchLayout", "OrderSource", "ShuffledOrder", "skip_first_batches", "prepare_loader",
           "default_collate", "resume_position"]
