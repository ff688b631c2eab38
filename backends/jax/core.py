"""JAX primitives for `unified`: jax.distributed with timeouts through the coordination service.

Control-plane collectives (barrier, flags, small bytes) go through the coordination service's
barrier and key-value store, which take deadlines; device collectives cannot time out, so the
array collectives are preceded by a timed barrier. ``jax_enable_recoverability`` is switched on
before joining, so that a dead peer gives survivors an exception instead of aborting them.

`JaxBackend` joins the group and holds the arrays, the key stream and training objects; the
package's other modules are mixed into it, one concern each, as in every backend: the control
plane (`backends.jax.control`), loaders and batches (`.data`), the training loop (`.loop`) and
sharded state (`.sharding`, with its file storage in `.storage`).
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from unified.backend import ArrayCollectives, Backend, DeviceMesh, KeyStream, Replaceable, TrainingObjects
from unified.backend.toolkit import keep_alive_forever, next_instance
from unified.errors import DistributedError, see
from unified.runtime.environment import ProcessEnvironment, cluster_local_process, local_device_share, visible_gpus
from unified.runtime.libc import return_free_heap
from unified.runtime.network import route_to

from . import private
from .control import JaxControlPlane, _Caller
from .data import JaxData
from .loop import JaxTrainingLoop
from .mesh import JaxParallelism
from .sharding import JaxSharding
from .tensors import check_like, host_copy, is_global, is_key, local_value, place, reshard, shares_memory

_PREFIX = "unified/"


def _local_announced() -> bool:
    """True when a launcher set this process's local index (ours, or torchrun's convention)."""
    return any(os.environ.get(name, "").strip().isdigit() for name in ("UNIFIED_LOCAL_PROCESS_ID", "LOCAL_RANK"))


def _detach_runtime() -> None:
    """Leave the coordination service without its shutdown RPCs.

    In recoverable mode JAX's shutdown has no barrier, so whichever process hosts the service
    may exit first; another process's ``client.shutdown()`` then finds no service and the
    runtime aborts it (SIGABRT). We already met every peer at a timed barrier (end_training),
    or the group is broken, so we drop JAX's handles instead and keep them referenced forever
    so that no destructor runs the RPCs at exit either.
    """
    private.detach_runtime(keep_alive_forever)


class JaxBackend(JaxControlPlane, JaxData, Backend, TrainingObjects, KeyStream, DeviceMesh, ArrayCollectives,
                 JaxTrainingLoop, JaxSharding, JaxParallelism):
    """jax.distributed started from the launcher's variables, JAX's cluster detection, or alone."""

    name = "jax"
    group_distributed_type = "JAX"
    immutable_arrays = True
    uneven_batches = False  # a step's batches are one global jax.Array
    sharded_format = "orbax"

    def __init__(self) -> None:
        self._client: Any = None
        self._owns_runtime = False
        self._external_service = False
        self._stale_keys: List[str] = []
        self._calls: Optional[_Caller] = None
        self._timeout = 60.0
        self._flag_primed = False
        self._key_seed = 0
        self._key_counter = 0
        self._mesh: Any = None
        self._shard_plugin: Any = None  # set by configure_sharding: prepare shards instead of replicating
        self._prefix = f"{_PREFIX}{next_instance()}/"

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float) -> None:
        self._timeout = timeout
        env = ProcessEnvironment.from_env()
        address = env.coordinator
        if private.coordination_client() is None and (address or private.cluster_detected()):
            private.configure_recoverable_group()
            kwargs: Dict[str, Any] = {"initialization_timeout": int(max(30, min(timeout, 600)))}
            if address:
                kwargs.update(coordinator_address=address, num_processes=env.num_processes,
                              process_id=env.process_index)
                kwargs["coordinator_bind_address"] = address  # not every interface
                # The launcher gave every value: no cluster detection, whose SLURM reading would
                # still restrict each process to the GPU numbered SLURM_LOCALID (jax >= 0.5).
                kwargs["cluster_detection_method"] = "deactivate"
                share = local_device_share(env.local_process_index, env.local_num_processes, visible_gpus())
                if share is not None:  # several processes on this machine: each its own GPUs
                    kwargs["local_device_ids"] = share
            self._external_service = env.service_hosted
            try:
                with private.no_service_here(self._external_service):
                    jax.distributed.initialize(**kwargs)
            except RuntimeError as err:
                raise DistributedError(
                    f"Could not join the JAX process group ({err}). Create the Accelerator before any "
                    "JAX computation, and check that every process got the same coordinator address."
                    + see("jax-join-failed")
                ) from err
            self._owns_runtime = True
            atexit.register(self.shutdown)  # runs before JAX's own exit hook (LIFO)
        self._client = private.coordination_client()
        route = route_to(address.rsplit(":", 1)[0]) if address else None
        with private.gloo_bound_to(route[0] if route else None):  # the CPU client is made here
            self.process_index = jax.process_index()
        self.num_processes = jax.process_count()
        if self.num_processes > 1:
            self.communication_backend = "jax.distributed"
        self.local_process_index = env.local_process_index
        self.local_num_processes = env.local_num_processes
        if self._owns_runtime and not address:  # joined through JAX's cluster detection (SLURM, Open MPI)
            local = cluster_local_process()
            if local is not None and not _local_announced():
                self.local_process_index, self.local_num_processes = local

    def shutdown(self) -> None:
        """Leave the group. The launcher's service outlives us, so a normal goodbye is safe. When
        process 0 hosts the service (JAX's cluster detection, e.g. srun), every other process
        says goodbye while process 0 waits for them; only then does process 0 leave. Otherwise
        its exit would close the service under a peer that is still running, and JAX's error
        poller aborts that peer (SIGABRT)."""
        if not self._owns_runtime:
            return
        self._owns_runtime = False
        if self._external_service or self.process_index != 0:
            try:
                jax.distributed.shutdown()
            except Exception:
                _detach_runtime()
            return
        self._wait_for_peers_to_leave()
        _detach_runtime()

    def _wait_for_peers_to_leave(self) -> None:
        """Process 0 with the service: return once every other process has disconnected (or
        after the timeout). ``get_live_nodes`` answers only when each listed process has either
        called it too or left the service, which is what we wait for."""
        if self.num_processes == 1 or self._client is None:
            return
        if self._calls is None:
            self._calls = _Caller()
        try:
            self._calls.call(lambda: self._client.get_live_nodes(list(range(self.num_processes))), self._timeout)
        except Exception:  # noqa: BLE001 - a broken group: leave anyway, nobody is left to protect
            pass

    @property
    def device(self) -> Any:
        return jax.local_devices()[0]

    # -- data plane -------------------------------------------------------------------------------
    def is_array(self, value: Any) -> bool:
        return isinstance(value, jax.Array)

    def _gathered(self, arrays: Sequence[Any], key: str, timeout: float, tiled: bool) -> List[np.ndarray]:
        self.barrier(f"{key} (arrival)", timeout)  # device collectives cannot time out: meet first
        return [np.asarray(multihost_utils.process_allgather(local_value(a), tiled=tiled)) for a in arrays]

    def all_gather_arrays(self, arrays: Sequence[Any], key: str, timeout: float) -> List[Any]:
        arrays = [a.reshape(1) if a.ndim == 0 else a for a in arrays]
        return [jnp.asarray(g) for g in self._gathered(arrays, key, timeout, tiled=True)]

    def all_reduce_arrays(self, arrays: Sequence[Any], op: str, key: str, timeout: float) -> List[Any]:
        return [jnp.asarray(g.sum(axis=0)) for g in self._gathered(arrays, key, timeout, tiled=False)]

    def broadcast_arrays(self, arrays: Sequence[Any], src: int, key: str, timeout: float) -> List[Any]:
        return [jnp.asarray(g[src]) for g in self._gathered(arrays, key, timeout, tiled=False)]

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(jax.device_get(value))

    def pad_array(self, value: Any, dim: int, length: int, pad_index: Any, pad_first: bool) -> Any:
        value = jnp.asarray(local_value(value)) if not value.is_fully_addressable else value
        widths = [(0, 0)] * value.ndim
        extra = length - value.shape[dim]
        widths[dim] = (extra, 0) if pad_first else (0, extra)
        return jnp.pad(value, widths, constant_values=pad_index)

    def from_numpy(self, value: Any, like: Any = None) -> Any:
        return jnp.asarray(value)

    # -- RNG: the Accelerator's key stream ------------------------------------------------------------
    def seed(self, seed: int) -> None:
        self._key_seed = int(seed)
        self._key_counter = 0

    def next_key(self) -> Any:
        """A fresh `jax.random` key: the stream's seed folded with a counter."""
        key = jax.random.fold_in(jax.random.key(self._key_seed), self._key_counter)
        self._key_counter += 1
        return key

    def rng_state(self) -> Dict[str, np.ndarray]:
        return {"jax_key_stream": np.array([self._key_seed, self._key_counter], dtype=np.int64)}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        self._key_seed, self._key_counter = (int(v) for v in np.asarray(state["jax_key_stream"]))

    # -- arrays in checkpoints -------------------------------------------------------------------------
    def begin_host_copies(self, values: Sequence[Any]) -> None:
        # a save exports its arrays one by one (`host_copy`: device_get each); on a GPU that is
        # one transfer after another unless every copy has begun first
        for value in values:
            if not isinstance(value, jax.Array) or is_key(value):
                continue
            if not value.is_fully_addressable:
                if not value.is_fully_replicated:
                    continue
                value = value.addressable_shards[0].data
            if any(device.platform != "cpu" for device in value.devices()):
                value.copy_to_host_async()

    def export_array(self, value: Any):
        from unified.checkpoint.safetensors_io import export_numpy

        return export_numpy(host_copy(value))

    def describe_array(self, value: Any):
        from unified.checkpoint.safetensors_io import safetensors_dtype

        if is_key(value):
            value = jax.eval_shape(jax.random.key_data, value)
        return safetensors_dtype(np.dtype(value.dtype)), tuple(value.shape)

    # -- training objects ------------------------------------------------------------------------------
    @property
    def mesh(self) -> Any:
        """A 1-D data-parallel mesh over every process's devices, axis ``"data"``; with a
        `unified.ParallelismConfig`, its named mesh (`backends.jax.mesh`)."""
        if self._mesh is None:
            from jax.sharding import Mesh

            self._mesh = Mesh(np.array(jax.devices()), ("data",))
        return self._mesh

    def full_array(self, value: Any, key: str, timeout: float) -> np.ndarray:
        """The whole of one array on every process: an array split across processes is gathered
        (all processes meet at a timed barrier first: the gather itself cannot time out)."""
        if is_key(value):
            value = jax.random.key_data(value)
        if not is_global(value) or value.is_fully_replicated:
            return host_copy(value)
        self.barrier(f"{key} (arrival)", timeout)
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))

    def prepare(self, obj: Any):
        from flax import nnx

        if isinstance(obj, nnx.Optimizer):
            kind = "optimizer"
        elif isinstance(obj, nnx.Module):
            kind = "model"
        else:
            return None
        current = nnx.state(obj).to_pure_dict()
        leaves, treedef = jax.tree_util.tree_flatten(current)
        # Arrays already split across processes (a model built sharded) are resharded as they are;
        # every other leaf starts from process 0's values on every process, as DDP does.
        # One process: its arrays are placed as they are (`_write_back`: no copy, and the memory
        # stays XLA's own, which a load may then write in place: `_Slot.writable_in_place`).
        local = [i for i, leaf in enumerate(leaves) if not is_global(leaf)
                 and (self.num_processes > 1 or not isinstance(leaf, jax.Array) or is_key(leaf))]
        host = [host_copy(leaves[i]) for i in local]
        if self.num_processes > 1:
            self.barrier(f"prepare {kind} (arrival)", 600.0)
            host = [np.asarray(h) for h in multihost_utils.broadcast_one_to_all(host)]
        for i, value in zip(local, host):
            leaves[i] = value
        self._write_back(obj, current, jax.tree_util.tree_unflatten(treedef, leaves), self._placement(obj))
        if kind == "model":
            self.loop_model(obj)
        else:
            self.loop_optimizer(obj)
        return kind, obj

    def _placement(self, obj: Any):
        """``(like, path) -> sharding`` of every leaf of a prepared object: replicated, or with a
        plugin split over the mesh by `backends.jax.sharding`'s rule."""
        from jax.sharding import NamedSharding, PartitionSpec

        replicated = NamedSharding(self.mesh, PartitionSpec())
        if self._parallel_config is not None:  # a ParallelismConfig: the annotations name its axes
            from .sharding import annotations

            return self.parallel_placement(annotations(obj))
        if self._shard_plugin is None:
            return lambda like, path: replicated
        from .sharding import annotations, partition_spec

        annotated, devices = annotations(obj), self.mesh.devices.size

        def sharding_of(like: Any, path: Tuple[Any, ...]) -> Any:
            if is_key(like) or not hasattr(like, "shape"):
                return replicated
            return NamedSharding(self.mesh, partition_spec(tuple(like.shape), devices, annotated.get(path)))

        return sharding_of

    def state_of(self, kind: str, obj: Any) -> Any:
        from flax import nnx

        if kind in ("model", "optimizer"):
            return nnx.state(obj).to_pure_dict()
        return obj.state_dict()

    def replaceable_arrays(self, kind: str, obj: Any) -> Any:
        """The Variables of a prepared model or optimizer, as handles a load replaces one array
        at a time (`_Slot`); typed PRNG keys are left out (a load makes them from fresh memory)."""
        from flax import nnx

        if kind not in ("model", "optimizer"):
            return None

        handover = _Handover()

        def slot(variable: Any) -> Optional[_Slot]:
            value = variable.get_value() if isinstance(variable, nnx.Variable) else None
            return _Slot(variable, handover) if isinstance(value, jax.Array) and not is_key(value) else None

        return nnx.to_pure_dict(nnx.state(obj), extract_fn=slot)

    def load_state_into(self, kind: str, obj: Any, state: Any) -> None:
        from flax import nnx

        if kind not in ("model", "optimizer"):
            obj.load_state_dict(state)
            return
        current = nnx.state(obj).to_pure_dict()
        self._write_back(obj, current, state, lambda like, path: like.sharding)

    def _write_back(self, obj: Any, current: Any, values: Any, sharding_of) -> None:
        """Put ``values`` (same tree as ``current``; host arrays, or global arrays such as Orbax
        restores) into ``obj`` in place, leaf by leaf, each placed as ``sharding_of(like, path)``."""
        from flax import nnx

        def merge(like: Any, value: Any, path: Tuple[Any, ...]) -> Any:
            if isinstance(like, dict):
                if not isinstance(value, dict) or set(like) != set(value):
                    got = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
                    where = "/".join(map(str, path)) or "state"
                    raise ValueError(f"{where}: expected keys {sorted(map(str, like))}; found {got}")
                return {k: merge(like[k], value[k], path + (k,)) for k in like}
            sharding = sharding_of(like, path)
            if isinstance(value, jax.Array):  # restored by Orbax, replaced by a load (`_Slot`), or built so
                check_like(value, like, "/".join(map(str, path)))
                return value if value.sharding == sharding else reshard(value, sharding)
            return place(np.asarray(value), like, sharding, "/".join(map(str, path)))

        state = nnx.state(obj)
        nnx.replace_by_pure_dict(state, merge(current, values, ()))
        nnx.update(obj, state)


class _Handover:
    """The arrays of one object's Variables that a load on the CPU may write in place, handed to
    new arrays of the same memory (XLA's donation) in one call the first time a slot asks
    (`_Slot.writable_in_place`), once every check of the load passed."""

    def __init__(self) -> None:
        self._slots: List["_Slot"] = []
        self._owned: Optional[Dict[int, Any]] = None

    def add(self, slot: "_Slot") -> None:
        self._slots.append(slot)

    def owned(self, slot: "_Slot") -> Optional[Any]:
        """``slot``'s array if it now owns its memory alone, else None."""
        if self._owned is None:
            self._owned = self._hand_over()
        return self._owned.get(id(slot))

    def _hand_over(self) -> Dict[int, Any]:
        from unified.checkpoint.manager import in_place_min_bytes

        least, shared = in_place_min_bytes(), _shared_memory()
        chosen: List[Tuple["_Slot", Any]] = []
        for slot in self._slots:
            value = slot.current()
            # the Variable's reference, ``value`` and getrefcount's own: any more, and something else
            # can see this array (the script kept it, another Variable holds it): it is replaced
            if (_plain_cpu_array(value) and value.nbytes >= least and sys.getrefcount(value) <= 3
                    and shared.get(value.unsafe_buffer_pointer(), set()) <= _own_ids(value)):
                chosen.append((slot, value))
            del value
        if not chosen:
            return {}
        try:  # each new array has the old one's memory unless a NumPy view or a foreign owner holds it: then a copy
            handed = _donating_identity(len(chosen))(*(value for _, value in chosen))
            jax.block_until_ready(handed)
        except Exception:  # noqa: BLE001 - not donatable here: replaced the ordinary way
            return {}
        owned = {}
        for (slot, _), new in zip(chosen, handed):
            slot._variable.set_value(new)
            if _plain_cpu_array(new):
                owned[id(slot)] = new
        return owned


def _shared_memory() -> Dict[int, set]:
    """The ids of this process's live single-device CPU arrays by the address of their memory
    (`jax.device_put` to the same device makes a second array over the first one's)."""
    table: Dict[int, set] = {}
    for array in jax.live_arrays("cpu"):
        if not array.is_deleted() and len(array.sharding.device_set) == 1:
            table.setdefault(array.unsafe_buffer_pointer(), set()).add(id(array))
    return table


def _own_ids(value: Any) -> set:
    """``value`` and the per-device arrays it is made of (JAX keeps them as arrays of their own)."""
    return {id(value)} | {id(part) for part in getattr(value, "_arrays", ())}


class _Slot(Replaceable):
    """A Variable of a prepared object whose array a load replaces (`JaxBackend.replaceable_arrays`)."""

    def __init__(self, variable: Any, handover: Optional[_Handover] = None) -> None:
        self._variable = variable
        self._handover = handover or _Handover()
        self._handover.add(self)

    def current(self) -> Any:
        return self._variable.get_value()

    @property
    def keeps_host(self) -> bool:
        # on the CPU, XLA makes the array over ``host``'s memory (aligned) instead of copying it
        return all(device.platform == "cpu" for device in self._variable.get_value().sharding.device_set)

    def replace(self, host: np.ndarray) -> None:
        like = self._variable.get_value()
        new = place(host, like, like.sharding, type(self._variable).__name__)
        new.block_until_ready()  # the copy from ``host`` is done (a device's): the caller reuses its memory next
        if not self.keeps_host and shares_memory(new, host):  # aliased a buffer the caller reuses: a copy of its own
            new = place(np.array(host, copy=True), like, like.sharding, type(self._variable).__name__)
        self._variable.set_value(new)  # the old array is freed here unless the script holds it
        if all(device.platform == "cpu" for device in new.devices()):
            _freed(host.nbytes)

    @property
    def copies_while_reading(self) -> bool:
        # on a GPU the transfer from ``host`` runs while the load reads and hashes the next array
        return not self.keeps_host

    def replace_async(self, host: np.ndarray) -> Optional[Callable[[], Any]]:
        """The new array made from ``host`` and put in the Variable at once; returns its wait
        (the transfer from ``host`` done), which the load calls before it reuses ``host``. An
        array made over ``host`` itself (the CPU) gets a copy of its own first."""
        like = self._variable.get_value()
        new = place(host, like, like.sharding, type(self._variable).__name__)
        if shares_memory(new, host):
            new.block_until_ready()
            new = place(np.array(host, copy=True), like, like.sharding, type(self._variable).__name__)
        del like
        self._variable.set_value(new)  # the old array is freed here unless the script holds it
        return new.block_until_ready

    def writable_in_place(self) -> Optional[np.ndarray]:
        owned = self._handover.owned(self)
        return None if owned is None else np.asarray(_HostBytes(owned))

    def adopt(self, value: Any) -> None:
        like = self._variable.get_value()
        check_like(value, like, type(self._variable).__name__)
        if value.sharding != like.sharding:  # the reader places it as `like` was
            raise ValueError(f"{type(self._variable).__name__}: the new array is not placed like the current one."
                             + see("placing-failed"))
        del like
        self._variable.set_value(value)  # the old array is freed here unless the script holds it
        if all(device.platform == "cpu" for device in value.devices()):
            _freed(sum(shard.data.nbytes for shard in value.addressable_shards))


@functools.lru_cache(maxsize=None)
def _donating_identity(count: int) -> Any:
    return jax.jit(lambda *values: values, donate_argnums=tuple(range(count)))


def _plain_cpu_array(value: Any) -> bool:
    """A committed-or-not `jax.Array` on one CPU device, dense and row-major (its bytes are the
    safetensors entry's, at `unsafe_buffer_pointer`)."""
    if not isinstance(value, jax.Array) or is_key(value) or value.is_deleted():
        return False
    devices = value.sharding.device_set
    if len(devices) != 1 or next(iter(devices)).platform != "cpu" or value.nbytes == 0:
        return False
    try:
        layout = value.format.layout
        row_major = tuple(layout.major_to_minor) == tuple(range(value.ndim))
    except Exception:  # noqa: BLE001 - no layout to ask: only the size says it is dense
        row_major = True
    return row_major and value.on_device_size_in_bytes() == value.nbytes


class _HostBytes:
    """The bytes of a CPU array as a writable NumPy uint8 array (``np.asarray``), which keeps the
    array alive as its base."""

    def __init__(self, array: Any) -> None:
        self.array = array
        self.__array_interface__ = {"data": (array.unsafe_buffer_pointer(), False), "shape": (array.nbytes,),
                                    "typestr": "|u1", "version": 3}


# glibc keeps the replaced CPU arrays' memory in its heaps instead of handing it back or reusing
# all of it: measured, a load then held about as much as a second copy of the state at its peak.
# Handing it back every `_TRIM_EVERY` bytes replaced bounds that: 1.5 GB state, 130-145 MB beyond
# the live state (32 MiB: 98-124 MB but 0.3 s slower, the new arrays touching fresh pages; 128
# MiB: 210-225 MB).
_TRIM_EVERY = 64 << 20
_since_trim = 0


def _freed(nbytes: int) -> None:
    global _since_trim
    _since_trim += nbytes
    if _since_trim >= _TRIM_EVERY:
        _since_trim = 0
        return_free_heap()
