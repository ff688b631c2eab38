"""Sharded, resumable data loading written once for every backend.

The global sample order of an epoch depends only on ``(seed, epoch)``. Global batch ``k``
holds samples ``order[k*B*P:(k+1)*B*P]`` (``B`` the per-process batch size, ``P`` the number of
processes) and process ``r`` gets the ``r``-th slice of ``B`` of them. Because the order does
not depend on ``P``, a position (samples consumed) carries over to another process count.

Uneven end (the same on both backends): with ``drop_last=True`` the incomplete global batch is
dropped; otherwise it is filled up by wrapping around to the start of the epoch's order, and
``loader.padding_in_batch(k)`` says how many trailing samples of global batch ``k`` are repeats.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence

import numpy as np

from .backend import Backend, ForeignLoaders
from .errors import see

__all__ = ["DataLoader", "PreparedDataLoader", "skip_first_batches", "prepare_loader", "default_collate"]


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

    Example:
        >>> loader = unified.DataLoader(dataset, batch_size=32, shuffle=True, seed=0)
        >>> loader = accelerator.prepare(loader)
        >>> for batch in loader:
        ...     ...
    """

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = False, seed: Optional[int] = None,
                 drop_last: bool = False, collate_fn: Optional[Callable[[List[Any]], Any]] = None) -> None:
        if batch_size < 1:
            raise ValueError(f"Invalid batch_size: expected an integer >= 1; received {batch_size!r}." + see("invalid-batch-size"))
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

    def place_batch(self, batch: Any) -> Any: ...


class _HostOnly:
    """Stand-in `Placement` for an unprepared loader: one process, NumPy batches."""

    process_index, num_processes = 0, 1

    def place_batch(self, batch: Any) -> Any:
        return batch


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

    # -- the order --------------------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self._backend.num_processes

    def __len__(self) -> int:
        n, g = len(self.dataset), self.global_batch_size
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
        return max(0, (batch + 1) * self.global_batch_size - len(self.dataset))

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._run()

    def _run(self, roll_over: bool = True) -> Iterator[Any]:
        if roll_over and self.position >= len(self):  # restored at the very end of an epoch
            self.epoch, self.position = self.epoch + 1, 0
        order = self.epoch_order(self.epoch)
        for batch in self._batches(self._index_lists(order, self.position), self.epoch):  # skipped: never loaded
            self.position += 1  # a checkpoint taken while this batch is in use resumes after it
            if self.on_batch is not None:
                self.on_batch(self.position >= len(self))
            yield self._place(batch)
        self.epoch, self.position = self.epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch at the next iteration."""
        self.epoch, self.position = int(epoch), 0

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "samples_seen": self.position * self.global_batch_size, "global_batch_size": self.global_batch_size,
                "dataset_length": len(self.dataset)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state["dataset_length"] != len(self.dataset):
            raise ValueError(f"the data loader's dataset has {len(self.dataset)} samples; the checkpoint's had "
                             f"{state['dataset_length']}")
        seen, g = int(state["samples_seen"]), self.global_batch_size
        if seen % g:
            raise ValueError(
                f"cannot resume at sample {seen} of the epoch with a global batch of {g} samples "
                f"({self.batch_size} per process x {self._backend.num_processes}); choose a process count or batch "
                f"size whose global batch divides {seen}, or resume at an epoch boundary"
            )
        self.epoch, self.position, self.seed = int(state["epoch"]), seen // g, int(state["seed"])


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
    """`skip_first_batches` over a stream without state: read and drop on the host."""

    def __init__(self, loader: "PreparedIterableLoader", num_batches: int) -> None:
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
    if isinstance(dataloader, PreparedIterableLoader):
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
    kind = PreparedIterableLoader if _is_iterable_dataset(source.dataset) else PreparedDataLoader
    return kind(source, backend, seed)


def prepare_loader(obj: Any, backend: Backend, seed: Optional[int]) -> Optional[Any]:
    """The prepared form of a `DataLoader` or a ``torch.utils.data.DataLoader``; None otherwise."""
    if isinstance(obj, DataLoader):
        return _prepare(obj, backend, obj.seed if obj.seed is not None else seed)
    return backend.prepare_loader(obj, seed) if isinstance(backend, ForeignLoaders) else None


class PreparedIterableLoader:
    """The prepared form of a loader over iterable data (no ``__len__``/``__getitem__``).

    Every process reads the same stream; global batch ``k`` is the stream's next ``B*P`` items
    and process ``r`` keeps the ``r``-th ``B`` of them (an incomplete last global batch is
    dropped). A dataset with ``state_dict`` / ``load_state_dict`` (torchdata's protocol) is
    checkpointed through them, so a resume continues the stream without reading it again;
    other streams are read from the start and the consumed batches dropped on the host, never
    collated or moved to a device.
    """

    def __init__(self, source: Any, backend: Placement, seed: Optional[int]) -> None:
        self.dataset = source.dataset
        self.batch_size = source.batch_size
        self._collate = source.collate_fn
        self._backend = backend
        self.epoch = 0
        self.position = 0  # global batches consumed in this epoch
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
        while True:
            items = [item for _, item in zip(range(g), stream)]
            if len(items) < g:
                break
            self.position += 1
            if self.position <= skip_to:  # read and dropped on the host, never collated or placed
                self.items_read_to_skip += g
                continue
            if self.on_batch is not None:
                self.on_batch(False)
            yield self._backend.place_batch(self._collate(items[mine]))
        self.epoch, self.position = self.epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"epoch": self.epoch, "position": self.position,
                                 "global_batch_size": self.global_batch_size, "iterable": True}
        if self._stateful:
            state["dataset"] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state["global_batch_size"] != self.global_batch_size:
            raise ValueError(
                f"cannot resume an iterable stream saved with a global batch of {state['global_batch_size']} "
                f"samples with {self.global_batch_size}; keep batch_size x num_processes the same"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if self._stateful and "dataset" in state:
            self.dataset.load_state_dict(state["dataset"])
