"""The Backend interface and the one place that maps a backend name to its class.

A backend supplies primitives only: identity, start/stop, a barrier with a timeout, an
any-process flag, all-gather and broadcast of bytes, array collectives, the framework's RNG
state and array conversion. Everything built from them (main-process-first, triggers,
checkpoints, data positions, messages) lives once in `unified/`.

Adding a framework means writing one module in `backends/` and adding one line to
`_REGISTRY` below.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .errors import BackendUnavailable, see

__all__ = ["Backend", "available_backends", "resolve_backend_name", "create_backend"]

@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """How to find, install and launch one backend."""

    target: str                     # "module:Class" of the Backend subclass
    framework: str                  # module that must be importable
    extra: str                      # pip extra that installs it
    launcher: str = "env"           # "torchrun", or "env": `unified launch` sets UNIFIED_* variables
    service: Optional[str] = None   # module run once per job beside the workers ("env" launcher)


# The one place that maps a backend name to its code.
_REGISTRY: Dict[str, BackendSpec] = {
    "torch": BackendSpec("backends.torch_backend:TorchBackend", "torch", "torch", launcher="torchrun"),
    "jax": BackendSpec("backends.jax_backend:JaxBackend", "jax", "jax", service="backends.jax_coordinator"),
}
DEFAULT_BACKEND = "torch"


class Backend:
    """Primitives a framework must provide. Subclass it in `backends/<framework>_backend.py`.

    Collectives take a ``key`` (unique per call and identical on every process, made by the
    Accelerator) and a ``timeout`` in seconds; they raise `unified.BarrierTimeout` when a peer
    does not arrive or died, and never block forever. With one process they return at once.
    """

    name: str = "base"
    distributed_type: str = "NO"
    # True when the framework never changes an array in place (JAX): an async save may then
    # write from views of the live arrays instead of copying them first.
    immutable_arrays: bool = False
    # True when `guard_writes` can hold back in-place updates of prepared objects.
    can_guard_writes: bool = False

    # -- identity -------------------------------------------------------------------------
    process_index: int = 0
    local_process_index: int = 0
    num_processes: int = 1
    local_num_processes: int = 1

    @property
    def device(self) -> Any:
        raise NotImplementedError

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, timeout: float) -> None:
        """Join the process group described by the environment, or stay a single process."""

    def shutdown(self) -> None:
        """Leave the process group; must not hang when peers already left or died."""

    def health_channel(self) -> Optional[Any]:
        """A `unified.watchdog.HealthChannel` (non-blocking ``post(name, value)`` and ``read()``
        shared by the group, e.g. the rendezvous key-value store) for the watchdog that tells
        every process when the group broke; ``None`` to run without one."""
        return None

    # -- control plane (small, timed) ---------------------------------------------------------
    def barrier(self, key: str, timeout: float) -> None:
        raise NotImplementedError

    def any_flag(self, flag: bool, key: str, timeout: float) -> bool:
        """True on every process if ``flag`` is true on any process."""
        raise NotImplementedError

    def all_gather_bytes(self, data: bytes, key: str, timeout: float) -> List[bytes]:
        """Every process's ``data``, in process order, on every process."""
        raise NotImplementedError

    def broadcast_bytes(self, data: Optional[bytes], src: int, key: str, timeout: float) -> bytes:
        raise NotImplementedError

    # -- data plane (framework arrays) ------------------------------------------------------
    def is_array(self, value: Any) -> bool:
        raise NotImplementedError

    def all_gather_arrays(self, arrays: Sequence[Any], key: str, timeout: float) -> List[Any]:
        """Concatenate each array along axis 0 over processes, in process order."""
        raise NotImplementedError

    def all_reduce_arrays(self, arrays: Sequence[Any], op: str, key: str, timeout: float) -> List[Any]:
        """Element-wise ``"sum"`` over processes (the caller derives ``"mean"``)."""
        raise NotImplementedError

    def broadcast_arrays(self, arrays: Sequence[Any], src: int, key: str, timeout: float) -> List[Any]:
        raise NotImplementedError

    def to_numpy(self, value: Any) -> Any:
        """A host NumPy copy of one of this framework's arrays."""
        raise NotImplementedError

    def from_numpy(self, value: Any, like: Any = None) -> Any:
        """This framework's array from NumPy (placed like ``like`` when given)."""
        raise NotImplementedError

    def export_array(self, value: Any) -> Tuple[str, Tuple[int, ...], Any]:
        """``(safetensors dtype, shape, contiguous uint8 NumPy view of the bytes)`` of one array
        this process holds whole; raise `TypeError` for arrays it cannot hold whole."""
        raise NotImplementedError

    def guard_writes(self, prepared: Sequence[Tuple[str, Any]], wait: Callable[[], None]) -> Callable[[], None]:
        """Make the next in-place update of the prepared ``(kind, object)`` pairs call ``wait``
        first; return a function that removes the guard."""
        raise NotImplementedError

    def watch_in_place_changes(self, arrays: Mapping[str, Any]) -> Callable[[], List[str]]:
        """Remember ``arrays`` (name -> array an async save writes from directly); the returned
        function names those changed in place since (a save that saw one is not committed)."""
        raise NotImplementedError

    def is_sharded(self, value: Any) -> bool:
        """True for an array whose parts live on several processes (saved by every process)."""
        return False

    def save_sharded(self, directory: str, arrays: Mapping[str, Any]) -> None:
        """Write ``arrays`` (sharded across processes) into ``directory``; every process calls it."""
        raise NotImplementedError

    def load_sharded(self, directory: str, like: Mapping[str, Any]) -> Dict[str, Any]:
        """Read what `save_sharded` wrote, placed like the arrays in ``like``; a collective."""
        raise NotImplementedError

    # -- training objects ---------------------------------------------------------------------
    def prepare(self, obj: Any) -> Optional[Tuple[str, Any]]:
        """``(kind, prepared)`` for a framework object (kind: ``"model"``, ``"optimizer"``,
        ``"scheduler"``, ``"scaler"``), or ``None`` when the object is not this framework's."""
        return None

    def unwrap_model(self, model: Any) -> Any:
        return model

    def state_of(self, kind: str, obj: Any) -> Any:
        """The object's state as a tree of arrays and plain values (see `unified.checkpoint.codec`)."""
        return obj.state_dict()

    def load_state_into(self, kind: str, obj: Any, state: Any) -> None:
        """Restore ``state`` (a tree whose arrays are NumPy) into ``obj`` in place."""
        raise NotImplementedError

    def backward(self, loss: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"backward() does not apply to the {self.name!r} backend: compute gradients inside your "
            "train step (e.g. nnx.value_and_grad) and apply them with the optimizer." + see("backward-jax")
        )

    def next_key(self) -> Any:
        raise NotImplementedError(
            f"next_key() is the JAX key stream; the {self.name!r} backend seeds its global generators "
            "from Accelerator(seed=...) instead (use torch.Generator for explicit streams)." + see("next-key-torch")
        )

    # -- data --------------------------------------------------------------------------------------
    def prepare_loader(self, loader: Any, seed: Optional[int]) -> Any:
        """The prepared form of this framework's own data loader type, or ``None``."""
        return None

    def place_batch(self, batch: Any) -> Any:
        """This process's rows of a global batch (NumPy leaves) as this framework's arrays."""
        raise NotImplementedError

    # -- framework RNG ------------------------------------------------------------------------
    def seed(self, seed: int) -> None:
        """Seed the framework's global generators (Python and NumPy are seeded by `unified`)."""

    def rng_state(self) -> Dict[str, Any]:
        """The framework's global generator states as NumPy arrays, by name."""
        return {}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        """Restore what `rng_state` returned; raise when a generator is missing."""


def available_backends() -> List[str]:
    """Names of the registered backends whose framework is installed.

    Example:
        >>> import unified
        >>> unified.available_backends()   # doctest: +SKIP
        ['torch', 'jax']
    """
    return [name for name, spec in _REGISTRY.items() if _installed(spec.framework)]


def backend_names() -> List[str]:
    """Every registered backend name, installed or not."""
    return list(_REGISTRY)


def backend_spec(name: str) -> BackendSpec:
    return _REGISTRY[name]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend_name(requested: Optional[str] = None) -> str:
    """Pick the backend: argument, then ``UNIFIED_BACKEND``, then the launcher's choice, then the
    only framework installed, then torch."""
    for source, value in (
        ("backend=", requested),
        ("UNIFIED_BACKEND", os.environ.get("UNIFIED_BACKEND")),
        ("the launcher (UNIFIED_LAUNCHER_BACKEND)", os.environ.get("UNIFIED_LAUNCHER_BACKEND")),
    ):
        if value:
            name = value.strip().lower()
            if name not in _REGISTRY:
                choices = ", ".join(repr(n) for n in _REGISTRY)
                raise ValueError(
                    f"Invalid backend from {source}: expected one of {choices}; received {value!r}." + see("invalid-backend")
                )
            return name
    installed = available_backends()
    if len(installed) == 1:
        return installed[0]
    if not installed:
        raise BackendUnavailable(
            "No supported framework is installed. Install one: pip install 'unified[torch]' "
            "or pip install 'unified[jax]'." + see("no-framework")
        )
    return DEFAULT_BACKEND


def create_backend(name: str) -> Backend:
    """Instantiate the backend registered under ``name`` (importing its framework now)."""
    spec = _REGISTRY[name]
    if not _installed(spec.framework):
        raise BackendUnavailable(
            f"The {name!r} backend needs {spec.framework}, which is not installed. "
            f"Install it with: pip install 'unified[{spec.extra}]'" + see("backend-not-installed")
        )
    module_name, class_name = spec.target.split(":")
    return getattr(importlib.import_module(module_name), class_name)()
