"""Where a prepared batch's rows come from: `BatchLayout` (which rows of a global batch are
repeats), the position a resume continues from, and what a prepared loader needs of a backend
(`Placement`). The bottom of `unified.data`: it imports nothing else of it."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Protocol, Tuple

from ..backend import ForeignLoaders


class Placement(Protocol):
    """What a prepared loader needs of a backend: its place in the group and batch placement."""

    process_index: int
    num_processes: int
    # False where the processes' batches of a step form one global array and must be equal (JAX)
    uneven_batches: bool

    def place_batch(self, batch: Any) -> Any: ...


class DataRanks:
    """A backend as the prepared loaders see it under a `unified.ParallelismConfig`: its
    ``process_index`` / ``num_processes`` are the data-parallel rank and size (every process
    of one tensor-parallel group reads the same batches); everything else is the backend's.

    Example:
        >>> view = DataRanks(backend, rank=1, size=2)   # process 3 of dp_shard=2 x tp=2  # doctest: +SKIP
        >>> view.process_index, view.num_processes                                      # doctest: +SKIP
        (1, 2)
    """

    def __init__(self, backend: Any, rank: int, size: int) -> None:
        self._backend, self.process_index, self.num_processes = backend, rank, size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def prepare_loader(self, loader: Any, seed: Any) -> Any:
        """The backend's adapter of foreign loaders, run with these ranks."""
        if not isinstance(self._backend, ForeignLoaders):
            return None
        return type(self._backend).prepare_loader(self, loader, seed)


ForeignLoaders.register(DataRanks)  # prepare_loader asks the view, which asks the backend


def data_ranks(backend: Any, place: Any) -> Any:
    """What prepared loaders read ranks from: ``backend`` itself, or a `DataRanks` view of it
    when ``place`` (a `unified.training.parallelism.MeshPlace`) has fewer data-parallel ranks
    than processes."""
    if place is None or place.data_size == backend.num_processes:
        return backend
    return DataRanks(backend, place.data_rank, place.data_size)


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
