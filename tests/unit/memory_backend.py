"""An in-memory `unified.Backend` for fast unit tests: n ranks driven by n threads of one process.

Example:
    >>> group = MemoryGroup(2)
    >>> results = run_threads(2, lambda rank: Accelerator(backend=group.backends[rank]).gather(rank))

Every collective is a rendezvous on its ``key``: each rank deposits its value, waits on a
`threading.Barrier` with the given timeout and reads everyone's values. The backend also checks
the Accelerator's key counter: the i-th collective of every rank must carry the same key, the
same kind of operation (and the same ``src`` for broadcasts), and no rank may reuse a key.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set

import numpy as np

from unified.backend import ArrayCollectives, Backend
from unified.errors import BarrierTimeout

__all__ = ["MemoryGroup", "MemoryBackend", "run_threads", "run_accelerators", "unwrap", "RankTimeout"]


class RankTimeout(Exception):
    """Placed in `run_threads`' results for a rank whose thread did not finish by the deadline."""


class _Rendezvous:
    """Shared state of one keyed collective."""

    def __init__(self, kind: str, n: int, src: Optional[int]) -> None:
        self.kind = kind
        self.src = src
        self.values: List[Any] = [None] * n
        self.barrier = threading.Barrier(n)


class MemoryGroup:
    """``n`` `MemoryBackend` objects sharing one in-process state.

    Args:
        n: number of ranks.
        timeout_default: seconds `run_threads(group=...)` uses as its per-test deadline hint and
            the timeout an Accelerator built by `accelerator()` uses by default.
        local_num_processes: ranks per simulated machine (default: all on one machine);
            ``local_process_index = rank % local_num_processes``.
    """

    def __init__(self, n: int, timeout_default: float = 5.0, local_num_processes: Optional[int] = None) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1; received {n}")
        local = n if local_num_processes is None else local_num_processes
        if local < 1 or n % local:
            raise ValueError(f"local_num_processes must divide n={n}; received {local}")
        self.n = n
        self.timeout_default = float(timeout_default)
        self.local_num_processes = local
        self.lock = threading.Lock()
        self.rendezvous: Dict[str, _Rendezvous] = {}
        # key -> ranks that reached the collective with that key (names the missing on timeout)
        self.arrived: Dict[str, Set[int]] = {}
        # rank -> keys of that rank's collectives, in call order
        self.calls: List[List[str]] = [[] for _ in range(n)]
        self.key_errors: List[str] = []
        self.backends = [MemoryBackend(self, rank) for rank in range(n)]

    def accelerator(self, rank: int, **kwargs: Any):
        """An `Accelerator` on rank ``rank``'s backend with this group's default timeout."""
        from unified import Accelerator

        kwargs.setdefault("timeout", self.timeout_default)
        return Accelerator(backend=self.backends[rank], **kwargs)

    def abort(self) -> None:
        """Break every pending rendezvous so no thread stays blocked."""
        with self.lock:
            pending = list(self.rendezvous.values())
        for rv in pending:
            rv.barrier.abort()

    def collective_counts(self) -> List[int]:
        with self.lock:
            return [len(c) for c in self.calls]

    # -- the shared rendezvous -------------------------------------------------------------------
    def _check_key(self, rank: int, kind: str, key: str, src: Optional[int]) -> None:
        """The i-th collective of every rank must have the same key, kind and src."""
        with self.lock:
            mine = self.calls[rank]
            problem = None
            if key in mine:
                problem = f"rank {rank} reused key {key!r}"
            index = len(mine)
            mine.append(key)
            if problem is None:
                for other, theirs in enumerate(self.calls):
                    if other != rank and len(theirs) > index and theirs[index] != key:
                        problem = (f"collective #{index + 1}: rank {rank} used key {key!r} "
                                   f"but rank {other} used {theirs[index]!r}")
                        break
            rv = self.rendezvous.get(key)
            if problem is None and rv is not None and (rv.kind != kind or rv.src != src):
                problem = (f"key {key!r}: rank {rank} called {kind}(src={src}) but another rank "
                           f"called {rv.kind}(src={rv.src})")
            if problem is not None:
                self.key_errors.append(problem)
        if problem is not None:
            raise AssertionError(f"collective keys differ across ranks: {problem}")

    def exchange(self, rank: int, kind: str, key: str, timeout: float, value: Any,
                 src: Optional[int] = None) -> List[Any]:
        """Deposit ``value`` under ``key``, wait for every rank, return all values in rank order."""
        assert isinstance(key, str) and key, f"collective key must be a non-empty str; got {key!r}"
        assert timeout > 0, f"collective timeout must be positive; got {timeout!r}"
        self._check_key(rank, kind, key, src)
        with self.lock:
            rv = self.rendezvous.get(key)
            if rv is None:
                rv = self.rendezvous[key] = _Rendezvous(kind, self.n, src)
            rv.values[rank] = value
            self.arrived.setdefault(key, set()).add(rank)
        try:
            rv.barrier.wait(timeout)
        except threading.BrokenBarrierError:
            with self.lock:
                arrived = set(self.arrived.get(key, ()))
            missing = sorted(set(range(self.n)) - arrived)
            raise BarrierTimeout(
                key, timeout, missing or None, process_index=rank, num_processes=self.n,
                detail="memory backend",
            ) from None
        return list(rv.values)


class MemoryBackend(Backend, ArrayCollectives):
    """One rank of a `MemoryGroup`; arrays are NumPy arrays."""

    name = "memory"

    def __init__(self, group: MemoryGroup, rank: int) -> None:
        self.group = group
        self.process_index = rank
        self.num_processes = group.n
        self.local_num_processes = group.local_num_processes
        self.local_process_index = rank % group.local_num_processes
        self.started_with: Optional[float] = None
        self.shut_down = False
        self.rng = np.random.default_rng()

    @property
    def device(self) -> str:
        return "cpu"

    def start(self, timeout: float) -> None:
        self.started_with = timeout

    def shutdown(self) -> None:
        self.shut_down = True

    def _exchange(self, kind: str, key: str, timeout: float, value: Any, src: Optional[int] = None) -> List[Any]:
        return self.group.exchange(self.process_index, kind, key, timeout, value, src)

    # -- control plane ----------------------------------------------------------------------------
    def barrier(self, key: str, timeout: float) -> None:
        self._exchange("barrier", key, timeout, None)

    def any_flag(self, flag: bool, key: str, timeout: float) -> bool:
        assert isinstance(flag, bool), f"any_flag expects a bool; got {flag!r}"
        return any(self._exchange("any_flag", key, timeout, flag))

    def all_gather_bytes(self, data: bytes, key: str, timeout: float) -> List[bytes]:
        assert isinstance(data, bytes)
        return [bytes(d) for d in self._exchange("all_gather_bytes", key, timeout, data)]

    def broadcast_bytes(self, data: Optional[bytes], src: int, key: str, timeout: float) -> bytes:
        if self.process_index == src:
            assert isinstance(data, bytes), "the source of broadcast_bytes must pass bytes"
        return bytes(self._exchange("broadcast_bytes", key, timeout, data, src)[src])

    # -- data plane -------------------------------------------------------------------------------
    def is_array(self, value: Any) -> bool:
        return isinstance(value, np.ndarray)

    def _arrays(self, arrays: Sequence[Any]) -> List[np.ndarray]:
        for a in arrays:
            assert self.is_array(a), f"array collectives take backend arrays; got {type(a).__name__}"
        return [np.array(a, copy=True) for a in arrays]

    @staticmethod
    def _same_count(per_rank: List[List[np.ndarray]], what: str) -> None:
        counts = {len(p) for p in per_rank}
        if len(counts) != 1:
            raise ValueError(f"{what}: ranks passed different numbers of arrays: {[len(p) for p in per_rank]}")

    def all_gather_arrays(self, arrays: Sequence[Any], key: str, timeout: float) -> List[Any]:
        mine = [a.reshape(1) if a.ndim == 0 else a for a in self._arrays(arrays)]
        per_rank = self._exchange("all_gather_arrays", key, timeout, mine)
        self._same_count(per_rank, "all_gather_arrays")
        return [np.concatenate([p[i] for p in per_rank], axis=0) for i in range(len(mine))]

    def all_reduce_arrays(self, arrays: Sequence[Any], op: str, key: str, timeout: float) -> List[Any]:
        assert op == "sum", f"the Accelerator only asks backends for 'sum'; got {op!r}"
        mine = self._arrays(arrays)
        per_rank = self._exchange("all_reduce_arrays", key, timeout, mine)
        self._same_count(per_rank, "all_reduce_arrays")
        out = []
        for i in range(len(mine)):
            shapes = {p[i].shape for p in per_rank}
            if len(shapes) != 1:
                raise ValueError(f"all_reduce_arrays: array {i} has different shapes across ranks: {shapes}")
            total = per_rank[0][i].copy()
            for p in per_rank[1:]:
                total = total + p[i]
            out.append(total)
        return out

    def broadcast_arrays(self, arrays: Sequence[Any], src: int, key: str, timeout: float) -> List[Any]:
        mine = self._arrays(arrays)
        per_rank = self._exchange("broadcast_arrays", key, timeout, mine, src)
        self._same_count(per_rank, "broadcast_arrays")
        for i, a in enumerate(mine):
            if a.shape != per_rank[src][i].shape:
                raise ValueError(f"broadcast_arrays: array {i} shape {a.shape} differs from the source's "
                                 f"{per_rank[src][i].shape}")
        return [per_rank[src][i].copy() for i in range(len(mine))]

    def to_numpy(self, value: Any) -> Any:
        return np.array(value, copy=True)

    def from_numpy(self, value: Any, like: Any = None) -> Any:
        return np.array(value, copy=True)

    def export_array(self, value: Any):
        """``(safetensors dtype, shape, uint8 bytes)`` of a NumPy array (used by checkpoints)."""
        if not isinstance(value, np.ndarray) or value.dtype.name not in _SAFETENSORS_DTYPES:
            raise TypeError(f"memory backend cannot export {type(value).__name__} "
                            f"of dtype {getattr(value, 'dtype', None)}")
        array = np.ascontiguousarray(value)
        return _SAFETENSORS_DTYPES[array.dtype.name], tuple(array.shape), array.reshape(-1).view(np.uint8)

    # -- RNG ----------------------------------------------------------------------------------------
    def seed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def rng_state(self) -> Dict[str, Any]:
        state = self.rng.bit_generator.state
        words = []
        for big in (state["state"]["state"], state["state"]["inc"]):
            words += [big >> 64, big & (2**64 - 1)]
        words += [state["has_uint32"], state["uinteger"]]
        return {"memory_pcg64": np.asarray(words, dtype=np.uint64)}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        if "memory_pcg64" not in state:
            raise KeyError("memory backend: the RNG state has no 'memory_pcg64' entry")
        w = [int(x) for x in np.asarray(state["memory_pcg64"], dtype=np.uint64)]
        rng = np.random.default_rng()
        rng.bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": (w[0] << 64) | w[1], "inc": (w[2] << 64) | w[3]},
            "has_uint32": w[4],
            "uinteger": w[5],
        }
        self.rng = rng


_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL",
}


def run_threads(n: int, fn: Callable[[int], Any], deadline: float = 15.0,
                group: Optional[MemoryGroup] = None) -> List[Any]:
    """Run ``fn(rank)`` for ``rank`` in ``0..n-1`` on n threads; return each result or exception.

    Never hangs: threads still running after ``deadline`` seconds get a `RankTimeout` in their
    slot (and the ``group``'s pending rendezvous, when given, are aborted so they unblock).
    """
    results: List[Any] = [RankTimeout(f"rank {r} did not finish within {deadline}s") for r in range(n)]

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            results[rank] = err

    threads = [threading.Thread(target=target, args=(r,), name=f"rank-{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    if any(t.is_alive() for t in threads):
        late = [r for r, t in enumerate(threads) if t.is_alive()]
        if group is not None:
            group.abort()
        for t in threads:
            t.join(2.0)
        for r in late:
            results[r] = RankTimeout(f"rank {r} did not finish within {deadline}s")
    return results


def unwrap(results: List[Any]) -> List[Any]:
    """The results, or raise the first rank's exception (chained, with its rank in the message)."""
    for rank, value in enumerate(results):
        if isinstance(value, BaseException):
            raise AssertionError(f"rank {rank} raised {type(value).__name__}: {value}") from value
    return results


def run_accelerators(n: int, body: Callable[[Any], Any], *, timeout: float = 5.0, deadline: float = 15.0,
              local_num_processes: Optional[int] = None, **accelerator_kwargs: Any):
    """Build a `MemoryGroup`, run ``body(accelerator)`` on every rank; return ``(group, results)``.

    Fails the calling test when the backend saw collective keys that differ across ranks.
    """
    group = MemoryGroup(n, timeout, local_num_processes=local_num_processes)

    def fn(rank: int) -> Any:
        return body(group.accelerator(rank, **accelerator_kwargs))

    results = run_threads(n, fn, deadline=deadline, group=group)
    assert not group.key_errors, f"collective keys differ across ranks: {group.key_errors}"
    return group, results
