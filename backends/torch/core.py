"""PyTorch primitives for `unified`: torch.distributed (gloo on CPU, NCCL on GPU).

`TorchBackend` joins the group and holds the arrays, RNG and training objects; the package's
other modules are mixed into it, one concern each, as in every backend: the control plane
(`backends.torch.control`), loaders and batches (`.data`), the training loop (`.loop`) and
sharded state (`.sharding`, with its file storage in `.storage`)."""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from unified.backend import ArrayCollectives, Autograd, Backend, Replaceable, TrainingObjects, WriteGuards
from unified.backend.toolkit import next_instance
from unified.errors import see
from unified.runtime.environment import ProcessEnvironment
from unified.runtime.network import route_to

from . import private
from .control import TorchControlPlane
from .data import TorchData
from .loop import PreparedScheduler, TorchTrainingLoop
from .mesh import TorchParallelism
from .sharding import TorchSharding
from .tensors import SAFETENSORS_DTYPES, export_contiguous, export_tensor, storable, tensor_from_numpy, whole_local

# How long the exit hook may spend leaving the process group (`TorchBackend._leave_at_exit`).
_LEAVE_AT_EXIT_S = 10.0


def _exiting_on_an_exception() -> bool:
    """True in an exit hook when the script ended with an uncaught exception (the interpreter
    printed it and kept it as ``sys.last_value``, ``sys.last_exc`` from Python 3.12)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _bind_gloo_to_the_route_to_the_main_process() -> None:
    """gloo binds the address its host name resolves to, a loopback address on many machines
    (which no other machine can reach): bind the interface that reaches MASTER_ADDR instead,
    unless ``GLOO_SOCKET_IFNAME`` says otherwise (see unified/runtime/network.py)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    route = route_to(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    if route is not None and route[1] is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = route[1]


class TorchBackend(TorchControlPlane, TorchData, Backend, TrainingObjects, Autograd, ArrayCollectives, WriteGuards,
                   TorchTrainingLoop, TorchSharding, TorchParallelism):
    """torch.distributed started from torchrun's environment (or one plain process); FSDP2 with
    ``Accelerator(fsdp_plugin=...)`` (see `backends.torch.sharding`)."""

    name = "torch"
    weights_metadata = {"format": "pt"}

    def save_object(self, obj: Any, path: str) -> None:
        torch.save(obj, path)  # the user asked for torch's format (Accelerate's default); loads never unpickle

    def release_device_memory(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __init__(self) -> None:
        self._group: Optional[Any] = None  # gloo group for control-plane collectives
        self._store: Optional[Any] = None
        self._owns_group = False
        self._broken = False
        self._peer_calls: Dict[str, int] = {}  # entries into `peer_errors`, per operation
        self._instance = next_instance()  # keeps the store keys of two Accelerators apart
        self._device = torch.device("cpu")
        self._staging: Optional[Any] = None  # the CUDA stream async saves copy device memory on

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float) -> None:
        env = ProcessEnvironment.from_env()
        distributed = dist.is_available() and (dist.is_initialized() or env.distributed)
        cuda = torch.cuda.is_available()
        self.local_process_index = env.local_process_index
        self.local_num_processes = env.local_num_processes
        if cuda:
            self._device = torch.device("cuda", self.local_process_index % torch.cuda.device_count())
            torch.cuda.set_device(self._device)
        if not distributed:
            return
        if not dist.is_initialized():
            _bind_gloo_to_the_route_to_the_main_process()
            dist.init_process_group(
                "nccl" if cuda else "gloo",
                timeout=datetime.timedelta(seconds=timeout),
                device_id=self._device if cuda else None,
            )
            self._owns_group = True
            atexit.register(self._leave_at_exit)
        self.process_index = dist.get_rank()
        self.num_processes = dist.get_world_size()
        self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        self._store = dist.PrefixStore("unified/", dist.distributed_c10d._get_default_store())
        self.group_distributed_type = "MULTI_GPU" if cuda else "MULTI_CPU"
        self.communication_backend = str(dist.get_backend())

    def shutdown(self) -> None:
        if self._owns_group and dist.is_initialized() and not self._broken:
            dist.destroy_process_group()
        self._owns_group = False

    def _leave_at_exit(self) -> None:
        """At exit, leave the group this backend made, as `end_training` would, while the
        interpreter is still whole. A group left to the interpreter's finalization can abort the
        process ("terminate called without an active exception": gloo's threads still hold work
        whose tensors need the GIL; pytorch/pytorch#190489). Not after an uncaught exception (a
        peer may still be inside a collective with this process, and leaving would wait for it),
        not in a broken group, and bounded: an exit never hangs here."""
        if not self._owns_group or self._broken or _exiting_on_an_exception():
            return
        leaving = threading.Thread(target=self.shutdown, name="unified-leave-group", daemon=True)
        leaving.start()
        leaving.join(_LEAVE_AT_EXIT_S)

    @property
    def device(self) -> torch.device:
        return self._device

    # -- data plane -------------------------------------------------------------------------------
    def is_array(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def all_gather_arrays(self, arrays: Sequence[Any], key: str, timeout: float) -> List[Any]:
        out = []
        for i, tensor in enumerate(arrays):
            tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
            parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
            self._wait(dist.all_gather(parts, tensor, async_op=True), f"{key}[{i}]", timeout)
            out.append(torch.cat(parts, dim=0))
        return out

    def all_reduce_arrays(self, arrays: Sequence[Any], op: str, key: str, timeout: float) -> List[Any]:
        out = []
        for i, tensor in enumerate(arrays):
            result = tensor.clone()
            self._wait(dist.all_reduce(result, op=dist.ReduceOp.SUM, async_op=True), f"{key}[{i}]", timeout)
            out.append(result)
        return out

    def broadcast_arrays(self, arrays: Sequence[Any], src: int, key: str, timeout: float) -> List[Any]:
        out = []
        for i, tensor in enumerate(arrays):
            result = tensor.clone().contiguous()
            self._wait(dist.broadcast(result, src=src, async_op=True), f"{key}[{i}]", timeout)
            out.append(result)
        return out

    def to_numpy(self, value: Any) -> np.ndarray:
        return value.detach().cpu().numpy()

    def pad_array(self, value: Any, dim: int, length: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
        shape = list(value.shape)
        shape[dim] = length - shape[dim]
        fill = value.new_full(shape, pad_index)
        return torch.cat([fill, value] if pad_first else [value, fill], dim=dim)

    def from_numpy(self, value: Any, like: Any = None) -> torch.Tensor:
        value = np.asarray(value)
        tensor = tensor_from_numpy(value if value.flags.c_contiguous and value.flags.aligned else value.copy(order="C"))
        tensor = tensor.to(like.device if like is not None else self._device)
        if getattr(like, "placements", None) is not None:  # a replicated DTensor: one again, on its mesh
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(tensor, like.device_mesh, like.placements, run_check=False)
        return tensor

    # -- RNG ----------------------------------------------------------------------------------------
    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds every CUDA generator too

    optional_rng_state = ("torch_cuda",)  # saved without a GPU: `set_rng_state` warns

    def rng_state(self) -> Dict[str, np.ndarray]:
        """The CPU generator, and the generator of this process's CUDA device (only its own:
        the other devices belong to other processes, and a restart may number them otherwise)."""
        state = {"torch_cpu": torch.get_rng_state().numpy()}
        if self._device.type == "cuda":
            state["torch_cuda"] = torch.cuda.get_rng_state(self._device).numpy()
        return state

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        """Restore what `rng_state` saved. A CUDA state (``torch_cuda``; a checkpoint of an
        older version keeps every device's as ``torch_cuda_<i>``, of which this process's own
        device's is taken) goes to this process's device; saved on CUDA and loaded without one,
        it is not needed; saved without CUDA and loaded on one, the device's generator keeps
        the seed it has (`set_seed` seeds it) and a warning says so."""
        torch.set_rng_state(torch.from_numpy(np.array(state["torch_cpu"], dtype=np.uint8)))
        if self._device.type != "cuda":
            return
        cuda = state.get("torch_cuda", state.get(f"torch_cuda_{self._device.index}"))
        if cuda is None:
            warnings.warn("this checkpoint was saved without a CUDA device: the CUDA random generator of "
                          f"{self._device} keeps its current state (random numbers drawn on the GPU, such as "
                          "dropout's, differ from an uninterrupted run)." + see("cuda-rng-not-saved"), stacklevel=2)
            return
        torch.cuda.set_rng_state(torch.from_numpy(np.array(cuda, dtype=np.uint8)), self._device)

    # -- arrays in checkpoints -------------------------------------------------------------------------
    def export_array(self, value: Any):
        return export_tensor(value)

    def describe_array(self, value: Any):
        return storable(value.dtype), tuple(value.shape)

    def writable_host_bytes(self, value: Any) -> Optional[np.ndarray]:
        """A plain tensor's (or parameter's) own bytes when it is a contiguous CPU tensor of a
        dtype checkpoints store; None for a DTensor, another device, a view with gaps."""
        if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.device.type != "cpu" \
                or not value.is_contiguous() or value.is_conj() or value.is_neg():
            return None
        try:
            return export_contiguous(value.detach())[2]
        except (TypeError, ValueError, RuntimeError):  # a dtype checkpoints do not store
            return None

    # -- training objects ------------------------------------------------------------------------------
    def prepare(self, obj: Any):
        if isinstance(obj, torch.nn.Module):
            obj = self.loop_model(obj.to(self._device))
            if self.sharding_enabled:
                obj = self.shard_model(obj)
            elif self.num_processes > 1 and not isinstance(obj, DDP):
                has_grads = any(p.requires_grad for p in obj.parameters())
                if has_grads:
                    # DistributedDataParallelKwargs
                    options = self._loop.data_parallel_options if self._loop is not None else {}
                    obj = _DistributedModel(obj, device_ids=[self._device] if self._device.type == "cuda" else None,
                                            **options)
                    obj._unified_backend = weakref.ref(self)  # a weak reference: deepcopy-safe
            self.loop_prepared_model(obj)
            return "model", obj
        if isinstance(obj, torch.optim.Optimizer):
            if self.sharding_enabled:
                self.sharded_optimizer(getattr(obj, "optimizer", obj))
            return "optimizer", self.loop_optimizer(obj)
        if (isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, PreparedScheduler))
                or type(obj).__name__ == "ReduceLROnPlateau"):
            return "scheduler", self.loop_scheduler(obj)
        if isinstance(obj, torch.amp.GradScaler):
            return "scaler", obj
        return None

    def guard_writes(self, prepared: Any, wait: Any) -> Any:
        """An async save writes straight from the live tensors; a prepared optimizer's next
        ``step()`` and a prepared model's next forward (which may update buffers such as
        BatchNorm statistics) wait until the files are written."""
        handles = []
        for kind, obj in prepared:
            if kind == "optimizer":
                handles.append(obj.register_step_pre_hook(lambda *_: wait()))
            elif kind == "model":
                handles.append(obj.register_forward_pre_hook(lambda *_: wait()))

        def release() -> None:
            for handle in handles:
                handle.remove()

        return release

    def watch_in_place_changes(self, arrays: Mapping[str, Any]) -> Any:
        """Every in-place op on a tensor (``add_`` under ``no_grad``, ``copy_``, optimizer
        steps) bumps its version counter, shared with the ``detach()``-ed views a state_dict
        holds. Edits through ``.data`` or NumPy views are invisible to it (documented)."""
        versions = [(name, tensor, private.tensor_version(tensor)) for name, tensor in arrays.items()
                    if tensor.device.type == "cpu" and tensor.is_contiguous()]  # others were copied on export
        return lambda: [name for name, tensor, version in versions if private.tensor_version(tensor) != version]

    def stage_array(self, value: Any) -> Optional[Tuple[str, Tuple[int, ...], np.ndarray]]:
        """A CUDA tensor of an async save: copied into pinned host memory on a stream of its own
        (after the work already queued, the last optimizer step included), without waiting.
        Other tensors: ``None``, exported as usual."""
        tensor = whole_local(value.detach())  # a replicated DTensor: its local tensor, as export_tensor
        if tensor.device.type != "cuda":
            return None
        storable(tensor.dtype)  # refused before any memory is pinned
        if self._staging is None:
            self._staging = torch.cuda.Stream(device=tensor.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._staging.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._staging):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._staging)  # its memory is not reused before the copy ran
        return export_contiguous(host)

    def staged(self) -> Any:
        """The training stream's next kernels (an optimizer step that changes the saved tensors
        in place) wait on the device for the copies `stage_array` queued; the host does not."""
        if self._staging is None:
            return lambda: None
        done = torch.cuda.Event()
        done.record(self._staging)
        torch.cuda.current_stream(self._device).wait_event(done)
        return done.synchronize

    def backward(self, loss: Any, **kwargs: Any) -> None:
        with self.peer_errors("backward() (the gradient all-reduce)"):
            self.loss_for_backward(loss).backward(**kwargs)

    def unwrap_model(self, model: Any, keep_compiled: bool = False) -> Any:
        """DDP, ``nn.DataParallel`` and ``torch.compile`` wrappers removed. ``keep_compiled``:
        as Accelerate's ``keep_torch_compile``, the outermost compiled wrapper is kept and its
        ``_orig_mod`` becomes the unwrapped module."""
        compiled = model if private.compiled_inner(model) is not None else None
        while isinstance(model, (DDP, torch.nn.DataParallel)) or private.compiled_inner(model) is not None:
            model = model.module if isinstance(model, (DDP, torch.nn.DataParallel)) else private.compiled_inner(model)
        if keep_compiled and compiled is not None:
            compiled._orig_mod = model
            return compiled
        return model

    def state_of(self, kind: str, obj: Any) -> Any:
        if self.sharding_enabled:
            state = self.sharded_state_of(kind, obj)
            if state is not None:
                return state
        if kind != "model":
            return obj.state_dict()
        model = self.unwrap_model(obj)
        onloaded = offloaded_state(model) if isinstance(model, torch.nn.Module) else None
        return onloaded if onloaded is not None else model.state_dict()

    def replaceable_arrays(self, kind: str, obj: Any) -> Any:
        """The tensors of a model's or optimizer's state that live on a device (a GPU) and that
        a load fills in place from a staging buffer, one after another (`_FilledOnDevice`): no
        copy of the state in host memory. CPU tensors are read in place (`writable_host_bytes`);
        sharded state goes through DCP."""
        from unified.runtime.tree import flatten

        if kind not in ("model", "optimizer") or self.sharding_enabled or self._device.type == "cpu":
            return None
        leaves, rebuild = flatten(self.state_of(kind, obj), lambda x: not isinstance(x, (dict, list, tuple)))
        return rebuild([(_FilledOnDevice(x) if _fillable_on_device(x) else None) if isinstance(x, torch.Tensor) else x
                        for x in leaves])

    def absent_group(self, kind: str, name: str) -> Optional[str]:
        """An optimizer's ``state/<parameter>``: torch's ``Optimizer.load_state_dict`` (and
        Accelerate) take a checkpoint saved before the first step, which has no state for a
        parameter, and leave the optimizer without it."""
        parts = name.split("/")
        return "/".join(parts[:2]) if kind == "optimizer" and len(parts) > 2 and parts[0] == "state" else None

    def check_loadable(self, kind: str, obj: Any, state: Any) -> None:
        """An optimizer's parameter groups must hold as many parameters as this run's, as
        ``Optimizer.load_state_dict`` requires: checked before anything is restored."""
        if kind != "optimizer" or not isinstance(state, dict):
            return
        # the live groups as they are (no state_dict of the optimizer built just to count them)
        saved, live = state.get("param_groups"), getattr(obj, "param_groups", None)
        if not (isinstance(saved, list) and isinstance(live, list)):
            return
        if len(saved) != len(live):
            raise ValueError(f"the checkpoint's optimizer has {len(saved)} parameter group(s); this run's has "
                             f"{len(live)}: it is an optimizer over other parameters")
        for index, (a, b) in enumerate(zip(saved, live)):
            if isinstance(a, dict) and isinstance(b, dict) and len(a.get("params", ())) != len(b.get("params", ())):
                raise ValueError(f"parameter group {index} holds {len(a.get('params', ()))} parameters in the "
                                 f"checkpoint; this run's optimizer has {len(b.get('params', ()))} there: it is an "
                                 "optimizer over other parameters")

    def load_state_into(self, kind: str, obj: Any, state: Any) -> None:
        """``state`` holds NumPy views of private memory that holds nothing else (see
        `safetensors_io.read`): a model's ``load_state_dict`` copies them into its parameters;
        every other object (an optimizer keeps the tensors it is given) takes them over as
        tensors, without a copy (a copy only where an array is not aligned for its dtype)."""
        from unified.runtime.tree import flatten

        leaves, rebuild = flatten(state, lambda x: not isinstance(x, (dict, list, tuple)))
        tensors = [tensor_from_numpy(x if x.flags.aligned else x.copy()) if isinstance(x, np.ndarray) else x
                   for x in leaves]
        if self.sharding_enabled and self.sharded_load_state_into(kind, obj, rebuild(tensors)):
            return
        target = self.unwrap_model(obj) if kind == "model" else obj
        if kind == "model" and _take_over(target, rebuild(tensors)):
            return
        target.load_state_dict(rebuild(tensors))


class _DistributedModel(DDP):
    """DDP whose forward (buffer broadcast) reports a lost peer as a `DistributedError`."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        backend = self._unified_backend()
        if backend is None:
            return super().forward(*args, **kwargs)
        with backend.peer_errors("the model's forward (DDP's buffer broadcast)"):
            return super().forward(*args, **kwargs)


# `_load_from_state_dict`s that only copy (BatchNorm's also fills in a missing
# num_batches_tracked of old checkpoints, which an exact key match rules out)
_PLAIN_LOADS = {torch.nn.Module._load_from_state_dict, torch.nn.modules.batchnorm._NormBase._load_from_state_dict}


class _FilledOnDevice(Replaceable):
    """A tensor on a device that a load fills in place from host bytes (`replaceable_arrays`)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def current(self) -> torch.Tensor:
        return self._tensor

    def replace(self, host: np.ndarray) -> None:
        source = torch.from_numpy(host.reshape(-1).view(np.uint8))
        with torch.no_grad():  # from pageable memory: the copy is done when copy_ returns
            self._tensor.view(-1).view(torch.uint8).copy_(source)

    @property
    def copies_while_reading(self) -> bool:
        return self._tensor.device.type == "cuda"

    def staging_buffer(self, nbytes: int) -> Optional[np.ndarray]:
        """Pinned host memory on CUDA (a copy from it runs without the host waiting); else None."""
        if self._tensor.device.type != "cuda":
            return None
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()  # the array keeps the tensor

    def replace_async(self, host: np.ndarray) -> Any:
        """On CUDA: the copy queued on this device's copy stream, after the work already queued
        on the current one (which may still use the tensor), and that stream's later work queued
        after the copy; returns the wait for the copy (the load calls it before it reuses
        ``host`` and before it returns). Elsewhere: `replace`."""
        if self._tensor.device.type != "cuda":
            self.replace(host)
            return None
        device = self._tensor.device
        copying, current = _copy_stream(device), torch.cuda.current_stream(device)
        copying.wait_stream(current)
        source = torch.from_numpy(host.reshape(-1).view(np.uint8))
        with torch.no_grad(), torch.cuda.stream(copying):
            self._tensor.view(-1).view(torch.uint8).copy_(source, non_blocking=True)
        self._tensor.record_stream(copying)  # its memory is not reused before the copy ran
        copied = torch.cuda.Event(blocking=True)  # the wait sleeps rather than spins: the reads need the cores
        copied.record(copying)
        current.wait_event(copied)
        return copied.synchronize


_COPY_STREAMS: Dict[int, Any] = {}  # device index -> the stream a load's host-to-device copies run on
_COPY_STREAMS_MADE = threading.Lock()  # files are read side by side, on threads of their own


def _copy_stream(device: torch.device) -> Any:
    with _COPY_STREAMS_MADE:
        if device.index not in _COPY_STREAMS:
            _COPY_STREAMS[device.index] = torch.cuda.Stream(device=device)
        return _COPY_STREAMS[device.index]


def _fillable_on_device(tensor: torch.Tensor) -> bool:
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type not in ("cpu", "meta")
            and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
            and tensor.dtype in SAFETENSORS_DTYPES)


def _take_over(module: torch.nn.Module, state: Mapping[str, Any]) -> bool:
    """Give each parameter and buffer of ``module`` the verified tensor of ``state`` as its
    storage (``.data``), instead of copying it in: the Parameter objects (which optimizers and
    DDP hold) stay the same. Only for plain modules whose state ``state`` matches key for key,
    with CPU tensors of the same dtype and shape that are not views; otherwise returns False and
    nothing changed, and ``load_state_dict`` copies as usual."""
    if any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks
           or type(m)._load_from_state_dict not in _PLAIN_LOADS for m in module.modules()):
        return False
    live = module.state_dict(keep_vars=True)
    if live.keys() != state.keys():
        return False
    for key, current in live.items():
        new = state[key]
        if not (isinstance(current, torch.Tensor) and isinstance(new, torch.Tensor) and current.device.type == "cpu"
                and current.dtype == new.dtype and current.shape == new.shape and current._base is None
                and current.layout == torch.strided and current.is_contiguous() and new.is_contiguous()):
            return False
    with torch.no_grad():
        for key, current in live.items():
            current.data = state[key]
    return True


# Models that Accelerate's big-model utilities (``load_checkpoint_and_dispatch``, ``cpu_offload``) left
# on the meta device, their weights held by ``AlignDevicesHook``s: read by onloading one module at a
# time, as Accelerate's ``save_model`` does (only such a model brings Accelerate's code in here).
def _offloaded(module: torch.nn.Module) -> bool:
    hook = getattr(module, "_hf_hook", None)
    return hook is not None and bool(getattr(hook, "offload", False))


def offloaded_state(model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """The model's full state on the CPU when some of its modules are offloaded by Accelerate's
    hooks (each module's weights brought back in turn); None for any other model. A model with
    parameters on the meta device and no offload hook is an error: there are no weights to save."""
    if any(_offloaded(module) for module in model.modules()):
        from accelerate.utils.modeling import get_state_dict_offloaded_model

        return get_state_dict_offloaded_model(model)
    meta = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise RuntimeError(
            f"Cannot read the weights of this model: {len(meta)} parameter(s) are on the meta device and no offload "
            f"hook holds their values (first: {meta[0]!r}). Load the weights first (e.g. "
            "accelerate.load_checkpoint_and_dispatch, or model.to_empty(device=...) and load_state_dict)."
            + see("meta-device-model"))
    return None
