"""`NumpyBackend`: NumPy arrays, a PCG64 generator, and a control plane over a TCP key-value store.

Every collective is a rendezvous on its key: each process adds itself to a counter and leaves
its value; everyone polls the counter until all arrived or the deadline passed (then the
processes without an arrival note are named). No native array collectives: `unified` sends
arrays through `all_gather_bytes`.
"""
from __future__ import annotations

import datetime
import itertools
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from unified.backend import Backend, TrainingObjects
from unified.backend.toolkit import BarrierTimeout, ProcessEnvironment, export_numpy

_POLL_S = 0.002
# The n-th backend of every process shares key prefix n: two Accelerators' keys never meet.
_INSTANCES = itertools.count()


class NumpyModel:
    """A model of this backend: named float32 arrays, updated in place."""

    def __init__(self, **params: np.ndarray) -> None:
        self.params = {k: np.asarray(v, dtype=np.float32).copy() for k, v in params.items()}

    def state_dict(self) -> Dict[str, np.ndarray]:
        return self.params  # live arrays, as torch's state_dict hands out live tensors

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        for name, value in state.items():
            self.params[name][...] = value


class NumpySGD:
    """SGD with momentum over a `NumpyModel`'s arrays."""

    def __init__(self, model: NumpyModel, lr: float, momentum: float = 0.9) -> None:
        self.model, self.lr, self.momentum = model, lr, momentum
        self.velocity = {k: np.zeros_like(v) for k, v in model.params.items()}
        self.steps = 0

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        for name, grad in grads.items():
            self.velocity[name] *= self.momentum
            self.velocity[name] += grad
            self.model.params[name] -= self.lr * self.velocity[name]
        self.steps += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"velocity": self.velocity, "steps": self.steps, "lr": self.lr}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, value in state["velocity"].items():
            self.velocity[name][...] = value
        self.steps, self.lr = int(state["steps"]), float(state["lr"])


class NumpyBackend(Backend, TrainingObjects):
    """One process of a NumPy group (or a plain process)."""

    name = "numpy"

    def __init__(self) -> None:
        self._store: Any = None
        self._prefix = f"numpy/{next(_INSTANCES)}/"
        self._prepared = itertools.count()
        self.rng = np.random.default_rng()

    # -- identity and lifecycle ---------------------------------------------------------------
    @property
    def device(self) -> str:
        return "cpu"

    def start(self, timeout: float) -> None:
        env = ProcessEnvironment.from_env()
        self.process_index, self.num_processes = env.process_index, env.num_processes
        self.local_process_index, self.local_num_processes = env.local_process_index, env.local_num_processes
        if env.distributed:
            from torch.distributed import TCPStore  # only its key-value store

            host, port = env.coordinator.rsplit(":", 1)
            self._store = TCPStore(host, int(port), is_master=False,
                                   timeout=datetime.timedelta(seconds=min(timeout, 600)))

    def shutdown(self) -> None:
        self._store = None

    # -- control plane ----------------------------------------------------------------------------
    def _meet(self, key: str, timeout: float, value: Optional[bytes] = None) -> None:
        """Leave ``value`` under ``key``, then wait until every process arrived at ``key``."""
        name = self._prefix + key
        if value is not None:
            self._store.set(f"{name}/value/{self.process_index}", value)
        self._store.set(f"{name}/arrived/{self.process_index}", "1")
        self._store.add(f"{name}/count", 1)
        deadline = time.monotonic() + timeout
        while self._store.add(f"{name}/count", 0) < self.num_processes:
            if time.monotonic() > deadline:
                missing = [r for r in range(self.num_processes) if not self._store.check([f"{name}/arrived/{r}"])]
                raise BarrierTimeout(key, timeout, missing or None, process_index=self.process_index,
                                     num_processes=self.num_processes, detail="numpy backend key-value store")
            time.sleep(_POLL_S)

    def _values(self, key: str, ranks: List[int]) -> List[bytes]:
        return list(self._store.multi_get([f"{self._prefix}{key}/value/{r}" for r in ranks]))

    def barrier(self, key: str, timeout: float) -> None:
        if self.num_processes > 1:
            self._meet(key, timeout)

    def any_flag(self, flag: bool, key: str, timeout: float) -> bool:
        if self.num_processes == 1:
            return bool(flag)
        self._meet(key, timeout, b"1" if flag else b"0")
        return any(v == b"1" for v in self._values(key, list(range(self.num_processes))))

    def all_gather_bytes(self, data: bytes, key: str, timeout: float) -> List[bytes]:
        if self.num_processes == 1:
            return [data]
        self._meet(key, timeout, data)
        return self._values(key, list(range(self.num_processes)))

    def broadcast_bytes(self, data: Optional[bytes], src: int, key: str, timeout: float) -> bytes:
        if self.num_processes == 1:
            return data or b""
        self._meet(key, timeout, (data or b"") if self.process_index == src else None)
        return self._values(key, [src])[0]

    # -- arrays -----------------------------------------------------------------------------------
    def is_array(self, value: Any) -> bool:
        return isinstance(value, np.ndarray)

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.array(value)

    def from_numpy(self, value: Any, like: Any = None) -> np.ndarray:
        return np.array(value)

    def export_array(self, value: Any) -> Tuple[str, Tuple[int, ...], np.ndarray]:
        return export_numpy(value)

    # -- RNG --------------------------------------------------------------------------------------
    def seed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def rng_state(self) -> Dict[str, np.ndarray]:
        state = self.rng.bit_generator.state
        words = []
        for big in (state["state"]["state"], state["state"]["inc"]):
            words += [big >> 64, big & (2**64 - 1)]
        return {"numpy_pcg64": np.array(words + [state["has_uint32"], state["uinteger"]], dtype=np.uint64)}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        w = [int(x) for x in np.asarray(state["numpy_pcg64"], dtype=np.uint64)]
        self.rng.bit_generator.state = {"bit_generator": "PCG64", "has_uint32": w[4], "uinteger": w[5],
                                        "state": {"state": (w[0] << 64) | w[1], "inc": (w[2] << 64) | w[3]}}

    # -- training objects -------------------------------------------------------------------------
    def prepare(self, obj: Any) -> Optional[Tuple[str, Any]]:
        if isinstance(obj, NumpyModel):
            if self.num_processes > 1:  # every process starts from process 0's values
                number = next(self._prepared)
                for name, value in obj.params.items():
                    data = self.broadcast_bytes(value.tobytes(), 0, f"prepare {number}/{name}", 600)
                    value[...] = np.frombuffer(data, dtype=value.dtype).reshape(value.shape)
            return "model", obj
        if isinstance(obj, NumpySGD):
            return "optimizer", obj
        return None

    def state_of(self, kind: str, obj: Any) -> Any:
        return obj.state_dict()

    def load_state_into(self, kind: str, obj: Any, state: Any) -> None:
        obj.load_state_dict(state)
