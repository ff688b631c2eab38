"""What every backend must provide: `Backend`, a small abstract core (identity, lifecycle, the
timed control plane, array import/export and the framework's global RNG), and `HealthChannel`,
what its ``health_channel()`` returns. Everything built from these primitives (main-process-first,
triggers, checkpoints, data positions, messages) lives once in `unified/`. A backend that forgets
a required method fails when it is constructed, with the method's name. The optional abilities a
backend may add are in `unified.backend.capabilities`; see ``docs/adding-a-backend.md``.
"""
from __future__ import annotations

import abc
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from ..errors import InvalidBackend, see

# An exported array: (safetensors dtype name, shape, contiguous uint8 NumPy view of its bytes)
Exported = Tuple[str, Tuple[int, ...], Any]
FileHashes = Dict[str, Dict[str, Any]]  # file name -> {"size": bytes, "xxh3": hex digest}

__all__ = ["Backend", "HealthChannel", "Exported", "FileHashes", "check_backend_class"]


def check_backend_class(cls: type) -> None:
    """Raise `InvalidBackend` naming every required method ``cls`` does not implement."""
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise InvalidBackend(
            f"{cls.__module__}.{cls.__qualname__} does not implement {', '.join(missing)}: a unified backend "
            "must implement every abstract method of unified.Backend and of the capabilities it inherits "
            "(see docs/adding-a-backend.md)."
            + see("invalid-backend-class")
        )


class Backend(abc.ABC):
    """The primitives every framework provides. Subclass it (and any capabilities) in
    ``backends/<framework>/core.py``.

    Collectives take a ``key`` (unique per call and identical on every process, made by the
    Accelerator) and a ``timeout`` in seconds; they raise `unified.BarrierTimeout` when a peer
    does not arrive or died, and never block forever. With one process they return at once.

    Example:
        >>> class MyBackend(Backend):          # doctest: +SKIP
        ...     name = "mine"
        ...     def barrier(self, key, timeout): ...
        >>> MyBackend()                         # doctest: +SKIP
        TypeError: Can't instantiate abstract class MyBackend ... 'all_gather_bytes', ...
    """

    name: str = "base"
    # Accelerate's `distributed_type` value while several processes run (one process: "NO").
    group_distributed_type: str = "MULTI_CPU"
    # True when the framework never changes an array in place: an async save may then write
    # from views of the live arrays instead of copying them first.
    immutable_arrays: bool = False
    # False when the processes' batches of one step form a single global array (JAX), so a
    # prepared batch sampler must give every process a batch of the same size.
    uneven_batches: bool = True

    # -- identity (set by `start`) ---------------------------------------------------------
    # The group's communication library as Accelerate's ``state.backend`` names it ("gloo",
    # "nccl"); None with one process.
    communication_backend: Optional[str] = None
    process_index: int = 0
    local_process_index: int = 0
    num_processes: int = 1
    local_num_processes: int = 1

    def __new__(cls, *args: Any, **kwargs: Any) -> "Backend":
        check_backend_class(cls)  # our message, naming every missing method, before ABC's
        return super().__new__(cls)

    # The ``__metadata__`` of weight files that `save_model` and `save` write, as the
    # framework's own loaders expect it (torch: ``{"format": "pt"}``, which transformers checks).
    weights_metadata: Mapping[str, str] = {}

    def save_object(self, obj: Any, path: str) -> None:
        """``accelerator.save(obj, path)`` without ``safe_serialization``: the framework's own
        file format (torch: ``torch.save``). Without one, a clear error."""
        raise TypeError(f"the {self.name!r} backend has no file format of its own for accelerator.save(); pass "
                        "safe_serialization=True to write a dict of arrays as safetensors." + see("save-object"))

    def release_device_memory(self) -> None:
        """Hand the device's cached, unused memory back (``free_memory``); nothing by default."""

    @property
    def distributed_type(self) -> str:
        return self.group_distributed_type if self.num_processes > 1 else "NO"

    @property
    @abc.abstractmethod
    def device(self) -> Any:
        """This process's default device, in the framework's own type."""

    # -- lifecycle --------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self, timeout: float) -> None:
        """Join the process group described by the environment, or stay a single process."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Leave the process group; must not hang when peers already left or died."""

    def health_channel(self) -> Optional["HealthChannel"]:
        """A `HealthChannel` (non-blocking ``post(name, value)`` and ``read()``
        shared by the group, e.g. the rendezvous key-value store) for the watchdog that tells
        every process when the group broke; ``None`` to run without one."""
        return None

    # -- control plane (small, timed) -----------------------------------------------------
    @abc.abstractmethod
    def barrier(self, key: str, timeout: float) -> None:
        """Return once every process called it with ``key``."""

    @abc.abstractmethod
    def any_flag(self, flag: bool, key: str, timeout: float) -> bool:
        """True on every process if ``flag`` is true on any process."""

    @abc.abstractmethod
    def all_gather_bytes(self, data: bytes, key: str, timeout: float) -> List[bytes]:
        """Every process's ``data``, in process order, on every process."""

    @abc.abstractmethod
    def broadcast_bytes(self, data: Optional[bytes], src: int, key: str, timeout: float) -> bytes:
        """Process ``src``'s ``data`` on every process."""

    # -- arrays -----------------------------------------------------------------------------
    @abc.abstractmethod
    def is_array(self, value: Any) -> bool:
        """True for this framework's array type."""

    @abc.abstractmethod
    def to_numpy(self, value: Any) -> Any:
        """A host NumPy copy of one of this framework's arrays."""

    @abc.abstractmethod
    def from_numpy(self, value: Any, like: Any = None) -> Any:
        """This framework's array from NumPy (placed like ``like`` when given)."""

    @abc.abstractmethod
    def export_array(self, value: Any) -> Exported:
        """``(safetensors dtype, shape, contiguous uint8 NumPy view of the bytes)`` of one array
        this process holds whole; raise `TypeError` for arrays it cannot hold whole."""

    def begin_host_copies(self, values: Sequence[Any]) -> None:
        """Start copying ``values`` (this framework's arrays about to be exported one by one with
        `export_array`) from device memory to the host without waiting, so that the copies
        overlap instead of running one after another (the default: nothing to start).

        Example:
            >>> backend.begin_host_copies(list(params.values()))   # JAX: copy_to_host_async each
        """

    # Generators of `rng_state` that a checkpoint may lack: `set_rng_state` handles their absence
    # itself (torch: the CUDA generator, in a checkpoint saved without a GPU, with a warning).
    # Any other generator missing from a checkpoint is refused before anything is restored.
    optional_rng_state: Tuple[str, ...] = ()

    def writable_host_bytes(self, value: Any) -> Any:
        """A writable C-contiguous uint8 NumPy view of the memory of ``value``, one of this
        framework's arrays, when it lives in this process's host memory and may be written in
        place (a load then reads the checkpoint straight into it: no second copy of the state);
        None otherwise (the default: arrays the framework does not let one write, as JAX's).

        Example:
            >>> backend.writable_host_bytes(torch.ones(2))   # torch: the tensor's 8 bytes
            array([0, 0, 128, 63, 0, 0, 128, 63], dtype=uint8)
        """
        return None

    def describe_array(self, value: Any) -> Tuple[str, Tuple[int, ...]]:
        """``(safetensors dtype, shape)`` that `export_array` would give, ideally without a copy
        (checkpoints check them against the file before restoring anything)."""
        dtype, shape, _ = self.export_array(value)
        return dtype, tuple(shape)

    def pad_array(self, value: Any, dim: int, length: int, pad_index: Any, pad_first: bool) -> Any:
        """``value`` grown along axis ``dim`` (>= 0) to ``length`` with ``pad_index``, before the
        data when ``pad_first``, keeping its dtype and device (`pad_across_processes`). This default
        goes through NumPy; a backend overrides it to stay on the device."""
        import numpy as np

        host = np.asarray(self.to_numpy(value))
        widths = [(0, 0)] * host.ndim
        extra = length - host.shape[dim]
        widths[dim] = (extra, 0) if pad_first else (0, extra)
        return self.from_numpy(np.pad(host, widths, constant_values=pad_index), like=value)

    def place_batch(self, batch: Any) -> Any:
        """This process's rows of a global batch (NumPy leaves) as this framework's arrays."""
        from ..runtime.tree import flatten

        leaves, rebuild = flatten(batch, lambda x: not isinstance(x, (dict, list, tuple)))
        return rebuild([self.from_numpy(leaf) if hasattr(leaf, "__array_interface__") else leaf for leaf in leaves])

    # -- the framework's global random generators --------------------------------------------
    @abc.abstractmethod
    def seed(self, seed: int) -> None:
        """Seed the framework's generators (Python and NumPy are seeded by `unified`)."""

    @abc.abstractmethod
    def rng_state(self) -> Dict[str, Any]:
        """The framework's generator states as NumPy arrays, by name (``{}`` if it has none)."""

    @abc.abstractmethod
    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        """Restore what `rng_state` returned (the caller checks that every name is present)."""


class HealthChannel(Protocol):
    """What `Backend.health_channel` returns: non-blocking key-value access shared by the
    processes of one group (e.g. the rendezvous key-value store), through which the watchdog
    (`unified.runtime.watchdog`) tells every process when one failed alone. Names are ``<kind>/<process
    index>`` with a kind of ``unified.runtime.watchdog.CHANNEL_KINDS``. A backend that has one satisfies the
    conformance scenarios that require ``"HealthChannel"``.

    Example:
        >>> channel = backend.health_channel()      # doctest: +SKIP
        >>> channel.post("alive/0", "1"); channel.read()
        {'alive/0': '1'}
    """

    def post(self, name: str, value: str) -> None:
        """Set (or overwrite) ``name``."""

    def read(self) -> Dict[str, str]:
        """Every name posted by any process, with its value."""

    # Optional: ``where`` (a str attribute) names the service in messages, e.g. "the coordination
    # service at 10.0.0.1:29500 (process 0's machine)".
