"""Evaluation over processes, written once for every backend: `gather_for_metrics` and
`pad_across_processes`.

Which gathered rows are repeats. A prepared loader evens out the end of an epoch: its last global
batch is filled up with samples it already gave (unified/data/), so that every process gets a
batch. While a prepared loader is iterated it tells the Accelerator's `ActiveLoaders` (as
Accelerate's ``GradientState`` tracks the loader being iterated), and its `BatchLayout` says, for
the batch in use, how many rows each process holds and how many of them, from the first, are new.
`gather` concatenates the processes' rows in process order, so process ``r``'s rows of the global
batch are rows ``r*B .. (r+1)*B`` of the result, and the repeats are the trailing rows of each
process's part; `gather_for_metrics` keeps the new ones. For the built-in orders (and iterable
data) the repeats are the trailing positions of the global batch, so what is kept is a prefix;
for a batch sampler, whole batches of the last processes are repeats.

Unlike Accelerate, which truncates every gathered value of the last batch to the remainder, a
value whose rows do not match the batch's (a scalar loss, a flattened token axis) is refused when
the batch in use has repeats, rather than cut at a row that means nothing.
"""
from __future__ import annotations

import json
import numbers
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..backend import ShardedArrays
from ..checkpoint.safetensors_io import export_numpy, numpy_dtype
from ..data import BatchLayout
from ..errors import see
from ..runtime.collectives import Collectives
from ..runtime.tree import flatten

__all__ = ["ActiveLoaders", "Metrics"]


class ActiveLoaders:
    """The prepared loaders being iterated right now, innermost last (an evaluation loop inside a
    training loop): `gather_for_metrics` looks at the innermost one's batch in use."""

    def __init__(self) -> None:
        self._stack: List[Any] = []
        # told the loader that ended an iteration (the gradient state goes back to the outer loader's end)
        self.on_left: Optional[Callable[[Any], None]] = None

    def entered(self, loader: Any) -> None:
        self._stack.append(loader)

    def left(self, loader: Any) -> None:
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i] is loader:
                del self._stack[i]
                break
        if self.on_left is not None:
            self.on_left(loader)

    def innermost(self) -> Optional[Any]:
        """The innermost prepared loader being iterated; None when no loader runs."""
        return self._stack[-1] if self._stack else None

    def layout(self) -> Optional[BatchLayout]:
        """The innermost running loader's layout of its batch in use; ``None`` when no loader runs."""
        return self._stack[-1].batch_layout() if self._stack else None


class Metrics:
    """`gather_for_metrics` and `pad_across_processes` for one Accelerator."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.backend = collectives.backend
        self.active = ActiveLoaders()
        # processes that share one batch (a ParallelismConfig's tp_size: consecutive processes);
        # gather_for_metrics keeps the first of each group's rows
        self.same_batch = 1

    def watch(self, loader: Any) -> None:
        """Have a prepared ``loader`` report its iterations (called by `Accelerator.prepare`)."""
        if hasattr(loader, "batch_layout"):
            loader.activity = self.active

    # -- gather_for_metrics ----------------------------------------------------------------------
    def _is_array(self, value: Any) -> bool:
        return self.backend.is_array(value) or isinstance(value, np.ndarray)

    def gather_for_metrics(self, tree: Any, use_gather_object: bool = False) -> Any:
        layout = self.active.layout()
        leaves, _ = flatten(tree, lambda v: not isinstance(v, (dict, list, tuple)))
        numeric = all(self._is_array(v) or isinstance(v, (np.generic, numbers.Number)) for v in leaves)
        # As in Accelerate, a list of plain values (strings, numbers) is a list of per-sample objects.
        per_sample_list = isinstance(tree, (list, tuple)) and not any(self._is_array(v) for v in leaves)
        if use_gather_object or not leaves or not numeric or per_sample_list:
            return self._gather_objects(tree, layout)
        if layout is None or (layout.even and not layout.repeats):
            if self.same_batch == 1:
                return self.collectives.gather(tree)
            arrays, rebuild = self.collectives.arrays_of(tree)
            return rebuild(self._gather(arrays))
        arrays, rebuild = self.collectives.arrays_of(tree)
        rows = [_rows(a) for a in arrays]
        if layout.even:
            chunk = layout.rows[0]
            gathered = self._gather(arrays)
        else:  # a batch sampler's batches differ in size: pad to the largest, gather, keep the rows
            sizes = self.collectives.all_gather_json(rows, "gather_for_metrics (rows)")[::self.same_batch]
            for i in range(len(arrays)):
                if [s[i] for s in sizes] != list(layout.rows):
                    raise _rows_error(i, [s[i] for s in sizes], layout)
            chunk = max(layout.rows)
            gathered = self._gather([self.backend.pad_array(a, 0, chunk, 0, False) if n < chunk else a
                                     for a, n in zip(arrays, rows)])
        processes = len(layout.rows)
        keep = _kept(layout, chunk)
        out = []
        for i, value in enumerate(gathered):
            if value.shape[0] != processes * chunk:
                raise _rows_error(i, [value.shape[0] // processes] * processes, layout)
            out.append(value[keep if isinstance(keep, slice) else self.backend.from_numpy(keep, like=value)])
        return rebuild(out)

    def _gather_objects(self, value: Any, layout: Optional[BatchLayout]) -> List[Any]:
        """Accelerate's ``use_gather_object``: each process passes a list of per-sample values (or
        an array, taken row by row); the result is one list, in process order, without repeats."""
        if isinstance(self.backend, ShardedArrays) and self.backend.is_sharded(value):
            # a global array (JAX) already spans every process's rows: its gathered rows, one by one
            return list(self.gather_for_metrics(value))
        if self._is_array(value):
            host = np.asarray(self.backend.to_numpy(value) if self.backend.is_array(value) else value)
            items: List[Any] = list(host.reshape(1) if host.ndim == 0 else host)
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise TypeError(
                "gather_for_metrics of values other than arrays expects a list or tuple of per-sample values "
                f"(strings, numbers, arrays); received {type(value).__qualname__}." + see("gather-for-metrics-objects")
            )
        parts = [_unpack(data, self.backend) for data in
                 self.collectives.all_gather_bytes(_pack(items, self.backend), "gather_for_metrics")]
        parts = parts[::self.same_batch]  # one part per data-parallel rank
        if layout is not None and layout.repeats:
            lengths = [len(p) for p in parts]
            if lengths != list(layout.rows):
                raise _rows_error(0, lengths, layout)
            parts = [p[:k] for p, k in zip(parts, layout.kept)]
        return [item for part in parts for item in part]

    def _gather(self, arrays: List[Any]) -> List[Any]:
        """`Collectives.gather` of this process's rows (of a global array: the rows this
        process holds), keeping one process's rows of each group of ``same_batch`` (the
        processes of a tensor-parallel group hold the same batch)."""
        gathered = self.collectives.gather(arrays)
        if self.same_batch == 1:
            return gathered
        processes = self.backend.num_processes
        out = []
        for value in gathered:
            rows = value.shape[0] // processes
            keep = np.concatenate([np.arange(p * rows, (p + 1) * rows, dtype=np.int64)
                                   for p in range(0, processes, self.same_batch)])
            out.append(value[self.backend.from_numpy(keep, like=value) if self.backend.is_array(value) else keep])
        return out

    # -- pad_across_processes --------------------------------------------------------------------
    def pad_across_processes(self, tree: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        arrays, rebuild = self.collectives.arrays_of(tree)
        if self.backend.num_processes == 1:
            return rebuild(arrays)
        mine = [a.shape[dim] if -a.ndim <= dim < a.ndim else -1 for a in arrays]
        sizes = self.collectives.all_gather_json(mine, "pad_across_processes")
        if any(len(s) != len(mine) for s in sizes):
            raise ValueError(
                f"pad_across_processes: the processes passed {[len(s) for s in sizes]} arrays; every process must "
                "pass the same structure." + see("pad-across-processes-structure")
            )
        out = []
        for i, array in enumerate(arrays):
            target = max(s[i] for s in sizes)
            if mine[i] < 0 or target == mine[i]:  # a dimension the array does not have: left as it is
                out.append(array)
            else:
                out.append(self.backend.pad_array(array, dim % array.ndim, target, pad_index, pad_first))
        return rebuild(out)


def _rows(array: Any) -> int:
    return int(array.shape[0]) if array.ndim else 1


def _kept(layout: BatchLayout, chunk: int) -> Any:
    """What to take from the gathered rows (``chunk`` per process): a slice when it is a prefix."""
    index = np.concatenate([np.arange(r * chunk, r * chunk + k, dtype=np.int64) for r, k in enumerate(layout.kept)])
    if np.array_equal(index, np.arange(len(index))):
        return slice(0, len(index))
    return index


def _rows_error(leaf: int, per_process: Sequence[int], layout: BatchLayout) -> ValueError:
    return ValueError(
        f"gather_for_metrics: value {leaf} of the input has {list(per_process)} rows on the processes, but the batch "
        f"in use has {list(layout.rows)}, {layout.repeats} of them repeated samples that evened out the epoch's end. "
        "Only per-sample values (first axis: the batch's samples) can have the repeats removed; gather other values "
        "(a mean loss, a flattened token axis) with gather(), or give them the batch's first axis."
        + see("gather-for-metrics-rows")
    )


# -- per-sample values as bytes (JSON values and arrays; no pickle) ---------------------------------
def _pack(items: List[Any], backend: Any) -> bytes:
    arrays: List[Tuple[str, Tuple[int, ...], bytes]] = []

    def encode(item: Any) -> Any:
        if backend.is_array(item) or isinstance(item, np.ndarray):
            dtype, shape, raw = export_numpy(np.asarray(backend.to_numpy(item) if backend.is_array(item) else item))
            arrays.append((dtype, tuple(shape), raw.tobytes()))
            return {"array": len(arrays) - 1}
        return {"value": item.item() if isinstance(item, np.generic) else item}

    try:
        header = json.dumps({"items": [encode(i) for i in items],
                             "arrays": [[d, list(s), len(r)] for d, s, r in arrays]}).encode()
    except TypeError as err:
        raise TypeError(f"gather_for_metrics: a per-sample value cannot travel without pickle ({err}); use strings, "
                        "numbers, lists, dicts or arrays." + see("gather-for-metrics-objects")) from err
    return len(header).to_bytes(8, "little") + header + b"".join(r for _, _, r in arrays)


def _unpack(data: bytes, backend: Any) -> List[Any]:
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    offset, arrays = 8 + length, []
    for dtype, shape, size in header["arrays"]:
        host = np.frombuffer(data[offset:offset + size], dtype=numpy_dtype(dtype)).reshape(shape)
        arrays.append(backend.from_numpy(host.copy()))
        offset += size
    return [arrays[i["array"]] if "array" in i else i["value"] for i in header["items"]]
