"""Iterable datasets read by DataLoader workers, every worker of every process one reader (the
torch side of `unified.data.streams.ReaderStream`; shared by every backend that adapts torch loaders,
imported only when such a loader is prepared).

Worker ``w`` of ``W`` in process ``rank`` of ``P`` is reader ``rank*W + w`` of ``P*W``: its
``get_worker_info()`` says so, so a dataset that splits its reading by worker (torch's documented
idiom) reads only its part, and no process reads the whole stream. A dataset that does not look
at its worker info is a stream that has to be read whole: worker 0 of each process reads it and
keeps the process's blocks of a batch (`unified.data.streams.own_blocks`: process ``r`` the blocks
``r, r + P, ...``, as without workers), the other workers end after their first item; the
processes' batches are still disjoint and cover it once.

The one private torch attribute used, ``torch.utils.data._utils.worker._worker_info`` (where
``get_worker_info()`` reads), is behind `worker_info_slot`, which
`backends.torch.private.check()` probes with the others.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import IterableDataset
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data._utils.worker import WorkerInfo

from unified.errors import BackendUnavailable, see


class ObservedWorkerInfo(WorkerInfo):
    """torch's ``WorkerInfo`` that notes whether the dataset read its ``id`` or ``num_workers``
    (whether it splits its reading by worker). One reader per worker process: the note is the
    class's."""

    __slots__ = ()
    read: List[bool] = [False]
    local: List[int] = [0, 1]  # this worker's own id and the process's worker count

    def __getattribute__(self, name: str) -> Any:
        if name in ("id", "num_workers"):
            ObservedWorkerInfo.read[0] = True
        return super().__getattribute__(name)


def worker_info_slot() -> Optional[WorkerInfo]:
    """This worker's ``WorkerInfo`` where torch keeps it (``None`` outside a worker)."""
    info = getattr(torch_worker, "_worker_info", _MISSING)
    if info is _MISSING or (info is not None and not dataclasses.is_dataclass(info)):
        raise BackendUnavailable(
            f"torch {torch.__version__} changed DataLoader workers: torch.utils.data._utils.worker._worker_info is "
            "gone or no longer a dataclass. unified relies on this private torch attribute; install a tested torch "
            "version (`unified env` shows the tested range) or report it." + see("private-api-changed"))
    return info


_MISSING = object()
_END = object()


class AsGlobalReader:
    """A DataLoader worker's ``worker_init_fn``: from here on ``get_worker_info()`` says reader
    ``rank*W + w`` of ``world*W`` (its ``dataset`` the user's), then the user's own
    ``worker_init_fn`` runs. A class, so that spawned workers can unpickle it.

    Example:
        >>> DataLoader(Readers(dataset, 8), batch_size=8, num_workers=2, worker_init_fn=AsGlobalReader(1, 2, None))
    """

    def __init__(self, rank: int, world: int, user_init: Optional[Any]) -> None:
        self.rank, self.world, self.user_init = rank, world, user_init

    def __call__(self, worker_id: int) -> None:
        real = worker_info_slot()
        fields = {field.name: getattr(real, field.name) for field in dataclasses.fields(real)}
        fields.update(id=self.rank * real.num_workers + real.id, num_workers=self.world * real.num_workers,
                      dataset=real.dataset.dataset if isinstance(real.dataset, Readers) else real.dataset)
        torch_worker._worker_info = ObservedWorkerInfo(**fields)
        ObservedWorkerInfo.read[0] = False
        ObservedWorkerInfo.local[:] = [real.id, real.num_workers]
        if self.user_init is not None:
            self.user_init(worker_id)


def reader_of(info: Optional[WorkerInfo]) -> Tuple[int, int, int, bool]:
    """(process, processes, worker, whether the dataset read its worker info) of this reader,
    without noting a read."""
    if not isinstance(info, ObservedWorkerInfo):
        return 0, 1, 0, True  # not a reader of ours: the whole stream is its own
    worker, workers = ObservedWorkerInfo.local
    readers = object.__getattribute__(info, "num_workers")
    return object.__getattribute__(info, "id") // workers, readers // workers, worker, ObservedWorkerInfo.read[0]


class Readers(IterableDataset):
    """The user's iterable dataset as this worker's reader. After its first item it is known
    whether the dataset read its worker info (it reads its own part: all of it is this
    reader's) or not (the process's first worker reads it whole and keeps the process's blocks
    of ``block`` items; the others end).

    Example:
        >>> loader = DataLoader(Readers(stream, 8), batch_size=8, num_workers=2,
        ...                     worker_init_fn=AsGlobalReader(0, 2, None))
    """

    def __init__(self, dataset: Any, block: int) -> None:
        self.dataset, self.block = dataset, int(block)
        self._read = [0]
        self._splits: Optional[bool] = None

    def __iter__(self) -> Iterator[Any]:
        from unified.data.streams import own_blocks

        process, processes, worker, _ = reader_of(worker_info_slot())
        items = iter(self.dataset)
        if self._splits is None:
            first = next(items, _END)
            if first is _END:
                return
            self._splits = reader_of(worker_info_slot())[3]
            items = itertools.chain([first], items)
        if self._splits:
            yield from items
        elif worker == 0:  # a stream read whole: once per process, by its first worker
            yield from own_blocks(items, process, processes, self.block, self._read)


class StatefulReaders(Readers):
    """`Readers` over a dataset with ``state_dict``/``load_state_dict`` (torchdata's protocol):
    its state and where this reader stands are the worker's state, which torchdata's
    ``StatefulDataLoader`` saves with each batch."""

    def state_dict(self) -> Dict[str, Any]:
        return {"dataset": self.dataset.state_dict(), "read": self._read[0], "splits": self._splits}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["dataset"])
        self._read, self._splits = [int(state["read"])], state["splits"]
