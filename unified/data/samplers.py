"""Prepared loaders that keep a torch ``DataLoader``'s own sampler (`SampledLoader`) or batch
sampler (`BatchSampledLoader`): each epoch's indices are drawn from it once and sharded like
any order; and a loader without automatic batching (`ItemSampledLoader`, torch's
``batch_size=None``), whose every item is a batch."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..errors import see
from .layout import BatchLayout, Placement, resume_position
from .loaders import PreparedDataLoader
from .orders import OrderSource, _DrawnEpochs
from .streams import rows_of


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

    def _length(self, even: bool) -> int:
        m, p = self.num_batches(), self._backend.num_processes
        if self.drop_last:
            return m // p
        if not even:  # the batches k*P + r that exist (Accelerate's BatchSamplerShard)
            return max(0, math.ceil((m - self._backend.process_index) / p))
        return math.ceil(m / p)

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
        kept = tuple(r if first + i < m else 0 for i, r in enumerate(rows))
        return BatchLayout(rows if self.even_batches else kept, kept)

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


class ItemSampledLoader(BatchSampledLoader):
    """A prepared loader over a loader without automatic batching (torch's ``batch_size=None``):
    every item its sampler draws (an index, or a list of indices when the sampler is a
    ``BatchSampler``) is already a batch, ``collate_fn(dataset[item])``. The items are dealt as
    a batch sampler's batches, as Accelerate's ``BatchSamplerShard`` deals them: step ``k`` gives
    process ``r`` item ``k*P + r``; when the epoch's item count does not divide by ``P`` the last
    step is filled up with the epoch's first items (with the sampler's ``drop_last=True``, a
    ``BatchSampler``'s, that step is dropped). Positions count steps; a resume or
    `skip_first_batches` loads no skipped item.

    An item that is a list of indices (a ``BatchSampler`` as the sampler) has that many rows, known
    to every process. Another item's rows are known only once it is loaded: on the epoch's last
    step (where a short item or repeated items are) the processes tell each other their rows (one
    small collective, on every process at that step), so that `batch_layout` marks the repeats and
    `gather_for_metrics` counts every item once, also when the last items are shorter.

    Example:
        >>> loader = accelerator.prepare(torch.utils.data.DataLoader(batches, batch_size=None))  # doctest: +SKIP
        >>> [len(b) for b in loader]   # process r's items r, r+P, r+2P, ... of the epoch
    """

    def __init__(self, source: Any, backend: Placement, seed: Optional[int], order: OrderSource, **kwargs: Any) -> None:
        super().__init__(source, backend, seed, order, **kwargs)
        self._exchange: Optional[Any] = None

    def connect(self, exchange: Any) -> None:
        """See `unified.data.orders._DrawnEpochs.connect`; the collectives also tell the rows of a
        step that repeats items."""
        self._exchange = exchange
        super().connect(exchange)

    def num_samples(self) -> int:
        """Items in one epoch (each one a batch)."""
        return self.num_batches()

    def batch_indices(self, order: Any, batch: int) -> Any:
        """This process's item of step ``batch``: an index, or a list of indices."""
        item = order[self._step(order, batch)[self._backend.process_index]]
        return [int(i) for i in item] if isinstance(item, (list, tuple)) else int(item)

    def _index_lists(self, order: Any, first: int) -> Iterator[Any]:
        for k in range(first, len(self)):
            yield self.batch_indices(order, k)

    def _layout_of(self, order: Any, batch: int) -> BatchLayout:
        """The layout of step ``batch`` counted in items: one per process, none kept where it repeats."""
        p, m = self._backend.num_processes, len(order)
        kept = tuple(1 if batch * p + r < m else 0 for r in range(p))
        return BatchLayout((1,) * p if self.even_batches else kept, kept)

    def _layout_in_use(self, order: Any, batch: int, placed: Any) -> BatchLayout:
        items, p = self._layout_of(order, batch), self._backend.num_processes
        try:
            mine = rows_of(placed)
        except ValueError:  # no array in it: the item counts as one row
            mine = 1
        picks = self._step(order, batch)
        if all(isinstance(order[j], (list, tuple)) for j in picks):  # index lists: every process knows the rows
            rows = tuple(len(order[j]) for j in picks)
        elif (not items.repeats and batch < len(self) - 1) or not self.even_batches or self._exchange is None \
                or p == 1:  # (a short item is the epoch's last, as a batch sampler's; even_batches=False: no peers)
            rows = (mine,) * p
        else:
            rows = tuple(int(n) for n in self._exchange.all_gather_json(mine, operation="item_rows"))
        return BatchLayout(rows, tuple(n * k for n, k in zip(rows, items.kept)))

    def state_dict(self) -> Dict[str, Any]:
        return {**BatchSampledLoader.state_dict(self), "items": True}
