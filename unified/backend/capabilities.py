"""What a backend may opt into: the optional capabilities beside `Backend` (the required core,
in `unified.backend.base`).

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
import contextlib
import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import MissingCapability, see
from .base import Backend, Exported, FileHashes, HealthChannel, check_backend_class

__all__ = [
    "Backend", "TrainingObjects", "Autograd", "KeyStream", "DeviceMesh", "ArrayCollectives",
    "ShardedArrays", "ShardedLoad", "ShardedRead", "ShardedWrite", "WriteGuards", "ForeignLoaders", "TrainingLoop",
    "CAPABILITIES",
    "Replaceable", "DeferredArray", "HealthChannel", "Exported", "FileHashes", "check_backend_class",
]


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

    @property
    def copies_while_reading(self) -> bool:
        """Whether `replace_async` returns before its copy is done (a torch tensor on a GPU), so
        that a load reads and hashes the next array into a second staging buffer while this one's
        copy runs. False (the default): one staging buffer, each array handed off by `replace`."""
        return False

    def replace_async(self, host: Any) -> Optional[Callable[[], None]]:
        """Start making the object hold ``host``'s values, as `replace` does, without waiting for
        the copy: returns a function that waits until ``host``'s memory is no longer read (the
        load writes the next array there after it), or None when the copy is done already. The
        default is `replace`, which copies before it returns. Asked for only where
        `copies_while_reading`; ``host`` then lies in memory of `staging_buffer` when it gave some.

        Example:
            >>> wait = handle.replace_async(staging[:nbytes].view(dtype).reshape(shape))
            >>> ...                                  # read and hash the next array into the other buffer
            >>> if wait is not None:
            ...     wait()                           # before ``staging`` is written again
        """
        self.replace(host)
        return None

    def staging_buffer(self, nbytes: int) -> Any:
        """A writable uint8 NumPy array of ``nbytes`` from which `replace_async` copies without
        waiting (page-locked host memory on CUDA), or None (the default): the load then makes
        ordinary memory (`safetensors_io.private_array`). Asked twice per file, for the largest of
        its arrays that `copies_while_reading`: the two buffers take turns.

        Example:
            >>> staging = handle.staging_buffer(64 << 20)   # torch on CUDA: pinned memory
            >>> staging.dtype, staging.nbytes
            (dtype('uint8'), 67108864)
        """
        return None

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
    Returned by `ShardedArrays.load_sharded` when asked to defer (`ShardedLoad.defer`).

    Example:
        >>> read = backend.load_sharded(url, like, ShardedLoad(hash_files=True, defer=True, copy_to=local_copy))
        >>> handle.adopt(read.arrays["a0"].make())
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


@dataclasses.dataclass(frozen=True)
class ShardedLoad:
    """What the manager asks of one `ShardedArrays.load_sharded`. Each option is a request: a
    reader that does not honour one reads the plain way and says so in its `ShardedRead`.

    ``hash_files``: nothing was checked before the read (a backend with ``hashes_while_reading``,
    or an object store): read into fresh arrays that nothing else holds, and report the size
    and xxh3 of each file read whole, hashed in the same pass (`ShardedRead.hashes`). The
    manager compares those with the manifest and hashes every other file before anything is
    restored. Without it, every file was checked before the call.

    ``defer``: a load in bounded memory. The reader may return `DeferredArray`s (nothing read
    into an array yet; with ``hash_files`` the files hashed now), which the manager makes and
    puts in place (`Replaceable.adopt`, or filled in place) one at a time once every check
    passed, in ``like``'s order (a reader whose reads are collectives may group them by it).

    ``copy_to``: given with ``defer`` on an object store only: ``copy_to(url, size)`` names a new
    file in a private local folder where an object read whole may be streamed (or None: no room).

    ``hash_when_placed``: with ``defer`` and ``hash_files``: one pass. The reader need not hash
    the files it reads whole now: `DeferredArray.make` may read them straight into place,
    hashing them as it goes (no local copy on a store). It names those files in
    `ShardedRead.hashed_later` and gives their hashes through `ShardedRead.later_hashes` once
    the arrays were made; the manager compares them then (a mismatch leaves the objects holding
    part of the checkpoint, as any load that hashes as it places).

    ``adopt_early(key, array)``: given with ``hash_when_placed``, only called from within a
    `DeferredArray.make`. A reader that streams a file holding several arrays in its own order
    (not ``like``'s) hands each array over as soon as it is whole: the manager puts it in place
    of the live one at once where it can, so that the arrays made before they are asked for do
    not pile up beside the live state. ``make`` later returns the same array.

    Example:
        >>> backend.load_sharded(root, like, ShardedLoad(hash_files=True))
    """

    hash_files: bool = False
    defer: bool = False
    copy_to: Optional[Callable[[str, int], Optional[str]]] = None
    hash_when_placed: bool = False
    adopt_early: Optional[Callable[[str, Any], None]] = None


@dataclasses.dataclass(frozen=True)
class ShardedRead:
    """What one `ShardedArrays.load_sharded` read: ``arrays`` (name -> array placed like
    ``like``'s, or `DeferredArray`) and ``hashes``, the size and xxh3 of each file read whole
    and hashed in the same pass (empty: none, the manager hashes them all itself; ignored
    unless `ShardedLoad.hash_files`).

    Example:
        >>> ShardedRead({"a0": array}).deferred      # the plain read: nothing hashed, nothing deferred
        False
    """

    arrays: Dict[str, Any]
    hashes: FileHashes = dataclasses.field(default_factory=dict)
    # `ShardedLoad.hash_when_placed`: the files hashed only as `make` reads them into place, and
    # their hashes once every deferred array was made (a file no array was made from is absent)
    hashed_later: Tuple[str, ...] = ()
    later_hashes: Callable[[], FileHashes] = dict

    @property
    def deferred(self) -> bool:
        """Whether any array is a `DeferredArray`, made later by the manager."""
        return any(isinstance(value, DeferredArray) for value in self.arrays.values())


class ShardedArrays(abc.ABC):
    """Arrays whose parts live on several processes: every process writes its own part into
    ``sharded.<sharded_format>/`` of a checkpoint (a collective), listed in the manifest, and
    reads it back with one method, `load_sharded`, whose `ShardedLoad` options it may ignore.

    Checksums: the manager hashes every file of that folder unless the backend reports their
    hashes, computed in the pass that wrote or read the bytes (`FileHashes`, names relative to
    the folder): `save_sharded` may return those of the files this process wrote, and a backend
    with ``hashes_while_reading`` is asked for those of the files it read whole
    (`ShardedLoad.hash_files`; the manager then only checks the files' sizes before the read);
    the manager compares them with the manifest before anything is restored.

    Object stores: a backend with ``sharded_to_store`` is given an object store's URL as
    ``directory`` as well (``s3://…/sharded.<format>``): it writes and reads there through
    `unified.checkpoint.store` (``location_of(url).write`` streams and hashes each file;
    ``ObjectStore.files / read_range / reading`` for its reader), reports the hashes of every
    file it wrote, makes no folder, and is always read with ``hash_files`` (whatever its
    ``hashes_while_reading``, which is about folders). Without it, `save_state` to a store
    refuses sharded state before anything is written.

    A backend with ``reads_without_counterpart`` takes ``None`` in ``like`` for an array of the
    checkpoint that this run's object lacks (an optimizer before its first step: torch's holds
    no state yet, or keys it otherwise) and reads it whole, as the checkpoint describes it;
    without it, such a checkpoint is refused (``sharded-no-counterpart``).

    Example (a reader without hashing or bounded reads: the options are requests):
        >>> def load_sharded(self, directory, like, options):
        ...     return ShardedRead({key: my_read(directory, key, value) for key, value in like.items()})
    """

    sharded_format: str = "sharded"
    hashes_while_reading: bool = False
    sharded_to_store: bool = False
    reads_without_counterpart: bool = False

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
    def load_sharded(self, directory: str, like: Mapping[str, Any], options: ShardedLoad) -> ShardedRead:
        """Read what `save_sharded` wrote, placed like the arrays in ``like``; a collective unless
        the reader is not one (a hashing reader should not be: its failure is this process's
        alone, and the manager shares it in its next exchange). ``options`` (`ShardedLoad`) asks
        for hashes of the files read whole and for a load in bounded memory; a reader that offers
        neither returns ``ShardedRead(arrays)`` and the manager does the rest (hashes every file,
        holds the arrays whole until they are restored)."""


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

    def sync_in_backward(self, model: Any) -> Any:
        """A context in which the next backward synchronises ``model``'s gradients even inside
        `no_sync` (``accelerator.trigger_sync_in_backward``); a no-op context where gradients
        are not synchronised by the backward."""
        return contextlib.nullcontext()

    def join_uneven_inputs(self, joinables: Any) -> Any:
        """A context in which processes that ran out of batches shadow the gradient collectives
        of those still training (torch's ``Join`` over the prepared ``joinables``, for
        ``accelerator.join_uneven_inputs``); a no-op context where batches are always even."""
        return contextlib.nullcontext()

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
