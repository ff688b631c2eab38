"""Sharded, resumable data loading written once for every backend.

The global sample order of an epoch depends only on ``(seed, epoch)``. Global batch ``k``
holds samples ``order[k*B*P:(k+1)*B*P]`` (``B`` the per-process batch size, ``P`` the number of
processes) and process ``r`` gets the ``r``-th slice of ``B`` of them. Because the order does
not depend on ``P``, a position (samples consumed) carries over to another process count.

Uneven end (the same on both backends): with ``drop_last=True`` the incomplete global batch is
dropped; otherwise it is filled up by wrapping around to the start of the epoch's order, and
``loader.padding_in_batch(k)`` says how many trailing samples of global batch ``k`` are repeats.
While a prepared loader is iterated, ``loader.batch_layout()`` says where the repeats of the batch
in use are (`BatchLayout`); `unified.metrics` reads it to gather each sample exactly once.

A torch ``DataLoader`` with its own sampler or batch sampler keeps it: each epoch's indices (or
batches of indices) are drawn from it once (`SampledLoader`, `BatchSampledLoader`) and sharded
the same way, so positions, resume and `skip_first_batches` work as for the built-in orders.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from .backend import Backend, ForeignLoaders
from .errors import see
from .prefetch import prefetched

__all__ = ["DataLoader", "PreparedDataLoader", "PreparedIterableLoader", "SampledLoader", "BatchSampledLoader",
           "BatchLayout", "OrderSource", "skip_first_batches", "prepare_loader", "default_collate",
           "resume_position"]


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
            raise ValueError(f"Invalid batch_size: expected an integer >= 1; received {batch_size!r}." + see("invalid-batch-size"))
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"Invalid prefetch: expected an integer >= 0 (batches placed ahead); received {prefetch!r}."
                             + see("invalid-prefetch"))
        if prefetch and _is_iterable_dataset(dataset):
            raise ValueError("prefetch works with map-style datasets (__len__ and __getitem__) only; an iterable "
                             "stream's position would move ahead of the training loop. Use prefetch=0." + see("invalid-prefetch"))
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


class Placement(Protocol):
    """What a prepared loader needs of a backend: its place in the group and batch placement."""

    process_index: int
    num_processes: int
    # False where the processes' batches of a step form one global array and must be equal (JAX)
    uneven_batches: bool

    def place_batch(self, batch: Any) -> Any: ...


class _HostOnly:
    """Stand-in `Placement` for an unprepared loader: one process, NumPy batches."""

    process_index, num_processes, uneven_batches = 0, 1, True

    def place_batch(self, batch: Any) -> Any:
        return batch


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where the repeated samples are in the global batch a prepared loader yielded last.

    ``rows[r]`` is how many rows process ``r`` holds of it; the first ``kept[r]`` of them are
    samples seen for the first time in the epoch, the others repeat samples to even out the
    end of the epoch (always at the end of a process's rows).

    Example:
        >>> BatchLayout(rows=(3, 3, 3), kept=(1, 0, 0)).repeats   # 10 samples, batch 3, 3 processes
        8
    """

    rows: Tuple[int, ...]
    kept: Tuple[int, ...]

    @property
    def repeats(self) -> int:
        return sum(self.rows) - sum(self.kept)

    @property
    def even(self) -> bool:
        """True when every process holds the same number of rows."""
        return len(set(self.rows)) <= 1


def _tail_layout(first: int, available: int, batch_size: int, processes: int) -> BatchLayout:
    """Layout of a global batch whose positions start at ``first`` when only positions below
    ``available`` are new samples; process ``r`` holds positions ``first + r*B ..`` (``B`` rows)."""
    kept = tuple(min(batch_size, max(0, available - (first + r * batch_size))) for r in range(processes))
    return BatchLayout((batch_size,) * processes, kept)


def resume_position(epoch: int, seen: int, saved_batch: int, batch: int, epoch_batches: Callable[[int], Any],
                    described: str) -> Tuple[int, int]:
    """Where a loader resumes: ``(epoch, next global batch)`` after ``seen`` samples (for a
    batch sampler: its batches) of ``epoch`` were consumed in global batches of ``saved_batch``,
    now that a global batch takes ``batch`` of them (another process count or batch size).
    ``epoch_batches(g)`` is the number of global batches of ``g`` in an epoch.

    The rule, the same for every loader: a position at the end of its epoch resumes at the
    start of the next one; otherwise ``seen`` must be a multiple of ``batch``, so that the
    next batch is exactly the first one not yet seen; else `ValueError` (never a rounding
    that would skip or repeat samples).

    Example:
        >>> resume_position(0, 12, 4, 6, lambda g: -(-24 // g), "a global batch of 6")
        (0, 2)
    """
    if saved_batch > 0 and seen >= epoch_batches(saved_batch) * saved_batch:  # the epoch was finished
        return epoch + 1, 0
    if seen % batch:
        below, above = seen // batch * batch, (seen // batch + 1) * batch
        raise ValueError(
            f"cannot resume after {seen} of the epoch's samples with {described}: the next batch would start at "
            f"sample {below} (repeating samples) or {above} (skipping samples). Resume with a process count or "
            f"batch size whose global batch divides {seen} (or the saving run's), or save at an epoch boundary"
        )
    return epoch, seen // batch


@contextlib.contextmanager
def _in_use(loader: Any) -> Iterator[None]:
    """While a prepared loader's iteration runs: tell its ``activity`` (the Accelerator's record of
    loaders being iterated, innermost last) that it started and, however it ends, that it ended."""
    activity = loader.activity
    if activity is not None:
        activity.entered(loader)
    try:
        yield
    finally:
        loader._layout = None
        if activity is not None:
            activity.left(loader)


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
        self._batches = batches or (lambda lists, epoch: (source.collate_fn([self.dataset[i] for i in ix]) for ix in lists))
        self.epoch = 0
        self.position = 0  # index of the next global batch in this epoch
        # told before each batch is yielded whether it is the epoch's last (closes an accumulation window)
        self.on_batch: Optional[Callable[[bool], None]] = None
        # Told when an iteration starts and ends (set by the Accelerator that prepared this loader).
        self.activity: Optional[Any] = None
        self._layout: Optional[BatchLayout] = None
        # global batches collated and placed ahead in a background thread (unified.DataLoader(prefetch=...))
        self.prefetch = int(getattr(source, "prefetch", 0) or 0)

    # -- the order --------------------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self._backend.num_processes

    def num_samples(self) -> int:
        """Samples in one epoch's order (the dataset's length; a sampler's own length)."""
        return len(self.dataset)

    def __len__(self) -> int:
        n, g = self.num_samples(), self.global_batch_size
        return n // g if self.drop_last else math.ceil(n / g)

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
            yield order[start:start + b].tolist() if start + b <= n else self.batch_indices(order, k)

    def padding_in_batch(self, batch: int) -> int:
        """How many trailing samples of global batch ``batch`` repeat the epoch's first samples."""
        return max(0, (batch + 1) * self.global_batch_size - self.num_samples())

    def _layout_of(self, order: Any, batch: int) -> BatchLayout:
        return _tail_layout(batch * self.global_batch_size, len(order), self.batch_size, self._backend.num_processes)

    def batch_layout(self) -> Optional[BatchLayout]:
        """The `BatchLayout` of the batch this loader yielded last, while an iteration is running
        (``None`` before its first batch and after it ended): which rows are repeats."""
        return self._layout

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._run()

    def _run(self, roll_over: bool = True) -> Iterator[Any]:
        if roll_over and self.position >= len(self):  # restored at the very end of an epoch
            self.epoch, self.position = self.epoch + 1, 0
        order = self.epoch_order(self.epoch)
        first = self.position
        placed = (self._place(batch) for batch in self._batches(self._index_lists(order, first), self.epoch))
        with _in_use(self):  # skipped batches are never loaded; prefetched ones are not consumed yet
            for batch in prefetched(placed, self.prefetch):
                self._layout = self._layout_of(order, self.position)
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


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class ShuffledOrder:
    """A random permutation of ``range(n)`` fixed by ``(seed, epoch)``, computed on demand.

    A 4-round Feistel network over the next even power of two, with cycle-walking back into
    ``[0, n)``, is a bijection; any slice costs time proportional to its length, so jumping to
    batch 100,000 of an epoch (resume, `skip_first_batches`) never materialises the whole order.
    """

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = np.random.default_rng([int(seed), int(epoch)]).integers(0, 2**63, size=4, dtype=np.uint64)

    def __len__(self) -> int:
        return self.n

    def _permute(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def _at(self, positions: np.ndarray) -> np.ndarray:
        values = self._permute(positions.astype(np.uint64))
        outside = values >= self.n
        while outside.any():  # cycle-walk: at most a few rounds, the domain is < 4n
            values[outside] = self._permute(values[outside])
            outside = values >= self.n
        return values.astype(np.int64)

    _BLOCK = 16384  # positions computed together: vectorised, and reused by the next batches

    def _block(self, number: int) -> np.ndarray:
        cache = self.__dict__.setdefault("_cache", {})
        if number not in cache:
            if len(cache) >= 2:
                cache.pop(next(iter(cache)))
            start = number * self._BLOCK
            cache[number] = self._at(np.arange(start, min(start + self._BLOCK, self.n), dtype=np.int64))
        return cache[number]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.n)
            if step != 1 or stop <= start:
                return self._at(np.arange(start, stop, step, dtype=np.int64))
            first, last = start // self._BLOCK, (stop - 1) // self._BLOCK
            parts = [self._block(b) for b in range(first, last + 1)]
            joined = parts[0] if len(parts) == 1 else np.concatenate(parts)
            offset = first * self._BLOCK
            return joined[start - offset:stop - offset]
        position = int(index)
        if not -self.n <= position < self.n:
            raise IndexError(f"position {position} outside an epoch of {self.n} samples")
        position %= self.n
        return int(self._block(position // self._BLOCK)[position % self._BLOCK])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self._at(np.arange(self.n, dtype=np.int64))
        return whole if dtype is None else whole.astype(dtype)

    def tolist(self) -> List[int]:
        return np.asarray(self).tolist()


class _IterableSkip:
    """`skip_first_batches` over a stream (`PreparedIterableLoader`, `unified.streams.PreparedStreamLoader`):
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
        if loader.position >= len(loader):
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
    from .streams import PreparedStreamLoader

    if isinstance(dataloader, (PreparedIterableLoader, PreparedStreamLoader)):
        if dataloader.position >= num_batches:
            return dataloader  # already there (restored by load_state): never skip twice
        return _IterableSkip(dataloader, int(num_batches))
    if isinstance(dataloader, PreparedDataLoader):
        return _SkippedView(dataloader, int(num_batches))
    raise TypeError(
        f"skip_first_batches expects a loader returned by accelerator.prepare() or a unified.DataLoader; "
        f"received {type(dataloader).__qualname__}." + see("skip-wrong-loader")
    )


def _is_iterable_dataset(dataset: Any) -> bool:
    return not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


def _prepare(source: Any, backend: Placement, seed: Optional[int]) -> Any:
    from .streams import HuggingFaceStream, PreparedStreamLoader, is_hf_iterable

    if is_hf_iterable(source.dataset):  # each process reads its own shards
        stream = HuggingFaceStream(source.dataset, backend.process_index, backend.num_processes, source.batch_size,
                                   source.collate_fn)
        return PreparedStreamLoader(stream, backend, source.drop_last)
    kind = PreparedIterableLoader if _is_iterable_dataset(source.dataset) else PreparedDataLoader
    return kind(source, backend, seed)


def prepare_loader(obj: Any, backend: Backend, seed: Optional[int]) -> Optional[Any]:
    """The prepared form of a `DataLoader`, a Grain loader or dataset (`unified.streams`), or
    what the backend adapts (a ``torch.utils.data.DataLoader``); None otherwise."""
    from .streams import PreparedStreamLoader, stream_for

    if isinstance(obj, DataLoader):
        return _prepare(obj, backend, obj.seed if obj.seed is not None else seed)
    stream = stream_for(obj, backend.process_index, backend.num_processes)
    if stream is not None:
        return PreparedStreamLoader(stream, backend)
    return backend.prepare_loader(obj, seed) if isinstance(backend, ForeignLoaders) else None


class PreparedIterableLoader:
    """The prepared form of a loader over iterable data (no ``__len__``/``__getitem__``).

    Every process reads the same stream; global batch ``k`` is the stream's next ``B*P`` items
    and process ``r`` keeps the ``r``-th ``B`` of them. An incomplete last global batch is
    dropped with ``drop_last=True``; otherwise it is filled up by repeating its own items, and
    `batch_layout` tells which rows are repeats (as for map-style data). A dataset with
    ``state_dict`` / ``load_state_dict`` (torchdata's protocol) is checkpointed through them, so a resume continues the stream without reading it again;
    other streams are read from the start and the consumed batches dropped on the host, never
    collated or moved to a device.
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


# -- loaders that keep a torch DataLoader's own sampler ------------------------------------------------
class OrderSource(Protocol):
    """A sampler (or batch sampler) as the sampler loaders see it; the backend adapts its own.

    ``draw(epoch)`` returns the epoch's sample indices (a batch sampler: its lists of indices),
    the same on every process and whenever it is drawn again for that epoch. ``state()`` is
    taken right before an epoch is drawn and restored by ``load(state)`` before that epoch is
    drawn again after a resume (``None``: the source has no state; its draw must then depend
    on the epoch only).
    """

    def draw(self, epoch: int) -> Any: ...

    def length(self) -> Optional[int]: ...

    def state(self) -> Optional[Any]: ...

    def load(self, state: Any) -> None: ...

    def agree(self, broadcast: Callable[[Any], Any]) -> None:
        """Make every process draw the same orders: ``broadcast(value)`` returns process 0's
        JSON ``value`` on every process (the seeds of generators the sampler made itself)."""


def derived_seed(seed: int, epoch: int) -> int:
    """A 32-bit seed from ``(seed, epoch)``: what a sampler's generators are seeded with for an epoch."""
    return int(np.random.SeedSequence([int(seed) & (2**63 - 1), int(epoch)]).generate_state(1)[0])


@contextlib.contextmanager
def seeded_host_rngs(seed: int, epoch: int) -> Iterator[None]:
    """Python's ``random`` and NumPy's global generator seeded from ``(seed, epoch)`` for the body,
    then put back as they were: a sampler drawn inside gives the same order on every process and
    on every resume, and the training's own random numbers are not shifted."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    value = derived_seed(seed, epoch)
    random.seed(value)
    np.random.seed(value)
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


@dataclasses.dataclass
class _Drawn:
    epoch: int
    items: Any           # indices (NumPy int64) or a list of index lists
    checksum: int
    start_state: Any     # the source's state right before this epoch was drawn


def _checksum(items: Any) -> int:
    if isinstance(items, np.ndarray):
        return zlib.crc32(np.ascontiguousarray(items, dtype=np.int64).tobytes())
    sizes = np.array([len(b) for b in items], dtype=np.int64)
    flat = np.array([i for b in items for i in b], dtype=np.int64)
    return zlib.crc32(flat.tobytes(), zlib.crc32(sizes.tobytes()))


class _DrawnEpochs:
    """Each epoch drawn once from an `OrderSource` and kept while it is iterated; checkpoints
    hold the source's state at the epoch's start and the order's checksum, so a resume draws
    the same epoch again (or says that the sampler gave another order)."""

    _source: OrderSource
    epoch: int
    position: int

    def _init_drawn(self, source: OrderSource) -> None:
        self._source = source
        self._drawn: Optional[_Drawn] = None
        self._resume: Optional[Dict[str, Any]] = None  # what load_state_dict left for the saved epoch

    def connect(self, exchange: Any) -> None:
        """Called by `Accelerator.prepare` on every process with its `unified.collectives.Collectives`:
        the sampler's orders agree (see `OrderSource.agree`), however its generators were seeded."""
        self._source.agree(lambda value: exchange.broadcast_json(value, operation="prepare_loader"))

    def _draw(self, epoch: int) -> _Drawn:
        if self._drawn is not None and self._drawn.epoch == epoch:
            return self._drawn
        resume = self._resume if self._resume is not None and self._resume["epoch"] == epoch else None
        if resume is not None and resume.get("sampler") is not None:
            self._source.load(resume["sampler"])
        start = self._source.state()
        items = self._source.draw(epoch)
        drawn = _Drawn(epoch, items, _checksum(items), start)
        if resume is not None and resume.get("order_crc32") is not None and resume["order_crc32"] != drawn.checksum:
            raise ValueError(
                f"the data loader's sampler gave another order for epoch {epoch} than in the run that saved the "
                "checkpoint, so the resumed run would see other samples. Give the sampler state_dict() and "
                "load_state_dict(), or make its order depend only on the epoch (set_epoch) and on the random "
                "generators unified seeds for it." + see("sampler-order-changed")
            )
        self._resume = None
        self._drawn = drawn
        return drawn

    def _source_state(self) -> Dict[str, Any]:
        drawn = self._drawn if self._drawn is not None and self._drawn.epoch == self.epoch else None
        if drawn is None and self._resume is not None and self._resume["epoch"] == self.epoch:
            return {"sampler": self._resume.get("sampler"), "order_crc32": self._resume.get("order_crc32")}
        return {"sampler": drawn.start_state if drawn is not None else self._source.state(),
                "order_crc32": drawn.checksum if drawn is not None and self.position > 0 else None}

    def _load_source_state(self, state: Dict[str, Any]) -> None:
        self._drawn = None
        self._resume = {"epoch": self.epoch, "sampler": state.get("sampler"), "order_crc32": state.get("order_crc32")}


class SampledLoader(_DrawnEpochs, PreparedDataLoader):
    """A prepared loader whose epoch order is a sampler's: the indices the sampler yields for an
    epoch, drawn once, sharded like any order (global batch ``k`` is indices ``k*B*P ..``,
    process ``r`` its ``r``-th ``B``; an uneven end wraps around). Skipping and resuming are
    index arithmetic on that order: no sample is loaded to skip it.
    """

    def __init__(self, source: Any, backend: Placement, seed: Optional[int], order: OrderSource, **kwargs: Any) -> None:
        PreparedDataLoader.__init__(self, source, backend, seed, **kwargs)
        self._init_drawn(order)

    def num_samples(self) -> int:
        known = self._source.length()
        return known if known is not None else len(self._draw(self.epoch).items)

    def epoch_order(self, epoch: int) -> Any:
        return self._draw(epoch).items

    def state_dict(self) -> Dict[str, Any]:
        return {**PreparedDataLoader.state_dict(self), **self._source_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        PreparedDataLoader.load_state_dict(self, state)
        self._load_source_state(state)


class BatchSampledLoader(_DrawnEpochs, PreparedDataLoader):
    """A prepared loader over a batch sampler's batches, as Accelerate's ``BatchSamplerShard``:
    global step ``k`` is batches ``k*P .. k*P+P-1`` of the epoch and process ``r`` takes batch
    ``k*P + r`` whole, so batches may differ in size (length buckets, token budgets). When the
    epoch's batch count does not divide by ``P``, the last step is filled up with the epoch's
    first batches, which `batch_layout` marks as repeats; with the batch sampler's
    ``drop_last=True`` that step is dropped instead. Positions count steps; a checkpoint
    resumes at the next step without loading any skipped sample.
    """

    def __init__(self, source: Any, backend: Placement, seed: Optional[int], order: OrderSource, **kwargs: Any) -> None:
        PreparedDataLoader.__init__(self, source, backend, seed, **kwargs)
        self._init_drawn(order)

    def num_batches(self) -> int:
        """Batches the batch sampler yields in one epoch."""
        known = self._source.length()
        return known if known is not None else len(self._draw(self.epoch).items)

    def num_samples(self) -> int:
        return sum(len(b) for b in self._draw(self.epoch).items)

    def __len__(self) -> int:
        m, p = self.num_batches(), self._backend.num_processes
        return m // p if self.drop_last else math.ceil(m / p)

    def epoch_order(self, epoch: int) -> Any:
        return self._draw(epoch).items

    def _step(self, batches: List[List[int]], step: int) -> List[int]:
        """Indices into ``batches`` of every process's batch of ``step`` (past the end: repeats
        of the epoch's first batches)."""
        p, m = self._backend.num_processes, len(batches)
        return [j if j < m else (j - m) % m for j in range(step * p, step * p + p)]

    def batch_indices(self, order: Any, batch: int) -> List[int]:
        return [int(i) for i in order[self._step(order, batch)[self._backend.process_index]]]

    def _index_lists(self, order: Any, first: int) -> Iterator[List[int]]:
        for k in range(first, len(self)):
            layout = self._layout_of(order, k)
            if not layout.even and not getattr(self._backend, "uneven_batches", True):
                raise ValueError(
                    f"step {k} of the batch sampler's epoch gives the processes batches of {list(layout.rows)} "
                    "samples, but on this backend every process's batch of a step is part of one global array, "
                    "so they must be equal. Make the batch sampler yield equal sizes for the batches of a step "
                    "(e.g. sizes that do not vary, or drop_last=True in each bucket)." + see("uneven-batches")
                )
            yield self.batch_indices(order, k)

    def _layout_of(self, order: Any, batch: int) -> BatchLayout:
        m = len(order)
        picks = self._step(order, batch)
        first = batch * self._backend.num_processes
        rows = tuple(len(order[j]) for j in picks)
        return BatchLayout(rows, tuple(r if first + i < m else 0 for i, r in enumerate(rows)))

    def padding_in_batch(self, batch: int) -> int:
        """How many samples of step ``batch`` repeat batches of the epoch's start."""
        return self._layout_of(self._draw(self.epoch).items, batch).repeats

    def state_dict(self) -> Dict[str, Any]:
        p = self._backend.num_processes
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batches_seen": self.position * p,
                "num_processes": p, "num_batches": self.num_batches(), "batch_sampler": True, **self._source_state()}

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        """See `PreparedDataLoader.check_state_dict`; the batch count is compared here when the
        sampler knows it without drawing an epoch (else by `load_state_dict`)."""
        if "batches_seen" not in state:
            raise ValueError("the checkpoint's data loader was not prepared from a batch sampler; prepare the same "
                             "kind of loader as in the run that saved it")
        known = self._source.length()
        if known is not None:
            self._resumed_position(state, known)

    def _resumed_position(self, state: Dict[str, Any], batches: int) -> Tuple[int, int]:
        """Steps take ``P`` of the sampler's batches: ``batches_seen`` follows the rule of
        `resume_position` in units of batches."""
        if state["num_batches"] != batches:
            raise ValueError(f"the batch sampler gives {batches} batches per epoch; the checkpoint's gave "
                             f"{state['num_batches']}")
        p = self._backend.num_processes

        def steps(per_step: int) -> int:
            return batches // per_step if self.drop_last else math.ceil(batches / per_step)

        return resume_position(int(state["epoch"]), int(state["batches_seen"]), int(state.get("num_processes") or 0),
                               p, steps, f"{p} processes (each step takes {p} of the batch sampler's batches)")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.epoch = int(state["epoch"])
        self._load_source_state(state)
        self.epoch, self.position = self._resumed_position(state, self.num_batches())
        self.seed = int(state["seed"])
