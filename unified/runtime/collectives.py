"""Collectives written once on top of a backend's primitives.

`Collectives` owns the per-Accelerator call counter that makes every collective key unique
and identical across processes, the default timeout, and the tree handling of
gather / reduce / broadcast. It also implements the ordered-section protocol behind
`main_process_first` and the trigger.
"""
from __future__ import annotations

import contextlib
import json
import numbers
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..backend import ArrayCollectives, Backend
from ..checkpoint.safetensors_io import export_numpy, numpy_dtype
from ..errors import DistributedError, failure_reason, see
from .tree import flatten

__all__ = ["Collectives"]


class Collectives:
    """Timed, uniquely keyed collectives for one Accelerator."""

    def __init__(self, backend: Backend, timeout: float) -> None:
        self.backend = backend
        self.timeout = float(timeout)
        if not self.timeout > 0:
            raise ValueError(f"Invalid timeout: expected a positive number of seconds; received {timeout!r}."
                             + see("invalid-timeout"))
        self._calls = 0
        self.arrays: ArrayCollectives = backend if isinstance(backend, ArrayCollectives) else ArraysAsBytes(backend)
        # Told about every DistributedError a backend primitive raised (the watchdog's report).
        self.on_broken: Callable[[BaseException], None] = lambda error: None
        # Timed backend primitives running now (on any thread): such a call raises on its own.
        self.in_call = 0

    @contextlib.contextmanager
    def watched(self) -> Iterator[None]:
        """Run a backend primitive; a `DistributedError` from it means the group broke."""
        self.in_call += 1
        try:
            yield
        except DistributedError as error:
            self.on_broken(error)
            raise
        finally:
            self.in_call -= 1

    def _key(self, operation: str) -> str:
        self._calls += 1
        return f"{operation} #{self._calls}"

    def _timeout(self, timeout: Optional[float]) -> float:
        value = self.timeout if timeout is None else float(timeout)
        if not value > 0:
            raise ValueError(f"Invalid timeout: expected a positive number of seconds; received {value!r}."
                             + see("invalid-timeout"))
        return value

    @property
    def single(self) -> bool:
        return self.backend.num_processes == 1

    # -- control plane ------------------------------------------------------------------------
    def keyed(self, operation: str, function: Callable[[str, float], Any]) -> Any:
        """``function(key, timeout)``: a backend collective run with this call's unique key and
        the default timeout, watched (a `DistributedError` from it means the group broke)."""
        with self.watched():
            return function(self._key(operation), self.timeout)

    def barrier(self, operation: str = "wait_for_everyone", timeout: Optional[float] = None) -> None:
        if self.single:
            return
        seconds = self._timeout(timeout)
        with self.watched():
            self.backend.barrier(self._key(operation), seconds)

    def any_flag(self, flag: bool, operation: str = "check_trigger", timeout: Optional[float] = None) -> bool:
        if self.single:
            return bool(flag)
        seconds = self._timeout(timeout)
        with self.watched():
            return self.backend.any_flag(bool(flag), self._key(operation), seconds)

    def all_gather_json(self, value: Any, operation: str = "gather_object",
                        timeout: Optional[float] = None) -> List[Any]:
        """Every process's JSON-serialisable ``value``, in process order (no pickle)."""
        data = json.dumps(value).encode()
        if self.single:  # the same JSON round trip as with several processes
            return [json.loads(data)]
        with self.watched():
            parts = self.backend.all_gather_bytes(data, self._key(operation), self._timeout(timeout))
        return [json.loads(p.decode()) for p in parts]

    def all_gather_bytes(self, data: bytes, operation: str, timeout: Optional[float] = None) -> List[bytes]:
        """Every process's ``data``, in process order."""
        if self.single:
            return [data]
        with self.watched():
            return self.backend.all_gather_bytes(data, self._key(operation), self._timeout(timeout))

    def share_failure(self, error: Optional[BaseException], operation: str) -> List[Tuple[int, str]]:
        """Tell every process whether this one failed, in one exchange: re-raises this process's
        own ``error``; otherwise returns ``(process index, reason)`` for each process that failed."""
        reasons = self.all_gather_json(None if error is None else failure_reason(error), operation)
        if error is not None:
            raise error
        return [(rank, text) for rank, text in enumerate(reasons) if text]

    def broadcast_json(self, value: Any, src: int = 0, operation: str = "broadcast_object",
                       timeout: Optional[float] = None) -> Any:
        """``value`` from process ``src`` on every process (JSON, no pickle)."""
        if self.single:
            return value
        data = json.dumps(value).encode() if self.backend.process_index == src else None
        with self.watched():
            return json.loads(self.backend.broadcast_bytes(data, src, self._key(operation), self._timeout(timeout)))

    @contextlib.contextmanager
    def ordered(self, go_first: bool, operation: str) -> Iterator[None]:
        """Run the body on ``go_first`` processes, then on the rest; everyone leaves together.

        Two syncs carry a failure flag: "release" (after the first group's bodies, before the
        others' bodies) and "exit" (after the others' bodies). An exception in any body thus
        reaches every other process as a `DistributedError` instead of leaving it waiting.
        """
        if self.single:
            yield
            return
        if not go_first:
            if self.any_flag(False, f"{operation} (release)"):
                raise DistributedError(
                    f"{operation}: a process that ran the body first raised an exception; see its log above."
                    + see("main-first-first-raised")
                )
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            if go_first:
                if self.any_flag(failed, f"{operation} (release)") and not failed:
                    raise DistributedError(f"{operation}: another process raised an exception in its body."
                                           + see("main-first-other-raised"))
                if not failed and self.any_flag(False, f"{operation} (exit)"):
                    raise DistributedError(
                        f"{operation}: a process that ran the body after the main process raised an exception."
                        + see("main-first-later-raised")
                    )
            elif self.any_flag(failed, f"{operation} (exit)") and not failed:
                raise DistributedError(f"{operation}: another process raised an exception in its body."
                                       + see("main-first-other-raised"))

    # -- data plane ---------------------------------------------------------------------------
    def _leaves(self, tree: Any):
        backend = self.backend

        def is_leaf(value: Any) -> bool:
            return backend.is_array(value) or isinstance(value, (np.ndarray, np.generic, numbers.Number))

        leaves, rebuild = flatten(tree, is_leaf)
        arrays = [v if backend.is_array(v) else backend.from_numpy(np.asarray(v)) for v in leaves]
        return arrays, rebuild

    def arrays_of(self, tree: Any) -> Tuple[List[Any], Callable[[List[Any]], Any]]:
        """The leaves of ``tree`` as the backend's arrays, and the function that rebuilds the tree."""
        return self._leaves(tree)

    def gather(self, tree: Any, timeout: Optional[float] = None) -> Any:
        arrays, rebuild = self._leaves(tree)
        if self.single:
            return rebuild([a if a.ndim else a.reshape(1) for a in arrays])
        with self.watched():
            return rebuild(self.arrays.all_gather_arrays(arrays, self._key("gather"), self._timeout(timeout)))

    def reduce(self, tree: Any, reduction: str = "sum", timeout: Optional[float] = None) -> Any:
        if reduction not in ("sum", "mean"):
            raise ValueError(f"Invalid reduction: expected 'sum' or 'mean'; received {reduction!r}."
                             + see("invalid-reduction"))
        arrays, rebuild = self._leaves(tree)
        if not self.single:
            with self.watched():
                arrays = self.arrays.all_reduce_arrays(arrays, "sum", self._key("reduce"), self._timeout(timeout))
        if reduction == "mean":
            arrays = [a / self.backend.num_processes for a in arrays]
        return rebuild(list(arrays))

    def broadcast(self, tree: Any, src: int = 0, timeout: Optional[float] = None) -> Any:
        if not 0 <= src < self.backend.num_processes:
            raise ValueError(
                f"Invalid from_process: expected 0..{self.backend.num_processes - 1}; received {src}."
                + see("invalid-from-process")
            )
        arrays, rebuild = self._leaves(tree)
        if self.single:
            return rebuild(arrays)
        with self.watched():
            return rebuild(self.arrays.broadcast_arrays(arrays, src, self._key("broadcast"), self._timeout(timeout)))


class ArraysAsBytes(ArrayCollectives):
    """Array collectives for a backend without native ones: arrays travel as bytes (a small JSON
    header with dtype and shape, then the data) through its timed control plane."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def _encode(self, array: Any) -> bytes:
        host = np.asarray(self.backend.to_numpy(array))
        dtype, shape, raw = export_numpy(host.reshape(1) if host.ndim == 0 else host)
        header = json.dumps({"dtype": dtype, "shape": list(shape)}).encode()
        return len(header).to_bytes(4, "little") + header + raw.tobytes()

    @staticmethod
    def _decode(data: bytes) -> np.ndarray:
        length = int.from_bytes(data[:4], "little")
        header = json.loads(data[4:4 + length])
        return np.frombuffer(data[4 + length:], dtype=numpy_dtype(header["dtype"])).reshape(header["shape"])

    def _gathered(self, arrays: Sequence[Any], key: str, timeout: float) -> List[List[np.ndarray]]:
        """Per array, every process's value in process order."""
        out = []
        for i, array in enumerate(arrays):
            parts = self.backend.all_gather_bytes(self._encode(array), f"{key}[{i}]", timeout)
            out.append([self._decode(part) for part in parts])
        return out

    def all_gather_arrays(self, arrays: Sequence[Any], key: str, timeout: float) -> List[Any]:
        return [self.backend.from_numpy(np.concatenate(parts)) for parts in self._gathered(arrays, key, timeout)]

    def all_reduce_arrays(self, arrays: Sequence[Any], op: str, key: str, timeout: float) -> List[Any]:
        return [self.backend.from_numpy(np.sum(parts, axis=0).reshape(np.shape(a)))
                for a, parts in zip(arrays, self._gathered(arrays, key, timeout))]

    def broadcast_arrays(self, arrays: Sequence[Any], src: int, key: str, timeout: float) -> List[Any]:
        out = []
        for i, array in enumerate(arrays):
            data = self.backend.broadcast_bytes(self._encode(array) if self.backend.process_index == src else None,
                                                src, f"{key}[{i}]", timeout)
            out.append(self.backend.from_numpy(self._decode(data).reshape(np.shape(array))))
        return out
