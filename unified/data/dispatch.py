"""Accelerate's ``DataLoaderConfiguration(dispatch_batches=True)``: the main process reads the
loader and sends every process its part of each step (`DispatchedLoader`).

Each step, process 0 takes the loader's next ``P`` batches (``P`` processes), concatenates them
along the first axis and broadcasts the result (the arrays through the backend's array
broadcast, their nesting, dtypes and shapes as JSON: no pickle); process ``r`` keeps rows
``r*b .. (r+1)*b`` with ``b = rows // P``. This is Accelerate 1.15's ``DataLoaderDispatcher``
with ``split_batches=False``, row for row:

* the loader's batches are its own, as one process would iterate it (a short last batch
  stays short);
* an epoch whose last step has fewer than ``P`` batches (or rows not divisible by ``P``) ends
  with that step: with the loader's ``drop_last=True`` a step of fewer than ``P`` batches is
  dropped; otherwise, when its rows do not divide by ``P``, the step is filled up with the first
  ``P`` rows of the epoch and ``b = rows // P + 1`` (every process gets ``b`` rows, fewer than the
  loader's ``batch_size``); `batch_layout` marks those repeats, so ``gather_for_metrics`` drops them;
* ``len()`` is ``ceil(len(loader) / P)`` (``len(loader) // P`` with ``drop_last=True``);
* ``even_batches`` has no effect (Accelerate's dispatcher does not read it either).

With ``split_batches=True`` a step is one batch of the loader (whose ``batch_size`` must divide
by ``P``), split the same way: ``len()`` is the loader's, and the last step is filled up as above.

Positions count steps. A checkpoint holds the loader's own position in its batches (the
index arithmetic of unified's loaders: skipped map-style batches are never loaded), the step,
and the epoch's first ``P`` rows (to fill up its last step after a resume), so a resumed run sees
exactly the batches an uninterrupted one would. Only process 0 reads the dataset.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..backend import ForeignLoaders
from ..checkpoint import codec
from ..checkpoint.safetensors_io import numpy_dtype, safetensors_dtype
from ..errors import see
from .layout import BatchLayout, _in_use, resume_position
from .orders import _DrawnEpochs

__all__ = ["DispatchedLoader", "dispatched"]

_DIFFERENT_SIZES = ("You can't use batches of different size with `dispatch_batches=True` or when using an "
                    "`IterableDataset`: the main process concatenates the loader's batches of a step, so they "
                    "must agree in everything but their first dimension ({detail}). Pad them to one shape in "
                    "collate_fn, or leave dispatch_batches unset so that each process reads its own batches.")


class _MainReader(ForeignLoaders):
    """The `unified.data.layout.Placement` of the loader that process 0 reads alone: one process,
    batches left on the host. A loader of another library is adapted by the backend's own
    ``prepare_loader``, called with this reader in the backend's place."""

    process_index, num_processes, uneven_batches, device = 0, 1, True, None

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def place_batch(self, batch: Any) -> Any:
        return batch

    def prepare_loader(self, loader: Any, seed: Optional[int]) -> Any:
        adapt = getattr(type(self._backend), "prepare_loader", None)
        return adapt(self, loader, seed) if isinstance(self._backend, ForeignLoaders) else None


def dispatched(obj: Any, backend: Any, seed: Optional[int], prepare: Callable[..., Any],
               split_batches: bool = False) -> Optional[Any]:
    """``obj`` prepared with ``dispatch_batches=True`` (a `DispatchedLoader` over what ``prepare``,
    `unified.data.prepare_loader`, makes of it for one process); None when ``obj`` is not a data
    loader. A backend whose step batches are one global array built from every process's part
    (JAX) refuses it, naming its own way. ``split_batches``: each step is one of the loader's
    batches, whose size must divide by the processes (Accelerate's check and message).

    Example:
        >>> loader = dispatched(torch_loader, backend, 0, prepare_loader, split_batches=True)  # doctest: +SKIP
        >>> len(loader) == len(torch_loader)
        True
    """
    inner = prepare(obj, _MainReader(backend), seed)
    if inner is None:
        return None
    if getattr(backend, "uneven_batches", True) is False:
        raise NotImplementedError(
            "DataLoaderConfiguration(dispatch_batches=True) is not supported by the "
            f"{getattr(backend, 'name', type(backend).__name__)!r} backend: each step's batch there is already one "
            "global array over every process, built from what each process reads. Leave dispatch_batches unset "
            "(or False): prepare() then gives each process its own rows of every global batch, read by that process "
            "(for a stream, its own shards), and gather_for_metrics collects the global batch."
            + see("dispatch-batches-jax"))
    size, p = getattr(inner, "batch_size", None), backend.num_processes
    if split_batches and isinstance(size, int) and size > 1 and size % p != 0:
        raise ValueError(f"To use a `DataLoader` in `split_batches` mode, the batch size ({size}) needs to be a round "
                         f"multiple of the number of processes ({p})." + see("dispatch-batch-types"))
    return DispatchedLoader(inner, backend, bool(getattr(obj, "drop_last", False)), split_batches)


def _map_style(inner: Any) -> bool:
    """True for a `unified.data.PreparedDataLoader` (any sampler): positions are index arithmetic,
    ``_run(roll_over=False)`` reads from one, and an epoch can be read again."""
    return callable(getattr(inner, "epoch_order", None)) and callable(getattr(inner, "batch_indices", None))


# -- batches as JSON structure + arrays: `unified.checkpoint.codec` with the container classes kept ----------
def _encode(tree: Any, is_array: Callable[[Any], bool]) -> Tuple[Any, List[Any], List[Any]]:
    """``(structure, arrays, objects)``: ``tree``'s nesting as JSON (`codec.encode` with
    ``containers=True``), its arrays and its other leaves, each in depth-first order (dicts in
    their own key order, as Accelerate walks them)."""
    objects: List[Any] = []
    try:
        structure, arrays = codec.encode(tree, is_array, "", containers=True, objects=objects)
    except TypeError as err:
        raise TypeError(f"a dispatched batch cannot be sent to the other processes: {err}"
                        + see("dispatch-batch-types")) from err
    return structure, list(arrays.values()), objects


def _array_names(structure: Any) -> List[str]:
    """The array names of ``structure``, in the order `_encode` listed the arrays."""
    names: List[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, dict):
            if "__array__" in node:
                names.append(node["__array__"])
            else:
                for value in node.values():
                    walk(value)

    walk(structure)
    return names


def _decode(structure: Any, arrays: List[Any], objects: List[Any]) -> Any:
    """Rebuild what `_encode` took apart; container classes as Accelerate does (``type(x)(...)``)
    where the class is already imported here, else plain dicts, lists and tuples."""
    return codec.decode(structure, dict(zip(_array_names(structure), arrays)), lambda a: a, containers=True,
                        objects=objects)


# -- the loader ---------------------------------------------------------------------------------------
class DispatchedLoader:
    """A prepared loader in Accelerate's dispatch mode (see the module's docstring): process 0
    iterates ``inner`` (the loader's own batches, on the host) and every process gets its rows
    of each step. Iterating continues from the current position; checkpoints save and restore it.

    Example:
        >>> accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
        >>> loader = accelerator.prepare(torch.utils.data.DataLoader(stream, batch_size=8))
        >>> for batch in loader:   # 8 rows on each process; only process 0 reads the stream
        ...     ...
    """

    def __init__(self, inner: Any, backend: Any, drop_last: bool, split_batches: bool = False) -> None:
        self.inner = inner
        self.split_batches = split_batches
        # Accelerate's slice_fn_for_dispatch: slice_fn(step_batch, slice, process_index=, num_processes=)
        # picks this process's part of a step instead of its rows
        self.slice_fn: Optional[Callable[..., Any]] = None
        self._backend = backend
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # steps taken in this epoch
        self.on_batch: Optional[Callable[[bool], None]] = None  # see PreparedDataLoader
        self.activity: Optional[Any] = None
        self._layout: Optional[BatchLayout] = None
        self._exchange: Optional[Any] = None  # the Accelerator's collectives (`connect`)
        # the epoch's first P rows (host), to fill up its last step: (structure, arrays)
        self._pad: Optional[Tuple[Any, List[np.ndarray]]] = None
        # process 0, a stream: batches read ahead to see whether it ends, and the loader's state before them
        self._ahead: Optional[Tuple[List[Any], Any]] = None
        # process 0: the loader's epoch was read to its end (a stream that starts over when read again)
        self._ended = False

    # -- what Accelerate's DataLoaderDispatcher answers ------------------------------------------
    @property
    def dataset(self) -> Any:
        return self.inner.dataset

    @property
    def batch_size(self) -> Any:
        return self.inner.batch_size

    @property
    def total_batch_size(self) -> int:
        """Rows of one step over every process: the loader's ``batch_size`` times the processes."""
        return self.inner.batch_size * self._per_step

    @property
    def _per_step(self) -> int:
        """The loader's batches that make one step: ``P``, or 1 with ``split_batches``."""
        return 1 if self.split_batches else self._backend.num_processes

    @property
    def total_dataset_length(self) -> int:
        return len(self.inner.dataset)

    def _inner_length(self) -> Optional[int]:
        try:
            return len(self.inner)
        except TypeError:  # a stream: its end is seen when it is reached
            return None

    def __len__(self) -> int:
        m, p = len(self.inner), self._per_step
        return m // p if self.drop_last else math.ceil(m / p)

    def batch_layout(self) -> Optional[BatchLayout]:
        """See `unified.data.PreparedDataLoader.batch_layout`: the rows that fill up the last step
        are repeats."""
        return self._layout

    def connect(self, exchange: Any) -> None:
        """Called by `Accelerator.prepare` on every process: the collectives of the steps (and of a
        sampler's agreed seeds)."""
        self._exchange = exchange
        if isinstance(self.inner, _DrawnEpochs):
            self.inner.connect(exchange)

    def set_epoch(self, epoch: int) -> None:
        self._next_epoch(int(epoch))
        self.inner.set_epoch(int(epoch))

    def _next_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self._pad, self._ahead, self._ended = epoch, 0, None, None, False

    def skipped_view(self, num_batches: int) -> Any:
        """What `unified.data.skip_first_batches` returns for this loader."""
        return _SkippedDispatch(self, num_batches)

    # -- collectives -----------------------------------------------------------------------------
    @property
    def _main(self) -> bool:
        return self._backend.process_index == 0

    def _from_main(self, decide: Callable[[], Dict[str, Any]], what: str) -> Dict[str, Any]:
        """``decide()`` on process 0, its JSON answer on every process; an exception there reaches
        every process (the others raise `RuntimeError` naming it)."""
        message: Dict[str, Any] = {}
        failure: Optional[BaseException] = None
        if self._main:
            try:
                message = decide()
            except Exception as err:  # told to every process, then raised here
                failure, message = err, {"error": f"{type(err).__name__}: {err}"}
        if self._backend.num_processes > 1:
            if self._exchange is None:
                raise RuntimeError("a loader prepared with dispatch_batches=True needs the Accelerator's "
                                   "collectives: prepare it with accelerator.prepare()." + see("dispatch-main-failed"))
            message = self._exchange.broadcast_json(message if self._main else None, operation=what)
        if failure is not None:
            raise failure
        if "error" in message:
            raise RuntimeError(f"the main process, which reads the dispatched data loader, failed "
                               f"({message['error']}); see its log." + see("dispatch-main-failed"))
        return message

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._run()

    def _open(self) -> Iterator[Any]:
        """Process 0: the loader's batches from its current position (a map-style one never rolls
        over into the next epoch here: `_run` starts each epoch)."""
        if _map_style(self.inner):
            return self.inner._run(roll_over=False)
        return iter(self.inner)

    def _run(self, skip_to: int = 0) -> Iterator[Any]:
        known = self._inner_length()
        if known is not None and self.position >= len(self):  # restored (or left) at the very end of an epoch
            self._next_epoch(self.epoch + 1)
        if self.position == 0 and self._ahead is None:
            self.inner.set_epoch(self.epoch)
        reader = _Reader(self)
        try:
            with _in_use(self):
                if skip_to > self.position:
                    self.position = int(self._from_main(lambda: {"position": reader.forward(skip_to)},
                                                        "dispatch_batches (skip)")["position"])
                while True:
                    step = self._from_main(reader.step, "dispatch_batches")
                    if step.get("end"):
                        break
                    batch = self._receive(step, reader.arrays, reader.objects)
                    self.position += 1
                    if self.on_batch is not None:
                        self.on_batch(bool(step["last"]))
                    yield batch
            self._next_epoch(self.epoch + 1)
        finally:
            reader.close()

    def _receive(self, step: Dict[str, Any], host: List[np.ndarray], objects: List[Any]) -> Any:
        """This process's rows of the step process 0 described (``host``, ``objects``: its arrays
        and other leaves, there; other leaves exist only when there is one process)."""
        backend, p, rank = self._backend, self._backend.num_processes, self._backend.process_index
        if self._main:
            arrays = [backend.from_numpy(np.ascontiguousarray(a)) for a in host]
        else:
            arrays = [backend.from_numpy(np.empty(shape, numpy_dtype(dtype))) for dtype, shape in step["arrays"]]
        if p > 1:
            arrays = self._exchange.broadcast(arrays, src=0)
        size, total, observed = int(step["size"]), int(step["rows"]), int(step["observed"])
        ranges = [(min(total, r * size), min(total, (r + 1) * size)) for r in range(p)]
        rows = tuple(b - a for a, b in ranges)
        kept = tuple(max(0, min(b, observed) - a) for a, b in ranges)
        self._layout = BatchLayout(rows, kept)
        start, stop = ranges[rank]
        if self.slice_fn is not None:
            return self.slice_fn(_decode(step["tree"], arrays, objects), slice(start, stop), process_index=rank,
                                 num_processes=p)
        mine = [a[start:stop] for a in arrays]
        return _decode(step["tree"], mine, objects)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        p = self._backend.num_processes
        inner = self._ahead[1] if self._ahead is not None else self.inner.state_dict()
        ended = self._ended and self._ahead is None  # (else the state before the batches read ahead)
        pad = None
        if self._pad is not None:
            pad = {"structure": json.dumps(self._pad[0]), "arrays": [np.array(a) for a in self._pad[1]]}
        return {"dispatch_batches": True, "epoch": self.epoch, "position": self.position, "num_processes": p,
                "batches_per_step": self._per_step, "batches_seen": self.position * self._per_step, "loader": inner,
                "first_rows": pad, "ended": ended}

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        """See `unified.data.PreparedDataLoader.check_state_dict`."""
        self._resumed_position(state)
        self.inner.check_state_dict(state["loader"])

    def _resumed_position(self, state: Dict[str, Any]) -> Tuple[int, int]:
        """``(epoch, step)``: the steps take ``P`` of the loader's batches each, so ``batches_seen``
        follows the rule of `resume_position` in units of batches."""
        if not state.get("dispatch_batches"):
            raise ValueError("the checkpoint's data loader was not prepared with dispatch_batches=True; prepare the "
                             "same kind of loader as in the run that saved it." + see("dispatch-resume"))
        p, saved = self._backend.num_processes, int(state["num_processes"])
        saved_step = int(state.get("batches_per_step", saved))
        known = self._inner_length()

        def steps(per_step: int) -> Any:
            if known is None:
                return math.inf
            return known // per_step if self.drop_last else math.ceil(known / per_step)

        per_step = self._per_step
        epoch, position = resume_position(int(state["epoch"]), int(state["batches_seen"]), saved_step, per_step, steps,
                                          f"{p} processes (each step takes {per_step} of the loader's batches)")
        pad = state.get("first_rows")
        stream = not _map_style(self.inner)  # (a map-style loader reads them again)
        if stream and position > 0 and pad is not None and p > saved and len(pad["arrays"][0]) < p:
            raise ValueError(f"cannot resume in the middle of epoch {epoch} with {p} processes: the checkpoint holds "
                             f"the epoch's first {len(pad['arrays'][0])} rows, which fill up its last step for at most "
                             f"{saved} processes. Resume with at most {saved} processes, or save at an epoch boundary."
                             + see("dispatch-resume"))
        return epoch, position

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        epoch, position = self._resumed_position(state)
        self.inner.load_state_dict(state["loader"])
        self.epoch, self.position, self._ahead = epoch, position, None
        self._ended = bool(state.get("ended")) and position > 0
        pad = state.get("first_rows") if position > 0 else None
        self._pad = None if pad is None else (json.loads(pad["structure"]), [np.array(a) for a in pad["arrays"]])


class _Reader:
    """Process 0's side of one iteration of a `DispatchedLoader`: reads the steps (host only)."""

    def __init__(self, loader: DispatchedLoader) -> None:
        self.loader = loader
        self.batches: Optional[Iterator[Any]] = None
        self.arrays: List[np.ndarray] = []
        self.objects: List[Any] = []

    def close(self) -> None:
        if self.batches is not None and hasattr(self.batches, "close"):
            self.batches.close()  # the loader's iteration ends (its position stays where it stands)
        self.batches = None

    def _next(self) -> Any:
        """The loader's next batch, cut to its rows that are not repeats; StopIteration at the end."""
        loader = self.loader
        if loader._ahead is not None:
            ahead, state = loader._ahead
            batch = ahead.pop(0)
            loader._ahead = (ahead, state) if ahead else None
            return batch
        if loader._ended:  # a stream read again would start over
            raise StopIteration
        if self.batches is None:
            self.batches = loader._open()
        try:
            batch = next(self.batches)
        except StopIteration:
            loader._ended = True
            raise
        own = _own_rows(batch, loader)
        if own is not batch:  # the loader's own short batch: its last
            loader._ended = True
        return own

    def first_rows_again(self) -> Optional[Tuple[Any, List[np.ndarray]]]:
        """The epoch's first ``P`` rows read again from a map-style loader (its position kept);
        None for a stream. Needed when a checkpoint of fewer processes holds fewer of them."""
        loader = self.loader
        inner, p = loader.inner, loader._backend.num_processes
        if not _map_style(inner):
            return None
        position, inner.position = inner.position, 0
        batches = inner._run(roll_over=False)
        try:
            group = [_own_rows(batch, loader) for _, batch in zip(range(p), batches)]
        finally:
            batches.close()
            inner.position = position
        return _first_rows(_concatenated(group, loader._backend), p)

    def _read_ahead(self, count: int) -> bool:
        """Process 0, a stream: read up to ``count`` batches ahead (kept for the next step, with
        the loader's state before them for a checkpoint taken meanwhile), as Accelerate reads the
        next step ahead to know whether this one is the last; True when it is."""
        loader = self.loader
        state = loader.inner.state_dict()
        ahead = []
        for _ in range(count):
            try:
                ahead.append(self._next())
            except StopIteration:
                break
        loader._ahead = (ahead, state) if ahead else None
        return len(ahead) < count

    def _group(self) -> List[Any]:
        group: List[Any] = []
        for _ in range(self.loader._per_step):
            try:
                group.append(self._next())
            except StopIteration:
                break
        return group

    def forward(self, target: int) -> int:
        """Take the steps up to ``target`` without sending them; returns the position reached. A
        map-style loader moves by index arithmetic (only the epoch's first step is read, for its
        first rows)."""
        loader = self.loader
        p, per_step = loader._backend.num_processes, loader._per_step
        while loader.position < target:
            have_rows = loader.position > 0 or loader.drop_last or loader._pad is not None
            if have_rows and _map_style(loader.inner) and loader._ahead is None:
                self.close()
                length = len(loader.inner)
                loader.inner.position = min(length, target * per_step)
                loader.position = min(target, len(loader))
                break
            group = self._group()
            if not group or (loader.drop_last and len(group) < per_step):
                break
            if loader.position == 0 and not loader.drop_last:
                loader._pad = _first_rows(_concatenated(group, loader._backend), p)
            loader.position += 1
            if len(group) < per_step:
                break
        return loader.position

    def step(self) -> Dict[str, Any]:
        """The next step: read, concatenated, filled up at the end; its description for every
        process (its arrays in ``self.arrays``)."""
        loader = self.loader
        backend, p, per_step = loader._backend, loader._backend.num_processes, loader._per_step
        group = self._group()
        if not group or (loader.drop_last and len(group) < per_step):
            return {"end": True}
        structure, arrays, objects = _concatenated(group, backend)
        if objects and p > 1:
            raise TypeError(f"a dispatched batch must be a dict, list or tuple of arrays (as in Accelerate, which "
                            f"concatenates and broadcasts tensors only); this one holds a "
                            f"{type(objects[0]).__name__}." + see("dispatch-batch-types"))
        if not arrays or _first_leaf_is_object(structure):
            raise TypeError("cannot find the batch size of a dispatched batch: its first value is not an array."
                            + see("dispatch-batch-types"))
        observed = int(arrays[0].shape[0])
        if loader.position == 0 and not loader.drop_last and loader._pad is None:
            loader._pad = _first_rows((structure, arrays, objects), p)
        last = len(group) < per_step
        if not last:  # Accelerate reads ahead: the step is the last when the next would be empty (or dropped)
            need = per_step if loader.drop_last else 1
            known = loader._inner_length()
            last = known - loader.inner.position < need if known is not None else self._read_ahead(need)
        padded = last and not loader.drop_last and observed % p != 0
        size = observed // p
        if padded:
            if loader._pad is None or len(loader._pad[1][0]) < p:  # a checkpoint of fewer processes held fewer
                loader._pad = self.first_rows_again() or loader._pad
            if loader._pad is None:
                raise RuntimeError("the dispatched loader lost the epoch's first rows, which fill up its last step; "
                                   "call set_epoch() and iterate the epoch again." + see("dispatch-main-failed"))
            pad_structure, pad_arrays = loader._pad
            if pad_structure != structure:
                raise RuntimeError(_DIFFERENT_SIZES.format(detail="the epoch's first step is nested otherwise")
                                   + see("dispatch-batch-types"))
            arrays = [_concatenate([a, b]) for a, b in zip(arrays, pad_arrays)]
            size += 1
        self.arrays, self.objects = arrays, objects
        return {"end": False, "last": last, "observed": observed, "size": size, "rows": int(arrays[0].shape[0]),
                "tree": structure, "arrays": [[safetensors_dtype(a.dtype), list(a.shape)] for a in arrays]}


def _own_rows(batch: Any, loader: DispatchedLoader) -> Any:
    """``batch``, just yielded by the loader that process 0 reads, without the rows that fill up
    its end (the loader's own short last batch, as torch yields it)."""
    layout = loader.inner.batch_layout()
    if layout is not None and layout.kept[0] < layout.rows[0]:
        batch = _decode(*_split(batch, loader._backend, layout.kept[0]))
    return batch


def _first_leaf_is_object(structure: Any) -> bool:
    """Whether the first leaf of an encoded batch is not an array (Accelerate finds the batch size there)."""
    node = structure
    while True:
        if isinstance(node, dict) and "__array__" in node:
            return False
        if isinstance(node, dict):
            children = ([node["value"]] if "__class__" in node else node["__tuple__"] if "__tuple__" in node
                        else [v for _, v in node["__dict__"]] if "__dict__" in node
                        else [] if "__object__" in node else list(node.values()))
        else:
            children = node if isinstance(node, list) else []
        if not children:
            return True
        node = children[0]


def _host(value: Any, backend: Any) -> Any:
    """An array leaf as a NumPy array on the host (a view where the backend allows)."""
    if isinstance(value, np.ndarray) or not backend.is_array(value):
        return value
    dtype, shape, raw = backend.export_array(value)
    return np.asarray(raw).view(numpy_dtype(dtype)).reshape(shape)


def _is_array_of(backend: Any) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, np.ndarray) or backend.is_array(value)


def _split(batch: Any, backend: Any, keep: int) -> Tuple[Any, List[Any], List[Any]]:
    structure, arrays, objects = _encode(batch, _is_array_of(backend))
    return structure, [a[:keep] for a in arrays], objects


def _concatenate(parts: List[np.ndarray]) -> np.ndarray:
    if any(p.ndim == 0 for p in parts):
        raise RuntimeError(_DIFFERENT_SIZES.format(detail="a 0-dimensional array has no rows to concatenate")
                           + see("dispatch-batch-types"))
    if len({p.shape[1:] for p in parts}) > 1 or len({p.dtype for p in parts}) > 1:
        shown = ", ".join(f"{p.dtype}{list(p.shape)}" for p in parts)
        raise RuntimeError(_DIFFERENT_SIZES.format(detail=shown)
                           + see("dispatch-batch-types"))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _concatenated(group: List[Any], backend: Any) -> Tuple[Any, List[np.ndarray], List[Any]]:
    """The batches of one step as one: ``(structure, host arrays, other leaves of the first)``."""
    encoded = [_encode(batch, _is_array_of(backend)) for batch in group]
    structure = encoded[0][0]
    if any(e[0] != structure for e in encoded[1:]):
        raise RuntimeError(_DIFFERENT_SIZES.format(detail="the batches are nested otherwise")
                           + see("dispatch-batch-types"))
    arrays = [_concatenate([_host(e[1][i], backend) for e in encoded]) for i in range(len(encoded[0][1]))]
    return structure, arrays, encoded[0][2]


def _first_rows(concatenated: Tuple[Any, List[np.ndarray], List[Any]], rows: int) -> Tuple[Any, List[np.ndarray]]:
    structure, arrays, _ = concatenated
    return structure, [np.array(a[:rows]) for a in arrays]


class _SkippedDispatch:
    """`skip_first_batches` of a `DispatchedLoader`: the rest of the current epoch from an
    absolute step (never skips twice; after `load_state` the position is already there)."""

    def __init__(self, loader: DispatchedLoader, num_batches: int) -> None:
        self.loader, self.num_batches = loader, num_batches

    def __iter__(self) -> Iterator[Any]:
        return self.loader._run(skip_to=self.num_batches)

    def __len__(self) -> int:
        return max(0, len(self.loader) - max(self.loader.position, self.num_batches))
