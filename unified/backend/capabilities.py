"""What a framework must provide (`Backend`) and what it may opt into (capabilities).

`Backend` is a small abstract core: identity, lifecycle, the timed control plane, array
import/export and the framework's global RNG. Everything built from them (main-process-first,
triggers, checkpoints, data positions, messages) lives once in `unified/`. A backend that
forgets a required method fails when it is constructed, with the method's name.

Optional abilities are separate small interfaces that a backend class also inherits; shared
code asks ``isinstance(backend, Capability)`` and gives a precise error where one is missing:

=====================  ===========================================================
`TrainingObjects`      prepare models / optimizers / schedulers, save and restore them
`Autograd`             ``accelerator.backward(loss)``
`KeyStream`            ``accelerator.next_key()``, a counter-based random key stream
`DeviceMesh`           ``accelerator.mesh``
`ArrayCollectives`     native gather / reduce / broadcast of framework arrays
`ShardedArrays`        arrays split across processes, written by every process
`WriteGuards`          async saves straight from live memory
`ForeignLoaders`       preparing another library's data loader (e.g. a torch DataLoader)
`TrainingLoop`         mixed precision, gradient accumulation and clipping
=====================  ===========================================================

A backend is found by name through `unified.backend.registry`; see ``docs/adding-a-backend.md``.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from ..errors import InvalidBackend, MissingCapability, see

# An exported array: (safetensors dtype name, shape, contiguous uint8 NumPy view of its bytes)
Exported = Tuple[str, Tuple[int, ...], Any]
FileHashes = Dict[str, Dict[str, Any]]  # file name -> {"size": bytes, "xxh3": hex digest}

__all__ = [
    "Backend", "TrainingObjects", "Autograd", "KeyStream", "DeviceMesh", "ArrayCollectives",
    "ShardedArrays", "ShardedWrite", "WriteGuards", "ForeignLoaders", "TrainingLoop", "CAPABILITIES",
    "Replaceable", "DeferredArray", "HealthChannel",
]

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


# -- capabilities ------------------------------------------------------------------------------
class TrainingObjects(abc.ABC):
    """Models, optimizers, schedulers and scalers that `prepare` wraps and checkpoints restore."""

    @abc.abstractmethod
    def prepare(self, obj: Any) -> Optional[Tuple[str, Any]]:
        """``(kind, prepared)`` for one of the framework's objects (kind: ``"model"``,
        ``"optimizer"``, ``"scheduler"``, ``"scaler"``), or ``None`` when it is not one."""

    @abc.abstractmethod
    def state_of(self, kind: str, obj: Any) -> Any:
        """The object's state as a tree of arrays and plain values (see `unified.checkpoint.codec`)."""

    @abc.abstractmethod
    def load_state_into(self, kind: str, obj: Any, state: Any) -> None:
        """Restore ``state`` (a tree whose arrays are read-only NumPy views) into ``obj`` in place."""

    def unwrap_model(self, model: Any, keep_compiled: bool = False) -> Any:
        """The user's model without the backend's wrappers; ``keep_compiled``: a compiled
        model stays compiled, around the unwrapped module (Accelerate's ``keep_torch_compile``)."""
        return model

    def absent_group(self, kind: str, name: str) -> Optional[str]:
        """The group of arrays that array ``name`` of a ``kind`` object's state belongs to when a
        checkpoint may lack that group as a whole (a torch optimizer's state of one parameter,
        saved before its first step), else ``None``: the checkpoint must hold the array."""
        return None

    def check_loadable(self, kind: str, obj: Any, state: Any) -> None:
        """Raise `ValueError` when ``obj`` cannot take ``state`` (decoded from a checkpoint);
        called for every object before any is restored, so a refusal changes nothing."""

    def replaceable_arrays(self, kind: str, obj: Any) -> Any:
        """A tree like ``state_of(kind, obj)`` whose leaves are `Replaceable` handles (or ``None``)
        for the arrays a load may replace one at a time, or ``None`` (the default). For arrays
        that cannot be written in place through host memory (`Backend.writable_host_bytes` is
        ``None``: JAX's, torch tensors on a GPU), so that a load holds one array beyond the live
        state at a time instead of a second copy of the whole state.

        Example:
            >>> backend.replaceable_arrays("model", model)     # JAX
            {'kernel': <Replaceable>, 'bias': <Replaceable>}
        """
        return None


class Replaceable(abc.ABC):
    """One array of a prepared object, which a load replaces by a new one made from the
    checkpoint's bytes (see `TrainingObjects.replaceable_arrays`).

    Example:
        >>> handle.replace(host_bytes_of_the_same_dtype_and_shape)
        >>> handle.current()                                # the new array
    """

    @abc.abstractmethod
    def current(self) -> Any:
        """The array the object holds now."""

    @abc.abstractmethod
    def replace(self, host: Any) -> None:
        """Make the object hold ``host``'s values (a NumPy array of `current`'s saved dtype and
        shape) in this array: a new array placed like the current one, put in its place (JAX),
        or the current one filled (a torch tensor on a GPU). ``host``'s memory is reused for the
        next array once this returns: whatever is kept must be a copy by then, unless
        `keeps_host`."""

    @property
    def keeps_host(self) -> bool:
        """Whether `replace` may keep ``host``'s memory as the new array's (a JAX array on the
        CPU, made over it without a copy). The load then reads this array into memory of its own,
        which it never writes again, instead of the staging buffer it reuses for the next array."""
        return False

    def writable_in_place(self) -> Any:
        """A writable C-contiguous uint8 NumPy view of the memory of the array the object holds,
        when it lives in this process's host memory and nothing but the object can see it, so that
        the load's second pass reads the checkpoint straight into it instead of making a new array
        (`replace`); None otherwise (the default). Called only once every check passed, just before
        the array is read; the backend may first make the object hold an array of the same
        contents that owns its memory alone (JAX on the CPU: the array donated to a new one, when
        only its Variable holds it).

        Example:
            >>> view = handle.writable_in_place()     # JAX on the CPU, the array held by its Variable only
            >>> view.nbytes == handle.current().nbytes
            True
        """
        return None

    def adopt(self, value: Any) -> None:
        """Make the object hold ``value``, an array placed like `current` (a sharded reader's
        `DeferredArray.make`), in this array's place; the current one is dropped. A backend whose
        sharded readers return `DeferredArray`s that are new arrays (not the live ones filled in
        place) implements it."""
        raise NotImplementedError(f"{type(self).__name__} cannot adopt a new array." + see("placing-failed"))


class DeferredArray(abc.ABC):
    """A sharded array that a load's reader makes only when the load restores it (`make`): from
    bytes it hashed in a first pass (a store's private local copy, a folder's file) or read then
    (Orbax). The load then puts the arrays in place one at a time (filled in place, or
    `Replaceable.adopt`) instead of holding a second copy of the process's part of the state.
    Returned by `ShardedArrays.load_sharded_hashed` when given ``copy_to``, and by
    `ShardedArrays.load_sharded_deferred`.

    Example:
        >>> restored, hashes = backend.load_sharded_hashed(url, like, copy_to=local_copy)
        >>> handle.adopt(restored["a0"].make())
    """

    shape: Tuple[int, ...]
    dtype: Any

    @abc.abstractmethod
    def make(self) -> Any:
        """The array, placed like the live array it replaces."""


class Autograd(abc.ABC):
    """Gradients computed by calling ``backward`` on a loss (``accelerator.backward``)."""

    @abc.abstractmethod
    def backward(self, loss: Any, **kwargs: Any) -> None: ...


class KeyStream(abc.ABC):
    """A random key stream seeded by ``Accelerator(seed=...)`` (``accelerator.next_key()``); its
    position is part of `Backend.rng_state`."""

    @abc.abstractmethod
    def next_key(self) -> Any: ...


class DeviceMesh(abc.ABC):
    """A device mesh over every process's devices (``accelerator.mesh``)."""

    @property
    @abc.abstractmethod
    def mesh(self) -> Any: ...


class ArrayCollectives(abc.ABC):
    """Native collectives on framework arrays. Without them, `unified.runtime.collectives` moves arrays
    as bytes through the control plane (correct, slower for large arrays)."""

    @abc.abstractmethod
    def all_gather_arrays(self, arrays: Sequence[Any], key: str, timeout: float) -> List[Any]:
        """Concatenate each array along axis 0 over processes, in process order."""

    @abc.abstractmethod
    def all_reduce_arrays(self, arrays: Sequence[Any], op: str, key: str, timeout: float) -> List[Any]:
        """Element-wise ``"sum"`` over processes (the caller derives ``"mean"``)."""

    @abc.abstractmethod
    def broadcast_arrays(self, arrays: Sequence[Any], src: int, key: str, timeout: float) -> List[Any]:
        """Process ``src``'s arrays on every process."""


class ShardedWrite:
    """A sharded save begun by `ShardedArrays.begin_sharded_save`: `result` finishes it (the
    writes of this process's own shards) and returns once its files are on disk, or raises.
    It runs in the async save's background thread, beside the training thread's collectives,
    so it must run none on the training's process group. It returns what the writes return
    (see `ShardedArrays.save_sharded`).

    Example:
        >>> ShardedWrite(lambda: None).result()
    """

    def __init__(self, finish: Callable[[], Optional[FileHashes]]) -> None:
        self._finish: Optional[Callable[[], Optional[FileHashes]]] = finish

    def result(self) -> Optional[FileHashes]:
        finish, self._finish = self._finish, None
        return finish() if finish is not None else None


class ShardedArrays(abc.ABC):
    """Arrays whose parts live on several processes: every process writes its own part into
    ``sharded.<sharded_format>/`` of a checkpoint (a collective), listed in the manifest.

    Checksums: the manager hashes every file of that folder unless the backend reports their
    hashes, computed in the pass that wrote or read the bytes (`FileHashes`, names relative to
    the folder): `save_sharded` may return those of the files this process wrote, and a backend
    with ``hashes_while_reading`` returns from `load_sharded_hashed` those of the files it read
    whole; the manager compares them with the manifest before anything is restored.

    Object stores: a backend with ``sharded_to_store`` is given an object store's URL as
    ``directory`` as well (``s3://…/sharded.<format>``): it writes and reads there through
    `unified.checkpoint.store` (``location_of(url).write`` streams and hashes each file;
    ``ObjectStore.files / read_range / reading`` for its reader), reports the hashes of every
    file it wrote, makes no folder, and is read with `load_sharded_hashed` (whatever its
    ``hashes_while_reading``, which is about folders). Without it, `save_state` to a store
    refuses sharded state before anything is written."""

    sharded_format: str = "sharded"
    hashes_while_reading: bool = False
    sharded_to_store: bool = False

    @abc.abstractmethod
    def is_sharded(self, value: Any) -> bool: ...

    @abc.abstractmethod
    def save_sharded(self, directory: str, arrays: Mapping[str, Any]) -> Optional[FileHashes]:
        """Write this process's part of ``arrays`` into ``directory``; a collective. Returns the
        size and xxh3 of each file it wrote, or None (the manager then hashes them)."""

    def begin_sharded_save(self, directory: str, arrays: Mapping[str, Any]) -> ShardedWrite:
        """The first half of an asynchronous `save_sharded`, run by every process in the calling
        thread (it may run collectives): take what the writes need (host copies of this
        process's own shards, the plan) so that the arrays may change as soon as it returns; the
        returned `ShardedWrite` does the writes in the background. This default writes
        everything now (a backend without asynchronous sharded writes) and returns a finished one."""
        hashes = self.save_sharded(directory, arrays)
        return ShardedWrite(lambda: hashes)

    @abc.abstractmethod
    def load_sharded(self, directory: str, like: Mapping[str, Any]) -> Dict[str, Any]:
        """Read what `save_sharded` wrote, placed like the arrays in ``like``; a collective. The
        manager has checked every file before (a backend without ``hashes_while_reading``)."""

    def load_sharded_deferred(self, directory: str, like: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
        """`load_sharded` in bounded memory, or None (the default: not offered): nothing read yet,
        each array a `DeferredArray` that reads it when made (a collective when the reader's are:
        every process makes them in the same order, ``like``'s, which the reader may group its
        reads by). The manager checked every file before and checks them again after the last
        is made."""
        return None

    def load_sharded_hashed(self, directory: str, like: Mapping[str, Any],
                            copy_to: Optional[Callable[[str, int], Optional[str]]] = None
                            ) -> Tuple[Dict[str, Any], FileHashes]:
        """`load_sharded` into fresh arrays that nothing else holds, before any file was
        checked (a backend with ``hashes_while_reading``); also returns the size and xxh3 of
        each file it read whole, hashed in the same pass. The manager checks those against the
        manifest and hashes the other files before any object is restored.

        ``copy_to`` given: the manager asks for a load in bounded memory. The reader may then
        return `DeferredArray`s (hashing the files now, restoring nothing), which the manager
        makes and puts in place (`Replaceable.adopt`, or filled in place) one at a time once
        every check passed; on an object store ``copy_to(url, size)`` names a new file in a
        private local folder where an object read whole may be streamed for that (or None: no
        room). ``None``: read now (``UNIFIED_IN_PLACE_MIN_BYTES`` above every array)."""
        return self.load_sharded(directory, like), {}


class WriteGuards(abc.ABC):
    """An async save may write straight from live memory: the backend holds back in-place
    updates of prepared objects until the files are written, and detects the others."""

    @abc.abstractmethod
    def guard_writes(self, prepared: Sequence[Tuple[str, Any]], wait: Callable[[], None]) -> Callable[[], None]:
        """Make the next in-place update of the prepared ``(kind, object)`` pairs call ``wait``
        first; return a function that removes the guard."""

    @abc.abstractmethod
    def watch_in_place_changes(self, arrays: Mapping[str, Any]) -> Callable[[], List[str]]:
        """Remember ``arrays`` (name -> array an async save writes from directly); the returned
        function names those changed in place since (a save that saw one is not committed)."""

    def stage_array(self, value: Any) -> Optional[Exported]:
        """For an async save: begin copying an array held in device memory into host memory and
        return `export_array`'s triple over that host memory without waiting for the copy;
        ``None`` for an array exported as usual (the default: every one). The bytes are valid
        once the function `staged` returns has returned."""
        return None

    def staged(self) -> Callable[[], None]:
        """Called after the arrays of one save were staged: order the copies before the
        training's next device work (which may change those arrays in place), and return the
        function that waits, on the host, until every copy is done (the writer calls it)."""
        return lambda: None


class ForeignLoaders(abc.ABC):
    """Preparing data loaders of another library (e.g. a torch DataLoader) for this backend."""

    @abc.abstractmethod
    def prepare_loader(self, loader: Any, seed: Optional[int]) -> Any:
        """The prepared form of ``loader``, or ``None`` when it is not a loader this adapts."""


class ShardedTraining(abc.ABC):
    """Models and optimizer state sharded over every process (FSDP2 on torch, sharded NNX on JAX).

    `configure_sharding` is called once, before any ``prepare``, with the run's
    `unified.training.sharding.FullyShardedDataParallelPlugin`; from then on the backend's ``prepare`` of a
    model shards it instead of replicating it, and its sharded arrays are saved by every process
    through `ShardedArrays`.
    """

    # Accelerate's ``accelerator.is_fsdp2``: the backend shards with torch's FSDP2
    is_fsdp2: bool = False

    @abc.abstractmethod
    def configure_sharding(self, plugin: Any) -> None: ...

    def full_array(self, value: Any, key: str, timeout: float) -> Any:
        """A host NumPy copy of the whole of ``value``, one array of a prepared model, on every
        process: a collective when its parts live on several processes (``save_model`` of a
        sharded model calls it on every process, one array at a time). This default suits
        arrays every process holds whole."""
        return self.to_numpy(value)  # type: ignore[attr-defined]


class TrainingLoop(abc.ABC):
    """Mixed precision, gradient accumulation and clipping for the objects the backend prepares.

    `configure_loop` is called once, before any ``prepare``, with the shared
    `unified.training.loop.LoopSettings`; the backend's prepared objects follow its
    ``GradientState`` (skip optimizer/scheduler steps between accumulation boundaries, or
    accumulate inside the optimizer) and compute in its mixed precision.
    """

    # the ``mixed_precision`` values this backend honours ("no" always)
    mixed_precisions: Tuple[str, ...] = ("no",)
    # the kwargs handlers (`unified.compat.kwargs_handlers`, by class name) whose options it applies
    kwargs_handlers: Tuple[str, ...] = ()

    @abc.abstractmethod
    def configure_loop(self, settings: Any) -> None: ...

    @abc.abstractmethod
    def autocast(self) -> Any:
        """A context manager computing in the configured mixed precision (outside prepared forwards)."""

    @abc.abstractmethod
    def no_sync(self, model: Any) -> Any:
        """A context manager in which ``model``'s gradients are not synchronised across processes."""

    @abc.abstractmethod
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        """Clip by total norm; returns the framework's result (torch: the norm; JAX: (clipped, norm))."""

    @abc.abstractmethod
    def clip_grad_value_(self, parameters: Any, clip_value: float) -> Any: ...

    @abc.abstractmethod
    def loop_state(self) -> Dict[str, Any]:
        """State of the loop the backend owns (e.g. fp16 loss scaler, gradients accumulated so far
        in an open window), saved with every checkpoint; a collective (every process calls it)."""

    @abc.abstractmethod
    def load_loop_state(self, state: Dict[str, Any]) -> None: ...

    def before_micro_step(self) -> None:
        """Called by ``accelerator.accumulate`` once the window's position is known."""

    def strip_autocast(self, model: Any) -> Any:
        """``model`` without the mixed-precision wrapping `prepare` gave it (``unwrap_model(...,
        keep_fp32_wrapper=False)``)."""
        return model

    # the loss scaler of fp16 training (torch's ``GradScaler``), where there is one
    loss_scaler: Any = None

    def unscale_gradients(self) -> None:
        """Divide the gradients by the loss scale now (once per step), where there is a loss
        scaler (``accelerator.unscale_gradients``); nothing otherwise."""


CAPABILITIES = (TrainingObjects, Autograd, KeyStream, DeviceMesh, ArrayCollectives, ShardedArrays,
                WriteGuards, ForeignLoaders, TrainingLoop, ShardedTraining)


def capabilities_of(backend: Backend) -> List[str]:
    """Names of the capabilities ``backend`` has (for reports and errors)."""
    return [c.__name__ for c in CAPABILITIES if isinstance(backend, c)]


def require(backend: Backend, capability: type, what: str) -> Any:
    """``backend`` when it has ``capability``; otherwise an error naming what is missing. The
    error is both `NotImplementedError` and `AttributeError`, so ``hasattr`` stays False."""
    if isinstance(backend, capability):
        return backend
    summary = " ".join((capability.__doc__ or "").split()).split(". ")[0].rstrip(".")
    raise MissingCapability(
        f"{what} needs a backend with {capability.__name__} ({summary}); the {backend.name!r} backend "
        f"does not have it. It has: {', '.join(capabilities_of(backend)) or 'no optional capability'}."
        + see("missing-capability")
    )


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
