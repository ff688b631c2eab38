"""The global sample order of an epoch: `ShuffledOrder`, fixed by ``(seed, epoch)`` alone, and
the order a torch sampler draws (`OrderSource`, `_DrawnEpochs`), with the seeds and host RNG
streams they are drawn under."""
from __future__ import annotations

import contextlib
import dataclasses
import random
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol

import numpy as np

from ..errors import see


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
        """Called by `Accelerator.prepare` on every process with its `unified.runtime.collectives.Collectives`:
        the sampler's orders agree (see `OrderSource.agree`), however its generators were seeded."""
        self._source.agree(lambda value: exchange.broadcast_json(value, operation="prepare_loader"))

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at the next iteration. Its order is drawn now (once), so the sampler's own
        ``set_epoch`` runs right away, as Accelerate's ``DataLoaderShard.set_epoch`` calls it.

        Example:
            >>> loader.set_epoch(1)           # doctest: +SKIP
            >>> batch_sampler.epoch
            1
        """
        super().set_epoch(epoch)  # type: ignore[misc]  # the loader's (`PreparedDataLoader.set_epoch`)
        self._draw(int(epoch))

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
