"""Loaders over streams that each process reads on its own: Hugging Face ``datasets``
iterable datasets (split by node), Grain loaders and iterators.

A map-style dataset is sharded by index (`unified.data`); a stream has no index, and reading it
whole on every process to keep a share costs ``P`` times the reading. Here every process reads
only its own share, with the library's own means (`datasets.distributed.split_dataset_by_node`,
Grain's ``ShardOptions``), and its own workers. Global batch ``k`` is every process's ``k``-th
batch. Where the shares end at different steps (a dataset's shards differ in length), the
processes tell each other, at every step, how many rows they have (one small collective), so
that no process waits for a batch that will not come: a process whose share has ended gives a
batch of repeats, a short batch is filled up with its own rows, and `batch_layout` marks the
repeats, so `gather_for_metrics` counts every sample once. Streams known to end together (a
Grain loader this module sharded evenly) skip that exchange.

The checkpoint holds every process's position in the library's own form (Grain's iterator
state, the ``state_dict`` of the dataset or of torchdata's ``StatefulDataLoader``, workers
included), so a resume continues each share without reading it again. Another process count
resumes only at an epoch boundary: a library position belongs to its share.
"""
from __future__ import annotations

import json
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol

import numpy as np

from ..errors import see
from ..runtime.tree import flatten
from .layout import BatchLayout, _in_use

__all__ = ["ProcessStream", "PreparedStreamLoader", "HuggingFaceStream", "ReaderStream", "GrainLoaderStream",
           "GrainDatasetStream", "stream_for", "is_hf_iterable", "own_blocks"]


class ProcessStream(Protocol):
    """This process's share of a library's stream, as `PreparedStreamLoader` sees it.

    ``open(epoch, state)`` returns an iterator of this process's batches for ``epoch``: from the
    epoch's start when ``state`` is ``None``, else continuing from ``state`` (what ``state()``
    returned). ``state()`` is the position after the batches yielded so far, JSON-ready.
    """

    described: str     # what the user handed in, for messages ("a Grain DataLoader")
    batch_size: Optional[int]  # rows of a full batch; None: not known (a batched Grain dataset)
    even: bool         # True when every process's share yields the same batches count and sizes

    def open(self, epoch: int, state: Optional[Any]) -> Iterator[Any]: ...

    def state(self) -> Any: ...


def rows_of(batch: Any) -> int:
    """Rows of a collated batch: the leading dimension of its first array."""
    leaves, _ = flatten(batch, lambda x: not isinstance(x, (dict, list, tuple)))
    for leaf in leaves:
        shape = getattr(leaf, "shape", None)
        if shape:
            return int(shape[0])
    raise ValueError(f"cannot tell the rows of a batch of {type(batch).__qualname__}: expected arrays or tensors "
                     "(or dicts/tuples of them) with a leading batch dimension." + see("stream-batch-rows"))


def fill_up(batch: Any, rows: int, target: int) -> Any:
    """``batch`` (``rows`` rows) with its own rows repeated up to ``target`` rows."""
    if rows == target:
        return batch
    picks = np.arange(target) % rows
    leaves, rebuild = flatten(batch, lambda x: not isinstance(x, (dict, list, tuple)))
    return rebuild([leaf[picks] if getattr(leaf, "shape", None) else leaf for leaf in leaves])


class PreparedStreamLoader:
    """The prepared form of a stream each process reads on its own (see the module's docstring).

    Example:
        >>> loader = accelerator.prepare(torch.utils.data.DataLoader(hf_stream, batch_size=8, num_workers=2))
        >>> for batch in loader:        # this process's 8 rows; it reads 1/P of the stream
        ...     ...
        >>> accelerator.save_state()    # every process's position, workers included
    """

    def __init__(self, stream: ProcessStream, backend: Any, drop_last: bool = False) -> None:
        self.stream = stream
        self.batch_size = stream.batch_size
        self.drop_last = bool(drop_last)
        self._backend = backend
        self.epoch = 0
        self.position = 0  # global batches taken in this epoch
        self.activity: Optional[Any] = None  # see unified.data.PreparedDataLoader
        self.on_batch: Optional[Callable[[bool], None]] = None
        self._layout: Optional[Any] = None
        self._exchange: Optional[Any] = None  # the Accelerator's collectives (`connect`)
        self._open: Optional[Iterator[Any]] = None  # the share being read, continued by the next iteration
        self._pending: Optional[Any] = None  # a loaded mid-epoch state, opened by the next iteration

    @property
    def dataset(self) -> Any:
        return getattr(self.stream, "dataset", None)

    def connect(self, exchange: Any) -> None:
        """Called by `Accelerator.prepare`: the collectives that the steps and checkpoints use."""
        self._exchange = exchange

    def _gather(self, value: Any, operation: str) -> List[Any]:
        if self._exchange is None:  # not prepared by an Accelerator: one process (`unified.DataLoader` alone)
            return [json.loads(json.dumps(value))]
        return self._exchange.all_gather_json(value, operation=operation)

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._run()

    def _share(self) -> Iterator[Any]:
        if self._open is not None and self.position > 0:
            return self._open  # an iteration left before the epoch's end: go on where it stopped
        state, self._pending = (self._pending if self.position > 0 else None), None
        self._open = self.stream.open(self.epoch, state)
        return self._open

    def _run(self, skip_to: int = 0) -> Iterator[Any]:

        share = self._share()
        processes, rank = self._backend.num_processes, self._backend.process_index
        last: Any = None
        with _in_use(self):
            while True:
                batch = next(share, None)
                rows = 0 if batch is None else rows_of(batch)
                counts = ([rows] * processes if self.stream.even
                          else [int(n) for n in self._gather(rows, "stream_step")])
                full = self.batch_size or max(counts)
                if max(counts) == 0 or (self.drop_last and min(counts) < full):
                    break
                if batch is not None:
                    last = batch
                elif last is None:
                    raise ValueError(
                        f"process {rank}'s share of {self.stream.described} is empty while other processes' are not, "
                        "so it has no batch to stand in for: give the stream at least as many shards (files) as "
                        "processes, or fewer processes." + see("stream-share-empty"))
                self.position += 1
                if self.position <= skip_to:  # skip_first_batches before any load_state (unified.data._IterableSkip)
                    continue
                target = max(full, max(counts))
                placed = fill_up(last, rows or rows_of(last), target) if rows < target else batch
                self._layout = BatchLayout((target,) * processes, tuple(counts))
                if self.on_batch is not None:
                    self.on_batch(min(counts) < full)  # a short or missing share: the stream's last step
                yield self._backend.place_batch(placed)
        self._open = None
        self.epoch, self.position = self.epoch + 1, 0

    def batch_layout(self) -> Optional[Any]:
        """See `unified.data.PreparedDataLoader.batch_layout`."""
        return self._layout

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self._open, self._pending = int(epoch), 0, None, None

    def __len__(self) -> int:
        raise TypeError(f"{self.stream.described} is a stream: its length is not known before it is read."
                        + see("stream-length"))

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Every process's position (a collective: `save_state` calls it on every process)."""
        mine = None
        if self.position > 0:
            mine = self.stream.state() if self._open is not None else self._pending
        return {"stream": self.stream.described, "epoch": self.epoch, "position": self.position,
                "num_processes": self._backend.num_processes,
                "processes": [json.dumps(s) for s in self._gather(mine, "stream_state")]}

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        """See `unified.data.PreparedDataLoader.check_state_dict`."""
        if "processes" not in state or "stream" not in state:
            raise ValueError(f"the checkpoint's data loader was not a stream read by every process on its own; "
                             f"this one is {self.stream.described}: prepare the same kind of loader as the run that "
                             "saved it." + see("stream-other-kind"))
        saved, now = int(state["num_processes"]), self._backend.num_processes
        if saved != now and int(state["position"]) > 0:
            raise ValueError(
                f"cannot resume {state['stream']} in the middle of epoch {state['epoch']} with {now} processes: it was "
                f"saved by {saved}, and each process's position belongs to its own share of the stream, which "
                f"another process count splits otherwise. Resume with {saved} processes, or save at an epoch "
                "boundary (a checkpoint taken there resumes on any process count)." + see("stream-resume-count"))

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._open = None
        self._pending = json.loads(state["processes"][self._backend.process_index]) if self.position > 0 else None


# -- Hugging Face datasets ----------------------------------------------------------------------------
def is_hf_iterable(dataset: Any) -> bool:
    """True for a Hugging Face ``datasets.IterableDataset`` (checked without importing ``datasets``)."""
    module = type(dataset).__module__
    if not module.startswith("datasets."):
        return False
    from datasets import IterableDataset

    return isinstance(dataset, IterableDataset)


class HuggingFaceStream:
    """This process's part of a ``datasets.IterableDataset``: `split_dataset_by_node` gives each
    process whole shards (files) when their count divides by the process count (it reads only
    those), else every ``P``-th example. ``make_loader(part)``, when given, is the loader that
    batches the part (torchdata's ``StatefulDataLoader`` with the user's workers), checkpointed
    through its ``state_dict``; without it the part is batched here with ``collate``."""

    even = False

    def __init__(self, dataset: Any, rank: int, world: int, batch_size: int, collate: Callable[[List[Any]], Any],
                 make_loader: Optional[Callable[[Any], Any]] = None) -> None:
        self.dataset, self.rank, self.world = dataset, rank, world
        self.batch_size, self._collate, self._make_loader = int(batch_size), collate, make_loader
        self.described = "a Hugging Face datasets.IterableDataset"
        self._state: Callable[[], Any] = lambda: None
        self.warn_if_inexact()

    def warn_if_inexact(self) -> None:
        """A shuffle buffer is not in the library's state: a resume refills it from the stream, so
        the examples after it differ from the uninterrupted run's; and datasets 5.2 cannot load
        such a state into a StatefulDataLoader's workers (IndexError inside a worker). Said once,
        by the main process, when the loader is prepared."""
        if self.rank == 0 and _has_shuffle_buffer(self.dataset):
            warnings.warn(
                "this datasets.IterableDataset is shuffled through a buffer (.shuffle(buffer_size=...)), which the "
                "library does not save: a resume continues each shard where it stood but refills the buffer, so "
                "the examples after a resume are not exactly the uninterrupted run's, and with DataLoader workers "
                "datasets cannot load its state at all. For exact resumes, shuffle the order of the files "
                "(data_files) yourself and drop the buffer." + see("hf-shuffle-buffer"), UserWarning, stacklevel=4)

    def _part(self, epoch: int) -> Any:
        from datasets.distributed import split_dataset_by_node

        part = (split_dataset_by_node(self.dataset, rank=self.rank, world_size=self.world) if self.world > 1
                else self.dataset)
        part.set_epoch(epoch)  # a new shuffle of shards and buffer each epoch, the same on every process
        return part

    def open(self, epoch: int, state: Optional[Any]) -> Iterator[Any]:
        part = self._part(epoch)
        if self._make_loader is not None:
            loader = self._make_loader(part)
            if state is not None:
                loader.load_state_dict(state)
            self._state = loader.state_dict
            return iter(loader)
        if state is not None:
            part.load_state_dict(state)
        self._state = part.state_dict
        return self._batches(iter(part))

    def _batches(self, items: Iterator[Any]) -> Iterator[Any]:
        while True:
            chunk = [item for _, item in zip(range(self.batch_size), items)]
            if not chunk:
                return
            yield self._collate(chunk)

    def state(self) -> Any:
        return self._state()


def _has_shuffle_buffer(dataset: Any) -> bool:
    """True when a datasets.IterableDataset's chain of example iterables holds a shuffle buffer."""
    node, seen = getattr(dataset, "_ex_iterable", None), 0
    while node is not None and seen < 64:
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        node, seen = getattr(node, "ex_iterable", None), seen + 1
    return False


# -- any iterable dataset read by DataLoader workers ------------------------------------------------
class ReaderStream:
    """This process's share of an iterable dataset read by DataLoader workers: each of the ``W``
    workers of process ``r`` is reader ``r*W + w`` of ``P*W``; a dataset that splits its reading by
    its worker info reads only that reader's part, any other is split by `own_blocks` (the
    process's first worker reads it whole and keeps the process's blocks). ``make_loader(epoch)``
    is the batching loader of this process (torchdata's ``StatefulDataLoader`` when installed:
    its ``state_dict``, workers included, is the position; else a torch ``DataLoader``, whose
    position is the batches taken, read again and dropped on a resume).

    Example:
        >>> stream = ReaderStream(dataset, 8, make_loader, stateful=True)
        >>> batches = stream.open(epoch=0, state=None)
    """

    even = False

    def __init__(self, dataset: Any, batch_size: int, make_loader: Callable[[int], Any], stateful: bool) -> None:
        self.dataset, self.batch_size = dataset, int(batch_size)
        self.described = f"a {type(dataset).__name__} (iterable) in a DataLoader with workers"
        self._make, self._stateful = make_loader, stateful
        self._loader: Any = None
        self._taken = 0  # batches read in this epoch (a plain DataLoader's position), replayed ones included

    def open(self, epoch: int, state: Optional[Any]) -> Iterator[Any]:
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)
        self._loader, self._taken, skip = self._make(epoch), 0, 0
        if state is not None:
            if self._stateful:
                self._loader.load_state_dict(state["loader"])
            else:
                skip = int(state["batches"])
        return self._counted(iter(self._loader), skip)

    def _counted(self, batches: Iterator[Any], skip: int) -> Iterator[Any]:
        for batch in batches:
            self._taken += 1
            if self._taken > skip:  # the first `skip` are read again and dropped, never placed
                yield batch

    def state(self) -> Any:
        if self._stateful:
            return {"loader": self._loader.state_dict()}
        return {"batches": self._taken}


def own_blocks(items: Iterator[Any], reader: int, readers: int, block: int, read: List[int]) -> Iterator[Any]:
    """The items of reader ``reader`` of ``readers`` in a stream that every reader reads whole:
    every ``readers``-th block of ``block`` items, starting with block ``reader``. ``read[0]``
    counts the items read so far (it starts where a resumed reader stood), so that a reader's
    state can say where it is.

    Example:
        >>> list(own_blocks(iter(range(8)), 1, 2, 2, [0]))
        [2, 3, 6, 7]
    """
    for item in items:
        index, read[0] = read[0], read[0] + 1
        if (index // block) % readers == reader:
            yield item


# -- Grain ------------------------------------------------------------------------------------------
def _is_grain(obj: Any, name: str) -> bool:
    if not type(obj).__module__.startswith("grain"):
        return False
    import grain

    return isinstance(obj, getattr(grain, name))


def _grain_part(loader: Any, name: str) -> Any:
    """A part of a Grain ``DataLoader`` that its constructor took but that it does not show."""
    try:
        return getattr(loader, name)
    except AttributeError as err:
        raise RuntimeError(
            f"grain.DataLoader no longer has {name}, which unified reads to give each process its shard; install a "
            "Grain version unified was tested with or report it." + see("private-api-changed")) from err


class GrainLoaderStream:
    """A Grain ``DataLoader``. Handed whole (its sampler's ``shard_count`` is 1 and the group has
    several processes), it is rebuilt with ``ShardOptions(rank, P, drop_remainder=True)``: every
    process reads its own records (Grain shards by contiguous ranges, shuffled within), the
    same number of them, so the shares end together. A loader sharded already is taken as it is.
    Its iterator's ``get_state()`` is the position, workers included."""

    def __init__(self, loader: Any, rank: int, world: int) -> None:
        import grain

        options = getattr(_grain_part(loader, "_sampler"), "_shard_options", None)
        given = _grain_part(loader, "_shard_options") or options
        count = int(getattr(given, "shard_count", 1) or 1)
        self.even = False
        if count == 1 and world > 1:
            loader = grain.DataLoader(
                data_source=_grain_part(loader, "_data_source"), sampler=_grain_part(loader, "_sampler"),
                operations=_grain_part(loader, "_operations"),
                worker_count=_grain_part(loader, "_multiprocessing_options").num_workers,
                worker_buffer_size=_grain_part(loader, "_multiprocessing_options").per_worker_buffer_size,
                read_options=_grain_part(loader, "_read_options"),
                shard_options=grain.sharding.ShardOptions(shard_index=rank, shard_count=world, drop_remainder=True))
            self.even = True
        elif count != world:
            raise ValueError(
                f"the Grain DataLoader is sharded {count} ways, but the group has {world} processes: build it without "
                "shard options (prepare() shards it) or with grain.sharding.ShardByJaxProcess() on the JAX backend."
                + see("grain-shards"))
        _check_grain_workers_can_start(loader)
        self.loader, self.batch_size, self.described = loader, _grain_batch_size(loader), "a Grain DataLoader"
        self._iterator: Any = None

    def open(self, epoch: int, state: Optional[Any]) -> Iterator[Any]:
        self._iterator = iter(self.loader)
        if state is not None:
            self._iterator.set_state(state.encode())
        return self._iterator

    def state(self) -> Any:
        return self._iterator.get_state().decode()


def _check_grain_workers_can_start(loader: Any) -> None:
    """Grain's workers read absl flags, which a script outside ``absl.app.run`` never parsed:
    Grain stops at the first batch; say it at ``prepare``, with the one-line fix."""
    if not _grain_part(loader, "_multiprocessing_options").num_workers:
        return
    from absl import flags

    if not flags.FLAGS.is_parsed():
        raise RuntimeError(
            "this Grain DataLoader has worker_count > 0, and Grain's workers read absl flags, which were never parsed: "
            "run the script under absl.app.run(main), or call absl.flags.FLAGS.mark_as_parsed() before prepare(); "
            "workers also need the script's code under `if __name__ == \"__main__\":`." + see("grain-flags"))


def _grain_batch_size(loader: Any) -> Optional[int]:
    for operation in _grain_part(loader, "_operations") or ():
        size = getattr(operation, "batch_size", None)
        if isinstance(size, int):
            return size
    return None


class GrainDatasetStream:
    """A Grain ``IterDataset`` (or ``MapDataset``, read in order, or a ``DatasetIterator``) that the script has sharded
    already (e.g. ``dataset[jax.process_index()::jax.process_count()]``): taken as it is, its
    iterator's ``get_state()`` the position. A new iteration each epoch."""

    even = False
    batch_size: Optional[int] = None

    def __init__(self, dataset: Any) -> None:
        self.dataset, self.described = dataset, f"a Grain {type(dataset).__name__}"
        self._iterator: Any = None

    def open(self, epoch: int, state: Optional[Any]) -> Iterator[Any]:
        dataset = self.dataset.to_iter_dataset() if hasattr(self.dataset, "to_iter_dataset") else self.dataset
        # an iterator handed in is read once (its own epochs, if any, are its own)
        self._iterator = dataset if _is_grain(dataset, "DatasetIterator") else iter(dataset)
        if state is not None:
            self._iterator.set_state(state)
        return self._iterator

    def state(self) -> Any:
        return self._iterator.get_state()


def stream_for(obj: Any, rank: int, world: int) -> Optional[ProcessStream]:
    """The `ProcessStream` of a Grain loader or dataset; ``None`` for anything else."""
    if _is_grain(obj, "DataLoader"):
        return GrainLoaderStream(obj, rank, world)
    if _is_grain(obj, "IterDataset") or _is_grain(obj, "MapDataset") or _is_grain(obj, "DatasetIterator"):
        return GrainDatasetStream(obj)
    return None
