"""The loaders: `DataLoader` (framework-neutral), its prepared forms over map-style data
(`PreparedDataLoader`) and iterable data (`PreparedIterableLoader`), `prepare_loader` that
picks one (or a stream, `unified.data.streams`), and `skip_first_batches`."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..backend import Backend, ForeignLoaders
from ..errors import see
from .dispatch import dispatched
from .layout import BatchLayout, Placement, _HostOnly, _in_use, _tail_layout, resume_position
from .orders import ShuffledOrder
from .prefetch import prefetched
from .stateful import as_stateful
from .streams import HuggingFaceStream, PreparedStreamLoader, is_hf_iterable, stream_for


def default_collate(samples: Sequence[Any]) -> Any:
    """Stack NumPy samples (arrays, numbers, or dicts/tuples/lists of them) into a batch."""
    first = samples[0]
    if isinstance(first, dict):
        return {k: default_collate([s[k] for s in samples]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(default_collate(list(parts)) for parts in zip(*samples))
    return np.stack([np.asarray(s) for s in samples])


class DataLoader:
    """A framework-neutral loader over any dataset with ``__len__`` and ``__getitem__`` that
    returns NumPy arrays (or dicts/tuples of them). ``batch_size`` is per process.

    Unprepared it yields every batch on one process; `Accelerator.prepare` shards it.
    ``prefetch=N`` (map-style datasets) collates and places the next ``N`` batches on the devices
    in a background thread while the current step runs; a checkpoint still resumes at the first
    batch the loop has not received. The dataset's ``__getitem__`` and ``collate_fn`` then run in
    that thread: draw random augmentations from a generator seeded per sample, not from the
    global ``random``/``np.random`` streams, or resumes are no longer exact (docs/data.md).

    Example:
        >>> loader = unified.DataLoader(dataset, batch_size=32, shuffle=True, seed=0)
        >>> loader = accelerator.prepare(loader)
        >>> for batch in loader:
        ...     ...
    """

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = False, seed: Optional[int] = None,
                 drop_last: bool = False, collate_fn: Optional[Callable[[List[Any]], Any]] = None,
                 prefetch: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"Invalid batch_size: expected an integer >= 1; received {batch_size!r}."
                             + see("invalid-batch-size"))
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"Invalid prefetch: expected an integer >= 0 (batches placed ahead); received "
                             f"{prefetch!r}." + see("invalid-prefetch"))
        if prefetch and _is_iterable_dataset(dataset):
            raise ValueError("prefetch works with map-style datasets (__len__ and __getitem__) only; an iterable "
                             "stream's position would move ahead of the training loop. Use prefetch=0."
                             + see("invalid-prefetch"))
        self.prefetch = prefetch
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn or default_collate
        self._single = _prepare(self, _HostOnly(), seed)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._single)

    def __len__(self) -> int:
        return len(self._single)


class PreparedDataLoader:
    """The prepared form of a loader: this process's share of every global batch, on device,
    with its position (epoch, next batch, seed) saved and restored by checkpoints.

    Iterating continues from the current position; at the end of an epoch the next iteration
    starts the next epoch (a new order when shuffling).
    """

    def __init__(self, source: Any, backend: Placement, seed: Optional[int], *,
                 batches: Optional[Callable[[Iterator[List[int]], int], Iterator[Any]]] = None,
                 place: Optional[Callable[[Any], Any]] = None) -> None:
        self.source = source
        self.dataset = source.dataset
        self.batch_size = source.batch_size
        self.shuffle = source.shuffle
        self.drop_last = source.drop_last
        self.seed = int(seed if seed is not None else (getattr(source, "seed", None) or 0))
        self._backend = backend
        self._place = place or backend.place_batch
        # index lists -> batches; a torch DataLoader plugs in its own (worker processes)
        self._batches = batches or (lambda lists, epoch: (source.collate_fn([self.dataset[i] for i in ix])
                                                          for ix in lists))
        self.epoch = 0
        self.position = 0  # index of the next global batch in this epoch
        # told before each batch is yielded whether it is the epoch's last (closes an accumulation window)
        self.on_batch: Optional[Callable[[bool], None]] = None
        # Told when an iteration starts and ends (set by the Accelerator that prepared this loader).
        self.activity: Optional[Any] = None
        self._layout: Optional[BatchLayout] = None
        # global batches collated and placed ahead in a background thread (unified.DataLoader(prefetch=...))
        self.prefetch = int(getattr(source, "prefetch", 0) or 0)
        # Accelerate's even_batches: False leaves the epoch's last global batch as it is (no repeats),
        # so a process may get a shorter last batch, or one batch fewer (`uneven`)
        self.even_batches = True

    # -- the order --------------------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self._backend.num_processes

    def num_samples(self) -> int:
        """Samples in one epoch's order (the dataset's length; a sampler's own length)."""
        return len(self.dataset)

    def __len__(self) -> int:
        return self._length(self.even_batches)

    def _length(self, even: bool) -> int:
        """This process's batches in an epoch, with even batches or not (``even=True``: the epoch's
        global batches, the same on every process: where the epoch ends for all of them)."""
        n, g = self.num_samples(), self.global_batch_size
        if self.drop_last:
            return n // g
        if not even:  # global batches holding at least one of this process's samples
            return max(0, math.ceil((n - self._backend.process_index * self.batch_size) / g))
        return math.ceil(n / g)

    def _epoch_over(self) -> bool:
        """Whether the current epoch is over, on every process alike. With ``even_batches=False``
        a process may have fewer batches than others (``len()``): its position then stands at its
        own end while the epoch goes on for the others, and the next iteration is the rest of this
        epoch (none of its batches), not the next epoch, so that every process starts the next
        epoch in the same iteration."""
        return self.position >= self._length(True)

    def epoch_order(self, epoch: int) -> Any:
        """The epoch's global sample order: ``order[i]`` is the ``i``-th sample of the epoch."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return ShuffledOrder(n, self.seed, epoch)

    def batch_indices(self, order: Any, batch: int) -> List[int]:
        """This process's sample indices of global batch ``batch`` (wrapping around at the end)."""
        g = self.global_batch_size
        start = batch * g + self._backend.process_index * self.batch_size
        return [int(order[i % len(order)]) for i in range(start, start + self.batch_size)]

    def _index_lists(self, order: Any, first: int) -> Iterator[List[int]]:
        """This process's index lists from global batch ``first`` to the epoch's end, lazily."""
        b, g, n = self.batch_size, self.global_batch_size, len(order)
        offset = self._backend.process_index * b
        for k in range(first, len(self)):
            start = k * g + offset
            if start + b <= n:
                yield order[start:start + b].tolist()
            else:  # the epoch's end: filled up with its first samples, or left short (even_batches=False)
                yield self.batch_indices(order, k) if self.even_batches else order[start:n].tolist()

    def padding_in_batch(self, batch: int) -> int:
        """How many trailing samples of global batch ``batch`` repeat the epoch's first samples."""
        if not self.even_batches:
            return 0
        return max(0, (batch + 1) * self.global_batch_size - self.num_samples())

    def _layout_of(self, order: Any, batch: int) -> BatchLayout:
        layout = _tail_layout(batch * self.global_batch_size, len(order), self.batch_size, self._backend.num_processes)
        return layout if self.even_batches else BatchLayout(layout.kept, layout.kept)

    def _layout_in_use(self, order: Any, batch: int, placed: Any) -> BatchLayout:
        """The `BatchLayout` of global batch ``batch`` once this process's part, ``placed``, is loaded
        (a loader whose rows are known only then reads them from it)."""
        return self._layout_of(order, batch)

    def batch_layout(self) -> Optional[BatchLayout]:
        """The `BatchLayout` of the batch this loader yielded last, while an iteration is running
        (``None`` before its first batch and after it ended): which rows are repeats."""
        return self._layout

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._run()

    def _run(self, roll_over: bool = True) -> Iterator[Any]:
        if roll_over and self._epoch_over():  # restored at the very end of an epoch
            self.epoch, self.position = self.epoch + 1, 0
        order = self.epoch_order(self.epoch)
        first = self.position
        placed = (self._place(batch) for batch in self._batches(self._index_lists(order, first), self.epoch))
        with _in_use(self):  # skipped batches are never loaded; prefetched ones are not consumed yet
            for batch in prefetched(placed, self.prefetch):
                self._layout = self._layout_in_use(order, self.position, batch)
                self.position += 1  # a checkpoint taken while this batch is in use resumes after it
                if self.on_batch is not None:
                    self.on_batch(self.position >= len(self))
                yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch at the next iteration."""
        self.epoch, self.position = int(epoch), 0

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "samples_seen": self.position * self.global_batch_size, "global_batch_size": self.global_batch_size,
                "dataset_length": self.num_samples()}

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        """Raise `ValueError` when ``state`` cannot be resumed here; change nothing (`load_state`
        calls it for every object before any is restored)."""
        self._resumed_position(state)

    def _resumed_position(self, state: Dict[str, Any]) -> Tuple[int, int]:
        """``(epoch, position)`` of ``state`` in this loader's global batches (see `resume_position`)."""
        if state["dataset_length"] != self.num_samples():
            raise ValueError(f"the data loader's epoch has {self.num_samples()} samples; the checkpoint's had "
                             f"{state['dataset_length']}")
        g = self.global_batch_size
        return resume_position(int(state["epoch"]), int(state["samples_seen"]),
                               int(state.get("global_batch_size") or g), g, self._epoch_batches,
                               f"a global batch of {g} samples ({self.batch_size} per process x "
                               f"{self._backend.num_processes} processes)")

    def _epoch_batches(self, global_batch: int) -> int:
        """Global batches in one epoch with a global batch of ``global_batch`` samples."""
        n = self.num_samples()
        return n // global_batch if self.drop_last else math.ceil(n / global_batch)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch, self.position = self._resumed_position(state)
        self.seed = int(state["seed"])


class _IterableSkip:
    """`skip_first_batches` over a stream (`PreparedIterableLoader`, `unified.data.streams.PreparedStreamLoader`):
    its ``_run(skip_to)`` takes the batches up to ``skip_to`` on the host, neither placed nor yielded."""

    def __init__(self, loader: Any, num_batches: int) -> None:
        self.loader, self.num_batches = loader, num_batches

    def __iter__(self) -> Iterator[Any]:
        return self.loader._run(skip_to=max(self.num_batches, self.loader.position))


class _SkippedView:
    """What `skip_first_batches` returns: the rest of the current epoch from an absolute position."""

    def __init__(self, loader: PreparedDataLoader, num_batches: int) -> None:
        self.loader, self.num_batches = loader, num_batches

    def __iter__(self) -> Iterator[Any]:
        loader = self.loader
        if loader._epoch_over():
            loader.epoch, loader.position = loader.epoch + 1, 0
        loader.position = max(loader.position, self.num_batches)  # absolute: never skips twice
        return loader._run(roll_over=False)

    def __len__(self) -> int:
        return max(0, len(self.loader) - max(self.loader.position, self.num_batches))


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A view of ``dataloader`` that yields, for one epoch, exactly the batches it would yield
    from position ``num_batches`` of the current epoch. Skipped map-style batches are never
    loaded. After `load_state` the position is already restored, so passing the same step
    again lands on the same batch.

    Example:
        >>> accelerator.load_state()
        >>> for batch in accelerator.skip_first_batches(loader, resume_step):
        ...     ...
        >>> for batch in loader:   # the next epoch, as usual
        ...     ...
    """
    if num_batches < 0:
        raise ValueError(f"Invalid num_batches: expected >= 0; received {num_batches}." + see("invalid-num-batches"))
    if isinstance(dataloader, DataLoader):
        dataloader = dataloader._single
    if isinstance(dataloader, (PreparedIterableLoader, PreparedStreamLoader)):
        if dataloader.position >= num_batches:
            return dataloader  # already there (restored by load_state): never skip twice
        return _IterableSkip(dataloader, int(num_batches))
    if isinstance(dataloader, PreparedDataLoader):
        return _SkippedView(dataloader, int(num_batches))
    if callable(getattr(dataloader, "skipped_view", None)):  # unified.data.dispatch.DispatchedLoader
        return dataloader.skipped_view(int(num_batches))
    raise TypeError(
        f"skip_first_batches expects a loader returned by accelerator.prepare() or a unified.DataLoader; "
        f"received {type(dataloader).__qualname__}." + see("skip-wrong-loader")
    )


def _is_iterable_dataset(dataset: Any) -> bool:
    return not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


def _prepare(source: Any, backend: Placement, seed: Optional[int]) -> Any:
    if is_hf_iterable(source.dataset):  # each process reads its own shards
        stream = HuggingFaceStream(source.dataset, backend.process_index, backend.num_processes, source.batch_size,
                                   source.collate_fn)
        return PreparedStreamLoader(stream, backend, source.drop_last)
    kind = PreparedIterableLoader if _is_iterable_dataset(source.dataset) else PreparedDataLoader
    return kind(source, backend, seed)


def uneven(prepared: Any, backend: Any) -> Any:
    """``prepared`` with Accelerate's ``even_batches=False`` (`prepare_loader`); returns it.

    A map-style loader (any `PreparedDataLoader`, samplers and batch samplers included) then
    leaves the epoch's last global batch as it is: the processes past its end get a shorter
    batch or none (Accelerate's ``BatchSamplerShard(even_batches=False)``, batch for batch). A
    loader over iterable data keeps its own even end, as in Accelerate, which reads
    ``even_batches`` for map-style data only.

    Example:
        >>> loader = uneven(prepare_loader(DataLoader(range(3)), backend, 0), backend)  # doctest: +SKIP
        >>> [len(b) for b in loader]   # process 0: [1, 1]; process 1: [1]
    """
    if isinstance(prepared, PreparedDataLoader):
        if getattr(backend, "uneven_batches", True) is False:
            raise NotImplementedError(
                f"DataLoaderConfiguration(even_batches=False) is not supported by the "
                f"{getattr(backend, 'name', type(backend).__name__)!r} backend: each step's batch there is one global "
                "array over every process, so every process needs a batch of the same size. Keep even_batches=True "
                "(gather_for_metrics drops the repeated samples)." + see("not-supported-yet"))
        prepared.even_batches = False
    return prepared


def prepare_loader(obj: Any, backend: Backend, seed: Optional[int], stateful: bool = False,
                   dispatch: bool = False, even_batches: bool = True, split_batches: bool = False) -> Optional[Any]:
    """The prepared form of a `DataLoader`, a Grain loader or dataset (`unified.data.streams`), or
    what the backend adapts (a ``torch.utils.data.DataLoader``); None otherwise.

    ``stateful`` (``DataLoaderConfiguration(use_stateful_dataloader=True)``): a loader the backend
    adapts comes back as a torchdata ``StatefulDataLoader`` too, as in Accelerate (`unified.data.stateful`).
    ``dispatch`` (``DataLoaderConfiguration(dispatch_batches=True)``): process 0 reads the loader and
    sends every process its part of each step (`unified.data.dispatch`; ``even_batches`` has no
    effect there, as in Accelerate; ``split_batches`` splits each of the loader's batches over the
    processes instead of sending each its own). ``even_batches=False``: see `uneven`.
    """
    if not even_batches and not dispatch:
        return uneven(prepare_loader(obj, backend, seed, stateful), backend)
    if dispatch:
        prepared = dispatched(obj, backend, seed, prepare_loader, split_batches)
        wrap = stateful and prepared is not None and not isinstance(obj, DataLoader)
        return as_stateful(prepared, obj) if wrap else prepared
    if isinstance(obj, DataLoader):
        return _prepare(obj, backend, obj.seed if obj.seed is not None else seed)
    stream = stream_for(obj, backend.process_index, backend.num_processes)
    if stream is not None:
        return PreparedStreamLoader(stream, backend)
    prepared = backend.prepare_loader(obj, seed) if isinstance(backend, ForeignLoaders) else None
    return as_stateful(prepared, obj) if stateful and prepared is not None else prepared


class PreparedIterableLoader:
    """The prepared form of a loader over iterable data (no ``__len__``/``__getitem__``).

    Every process reads the same stream; global batch ``k`` is the stream's next ``B*P`` items
    and process ``r`` keeps the ``r``-th ``B`` of them. An incomplete last global batch is
    dropped with ``drop_last=True``; otherwise it is filled up by repeating its own items, and
    `batch_layout` tells which rows are repeats (as for map-style data). A dataset with
    ``state_dict`` / ``load_state_dict`` (torchdata's protocol) is checkpointed through them, so
    a resume continues the stream without reading it again; other streams are read from the
    start and the consumed batches dropped on the host, never collated or moved to a device.
    """

    def __init__(self, source: Any, backend: Placement, seed: Optional[int]) -> None:
        self.dataset = source.dataset
        self.batch_size = source.batch_size
        self.drop_last = bool(getattr(source, "drop_last", False))
        self._collate = source.collate_fn
        self._backend = backend
        self.epoch = 0
        self.position = 0  # global batches consumed in this epoch
        self.activity: Optional[Any] = None  # see PreparedDataLoader
        self._layout: Optional[BatchLayout] = None
        self._stateful = callable(getattr(self.dataset, "state_dict", None)) and callable(
            getattr(self.dataset, "load_state_dict", None))
        self.items_read_to_skip = 0  # how many items the last iteration read only to drop them
        # a stream's end is unknown until it is reached: every batch is reported as not the last
        self.on_batch: Optional[Callable[[bool], None]] = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self._backend.num_processes

    def __iter__(self) -> Iterator[Any]:
        return self._run(skip_to=self.position)

    def _run(self, skip_to: int) -> Iterator[Any]:
        g, b = self.global_batch_size, self.batch_size
        mine = slice(self._backend.process_index * b, (self._backend.process_index + 1) * b)
        stream = iter(self.dataset)
        # A stateful dataset continues where it stands (the batches before are consumed); any
        # other stream starts over, so the batches up to `skip_to` are read and dropped.
        if not self._stateful:
            self.position = 0
        self.items_read_to_skip = 0
        with _in_use(self):
            while True:
                items = [item for _, item in zip(range(g), stream)]
                new = len(items)
                if new == 0 or (new < g and self.drop_last):
                    break
                if new < g:  # the stream's end: fill the global batch up with its own items again
                    items = [items[i % new] for i in range(g)]
                self.position += 1
                if self.position <= skip_to:  # read and dropped on the host, never collated or placed
                    self.items_read_to_skip += new
                else:
                    self._layout = _tail_layout(0, new, b, self._backend.num_processes)
                    if self.on_batch is not None:
                        self.on_batch(new < g)  # a short end is the stream's last batch
                    yield self._backend.place_batch(self._collate(items[mine]))
                if new < g:
                    break
        self.epoch, self.position = self.epoch + 1, 0

    def batch_layout(self) -> Optional[BatchLayout]:
        """See `PreparedDataLoader.batch_layout`."""
        return self._layout

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"epoch": self.epoch, "position": self.position,
                                 "global_batch_size": self.global_batch_size, "iterable": True}
        if self._stateful:
            state["dataset"] = self.dataset.state_dict()
        return state

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        """See `PreparedDataLoader.check_state_dict`."""
        self._resumed_position(state)

    def _resumed_position(self, state: Dict[str, Any]) -> int:
        """The position in this loader's global batches. Every process reads the whole stream, so
        ``position x saved global batch`` items were consumed (and a stateful dataset's state,
        written by the main process, is every process's); then the rule of `resume_position`
        (a stream's end is unknown: a saved position is never taken for the epoch's end)."""
        saved, g = int(state["global_batch_size"]), self.global_batch_size
        described = (f"a global batch of {g} items ({self.batch_size} per process x "
                     f"{self._backend.num_processes} processes)")
        return resume_position(0, int(state["position"]) * saved, saved, g, lambda _: math.inf, described)[1]

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.position = self._resumed_position(state)
        self.epoch = int(state["epoch"])
        if self._stateful and "dataset" in state:
            self.dataset.load_state_dict(state["dataset"])
