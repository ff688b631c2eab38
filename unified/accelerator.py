"""The `Accelerator` facade: one object that wires a backend to the shared semantics."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .api.checkpointing import Checkpointing
from .api.jobs import JobControl
from .api.prepared import PREPARED_KINDS, PreparedObjects
from .api.tracking import Tracking
from .api.training import TrainingLoopCalls
from .backend import Autograd, Backend, DeviceMesh, ShardedTraining, TrainingLoop, TrainingObjects, require
from .backend.registry import create_backend, resolve_backend_name
from .checkpoint.asynchronous import AsyncSave
from .checkpoint.files import save_arrays, save_arrays_gathered
from .checkpoint.manager import CheckpointManager, Entry
from .compat.hooks import StateHooks
from .compat.host import HostParts
from .compat.kwargs_handlers import options_of, resolve_handlers
from .compat.operations import set_current, set_ended
from .compat.surface import AccelerateSurface
from .compat.unsupported import check_accelerate_kwargs
from .config import DataLoaderConfiguration, DistributedType, ProjectConfiguration, local_folder
from .data import prepare_loader, skip_first_batches
from .data.layout import data_ranks
from .errors import CheckpointError, see
from .runtime.collectives import Collectives
from .runtime.environment import restart_count
from .runtime.preemption import SignalFlag, resolve_handle_preemption, resolve_preemption_signals
from .runtime.rng import set_seed
from .runtime.watchdog import Watchdog
from .tracking.registry import TrackerSet
from .training.loop import GradientState, LoopSettings, resolve_accumulation_steps, resolve_mixed_precision
from .training.metrics import Metrics
from .training.parallelism import MeshPlace, ParallelismConfig, check_parallelism, sharding_plugin
from .training.sharding import FullyShardedDataParallelPlugin

__all__ = ["Accelerator"]

DEFAULT_TIMEOUT = 1800.0


class Accelerator(JobControl, Checkpointing, TrainingLoopCalls, Tracking, AccelerateSurface):
    """One API for distributed training on PyTorch and on JAX.

    Args:
        backend: ``"torch"``, ``"jax"``, a `unified.Backend` instance, or ``None`` to use
            ``UNIFIED_BACKEND``, the launcher's choice, the only installed framework, or torch.
        project_dir: shortcut for ``ProjectConfiguration(project_dir=...)``.
        project_config: a `ProjectConfiguration` (checkpoint naming and retention).
        seed: seeds Python, NumPy and the framework (and the JAX key stream) on every process.
        timeout: default seconds any collective waits for the other processes (1800); also how
            long a process's heartbeat may stay silent before the others treat it as lost.
        mixed_precision: ``"no"``, ``"fp16"`` (torch) or ``"bf16"``; default
            ``UNIFIED_MIXED_PRECISION`` (``unified launch --mixed-precision``), else ``"no"``.
            torch: prepared forwards run under ``torch.autocast`` (outputs in float32), fp16
            scales the loss. JAX: prepared NNX modules compute in bfloat16, parameters and
            optimizer state stay float32.
        gradient_accumulation_steps: micro-batches per optimizer step (see `accumulate`).
        log_with: experiment trackers (Accelerate's): ``"tensorboard"``, ``"mlflow"``, ``"wandb"``,
            ``"all"`` (every installed one), `unified.tracking.GeneralTracker` instances, or a list;
            see `init_trackers`.
        fsdp_plugin: a `unified.FullyShardedDataParallelPlugin`: ``prepare`` shards models and
            optimizer state over every process instead of replicating them (docs/sharding.md).
        parallelism_config: a `unified.ParallelismConfig` (Accelerate's): a named mesh of
            ``dp_replicate`` x ``dp_shard`` x ``tp`` over the processes; ``prepare`` applies tensor
            parallelism (the model's ``tp_plan``) and FSDP2 / HSDP over it, and prepared loaders
            give every process of one tensor-parallel group the same batches (docs/parallelism.md).
        step_scheduler_with_optimizer: as in Accelerate: True steps a prepared LR scheduler only
            when the optimizer stepped (``num_processes`` times); False once per ``step()``.
        kwargs_handlers: Accelerate's `unified.compat.kwargs_handlers` (DDP's, ``GradScaler``'s and
            autocast's keyword arguments; ``InitProcessGroupKwargs(timeout=...)`` as ``timeout``).
        dataloader_config: Accelerate's `unified.utils.DataLoaderConfiguration` (what unified's
            loaders do, and the values it refuses).
        handle_preemption: SIGTERM or SIGUSR1 to any process (what schedulers send before they
            stop a job) makes the next `check_trigger` return True on every process and sets
            `preempted`, instead of ending the process; see `exit_if_preempted`. Default:
            ``UNIFIED_HANDLE_PREEMPTION`` (``1``), else False (signals keep their default action).
        preemption_signals: the signals ``handle_preemption`` counts instead of SIGTERM and SIGUSR1:
            names (``"SIGUSR2"``, submitit's) or numbers, or one comma-separated string. Default:
            ``UNIFIED_PREEMPTION_SIGNALS`` (``unified launch --preemption-signals`` sets it), else
            SIGTERM and SIGUSR1.

    Example:
        >>> from unified import Accelerator
        >>> accelerator = Accelerator(seed=0)
        >>> accelerator.num_processes
        1
    """

    def __init__(
        self,
        backend: Union[str, Backend, None] = None,
        project_dir: Optional[str] = None,
        project_config: Optional[ProjectConfiguration] = None,
        seed: Optional[int] = None,
        timeout: float = DEFAULT_TIMEOUT,
        mixed_precision: Optional[str] = None,
        gradient_accumulation_steps: int = 1,
        log_with: Any = None,
        fsdp_plugin: Optional[FullyShardedDataParallelPlugin] = None,
        parallelism_config: Optional[ParallelismConfig] = None,
        handle_preemption: Optional[bool] = None,
        preemption_signals: Optional[Union[str, Sequence[Union[str, int]]]] = None,
        dataloader_config: Optional[DataLoaderConfiguration] = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Optional[List[Any]] = None,
        **accelerate_kwargs: Any,
    ) -> None:
        handlers = resolve_handlers(kwargs_handlers)
        gradient_accumulation_steps = check_accelerate_kwargs(accelerate_kwargs, gradient_accumulation_steps)
        self.ddp_handler, self.scaler_handler = handlers.ddp_handler, handlers.scaler_handler
        self.init_handler, self.autocast_handler = handlers.init_handler, handlers.autocast_handler
        if handlers.timeout is not None and timeout == DEFAULT_TIMEOUT:
            timeout = handlers.timeout  # InitProcessGroupKwargs(timeout=...), as Accelerate's process group takes it
        self.dataloader_config = dataloader_config if dataloader_config is not None else DataLoaderConfiguration()
        self.dataloader_config.check()
        self.step_scheduler_with_optimizer = bool(step_scheduler_with_optimizer)
        self.handle_preemption: bool = resolve_handle_preemption(handle_preemption)
        self.preemption_signals: Tuple[int, ...] = resolve_preemption_signals(preemption_signals)
        self.mixed_precision: str = resolve_mixed_precision(mixed_precision)
        self.gradient_state = GradientState(num_steps=resolve_accumulation_steps(gradient_accumulation_steps))
        self._trackers = TrackerSet(log_with, project_config, project_dir)  # checked before joining the group
        if isinstance(backend, Backend):
            self._backend = backend
        else:
            self._backend = create_backend(resolve_backend_name(backend))
        self._loop = _loop_backend(self._backend, self.mixed_precision, self.gradient_state.num_steps)
        _check_handlers(self._backend, [self.ddp_handler, self.scaler_handler, self.autocast_handler])
        self.parallelism_config: Optional[ParallelismConfig] = parallelism_config
        self.fsdp_plugin = _sharding_backend(self._backend, sharding_plugin(parallelism_config, fsdp_plugin,
                                                                            FullyShardedDataParallelPlugin))
        self._backend.start(float(timeout))
        self._mesh_place = _parallelism_backend(self._backend, parallelism_config, fsdp_plugin is not None)
        self._collectives = Collectives(self._backend, timeout)
        self._watchdog = self._start_watchdog(float(timeout))
        self._trigger = False
        self._preempted = False
        self._ended = False
        # installed once the group is joined: a signal during the join keeps its default action
        self._signals: Optional[SignalFlag] = (SignalFlag.install(self.preemption_signals) if self.handle_preemption
                                               else None)
        self._signals_seen = 0
        self.project_configuration = project_config if project_config is not None else ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        self.seed = seed
        if seed is not None:
            set_seed(seed, backend=self._backend)
        parts = self._init_state()
        self._compose(parts)  # Accelerate's names work through these (unified.compat.host)
        set_current(self, parts)  # for unified.utils' function forms of the collectives

    def _start_watchdog(self, timeout: float) -> Optional[Watchdog]:
        """Tell every process when the group broke, and end the ones that cannot raise."""
        channel = self._backend.health_channel() if self._backend.num_processes > 1 else None
        if channel is None:
            return None
        watchdog = Watchdog(channel, self._backend.process_index, self._backend.num_processes, timeout)
        watchdog.start()
        self._collectives.on_broken = watchdog.report
        watchdog.in_timed_call = lambda: self._collectives.in_call > 0
        return watchdog

    def _init_state(self) -> HostParts:
        self._checkpoints = CheckpointManager(self._backend, self._collectives, self.project_configuration)
        self._checkpoints.tracker_identities = self._trackers.identities
        self._counts: Dict[str, int] = {}
        self._async_save: Optional[AsyncSave] = None
        self._prepared = PreparedObjects(untrack=self._untrack_prepared)
        self._state_hooks = StateHooks(self._prepared, self._backend, self._collectives)
        self._metrics = Metrics(self._collectives)
        self.gradient_state.loaders = self._metrics.active  # gradient_state.active_dataloader
        self._metrics.active.on_left = self.gradient_state.left_loader
        if self._mesh_place is not None:  # a tensor-parallel group reads one batch: counted once
            self._metrics.same_batch = self.num_processes // self._mesh_place.feeding.data_size
        if self._loop is not None:
            self._loop.configure_loop(LoopSettings(
                self.mixed_precision, self.gradient_state, self.num_processes, self.step_scheduler_with_optimizer,
                data_parallel_options=options_of(self.ddp_handler), loss_scaler_options=options_of(self.scaler_handler),
                autocast_options=options_of(self.autocast_handler)))
            self._checkpoint_loop_state()
        return HostParts(self._backend, self._collectives, self._loop, self._trackers, self._prepared,
                         self._state_hooks)

    def _checkpoint_loop_state(self) -> None:
        """Save the loop's state (once) where there is one to save: the position inside an
        accumulation window, its gradients so far and the fp16 loss scale."""
        wanted = self._loop is not None and (self.gradient_accumulation_steps > 1 or self.mixed_precision == "fp16")
        if wanted and not any(e.name == "training_loop" for e in self._checkpoints.entries):
            self._checkpoints.add(Entry("training_loop", self._loop_state, self._load_loop_state, managed=False,
                                        check=self._check_loop_state))

    def _loop_state(self) -> Dict[str, Any]:
        return {"gradient_state": self.gradient_state.state_dict(), "backend": self._loop.loop_state()}

    def _check_loop_state(self, state: Dict[str, Any], saved_processes: int) -> None:
        self.gradient_state.check_state_dict(state["gradient_state"], saved_processes, self.num_processes)

    def _load_loop_state(self, state: Dict[str, Any]) -> None:
        self.gradient_state.load_state_dict(state["gradient_state"])
        self._loop.load_loop_state(state["backend"])

    # -- identity -----------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The backend's name, ``"torch"`` or ``"jax"``."""
        return self._backend.name

    @property
    def process_index(self) -> int:
        """This process's index in ``0 .. num_processes - 1``."""
        return self._backend.process_index

    @property
    def local_process_index(self) -> int:
        """This process's index among the processes of its machine."""
        return self._backend.local_process_index

    @property
    def num_processes(self) -> int:
        """Number of processes in the group."""
        return self._backend.num_processes

    @property
    def is_main_process(self) -> bool:
        """True on process 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on the first process of each machine."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """True on process ``num_processes - 1``."""
        return self.process_index == self.num_processes - 1

    @property
    def device(self) -> Any:
        """This process's device: a ``torch.device`` or a ``jax.Device``."""
        return self._backend.device

    @property
    def mesh(self) -> Any:
        """The device mesh over every device of the group (JAX: a ``jax.sharding.Mesh`` with one
        axis named ``"data"``; with ``parallelism_config``, the axes ``"dp_replicate"``,
        ``"dp_shard"``, ``"tp"``: docs/parallelism.md).

        It is the mesh `prepare` places models and optimizers on and prepared loaders shard
        batches over, so shardings built on it match the backend's.

        Raises:
            unified.MissingCapability: on a backend without a device mesh (torch); it is also an
                ``AttributeError``, so ``hasattr(accelerator, "mesh")`` is False there.

        Example:
            >>> from jax.sharding import NamedSharding, PartitionSpec
            >>> rows = NamedSharding(accelerator.mesh, PartitionSpec("data"))
            >>> accelerator.mesh.axis_names
            ('data',)
        """
        return require(self._backend, DeviceMesh, "accelerator.mesh").mesh

    # -- parallelism (Accelerate's names; unified.training.parallelism) ---------------------------
    @property
    def torch_device_mesh(self) -> Any:
        """torch's ``DeviceMesh`` of ``parallelism_config`` (dimensions ``dp_replicate``,
        ``dp_shard``, ``tp`` and the flattened ``dp``, ``dp_shard_cp``, ``dp_cp``); None without
        one, with one process, or on JAX (there `mesh` is the named ``jax.sharding.Mesh``).

        Example:
            >>> accelerator.torch_device_mesh["tp"].size()   # doctest: +SKIP
            2
        """
        return getattr(self._backend, "parallel_mesh", None)

    def _mesh_rank(self, dimension: str, what: str) -> int:
        if self._mesh_place is None:
            return self._no_parallelism(what)
        return self._mesh_place.coordinates[dimension]

    @property
    def data_parallel_rank(self) -> int:
        """This process's rank along ``dp_replicate`` (0 when it is not enabled); as Accelerate,
        a `RuntimeError` without ``parallelism_config``. The rank prepared loaders follow (the
        flattened ``dp``) is ``data_parallel_rank * dp_shard_size + data_parallel_shard_rank``.

        Example:
            >>> accelerator.data_parallel_rank   # doctest: +SKIP
            1
        """
        return self._mesh_rank("dp_replicate", "Data parallelism")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's rank along ``dp_shard`` (0 when it is not enabled)."""
        return self._mesh_rank("dp_shard", "Shard-based data parallelism")

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank along ``tp`` (0 when it is not enabled)."""
        return self._mesh_rank("tp", "Tensor parallelism")

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """True when models are sharded with FSDP2 (Accelerate's ``is_fsdp2``)."""
        return self.fsdp_plugin is not None

    @property
    def restart_count(self) -> int:
        """How many times ``unified launch --max-restarts`` (or torchrun) restarted this job's
        group before the attempt this process belongs to; 0 on the first.

        Example:
            >>> if accelerator.restart_count:
            ...     accelerator.print(f"restart {accelerator.restart_count}: resuming")
        """
        return restart_count()

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's distributed type (``NO`` for one process; ``JAX`` for a JAX group)."""
        return DistributedType(self._backend.distributed_type)

    @property
    def project_dir(self) -> Optional[str]:
        """``project_configuration.project_dir``."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> Optional[str]:
        """``project_configuration.logging_dir``."""
        return self.project_configuration.logging_dir

    # -- preparing and checkpointing ------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: Any = None) -> Any:
        """Make models, optimizers, schedulers, scalers and data loaders ready for this backend.

        Returns the objects in the same order (one object when one was given). Prepared objects
        are saved and restored by `save_state` / `load_state` without further calls. ``None``
        comes back as ``None``; an object prepared already comes back as it is.

        Example:
            >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        """
        _check_device_placement(device_placement)
        prepared = [None if obj is None else self._prepare_one(i, obj) for i, obj in enumerate(objects)]
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _prepare_one(self, position: int, obj: Any) -> Any:
        if obj in self._prepared:
            return obj  # prepared already: the same object, tracked once
        seed = self.dataloader_config.data_seed if self.dataloader_config.data_seed is not None else self.seed
        config = self.dataloader_config
        if config.dispatch_batches is True and self._mesh_place is not None \
                and self._mesh_place.feeding.data_size != self.num_processes:
            raise NotImplementedError("DataLoaderConfiguration(dispatch_batches=True) with tensor parallelism "
                                      "(tp_size > 1) is not supported (as in Accelerate): leave dispatch_batches "
                                      "out; every process of a tensor-parallel group then reads the same batches."
                                      + see("parallelism-config"))
        feeding = self._mesh_place.feeding if self._mesh_place is not None else None
        loader = prepare_loader(obj, data_ranks(self._backend, feeding), seed,
                                stateful=config.use_stateful_dataloader, dispatch=config.dispatch_batches is True,
                                even_batches=config.even_batches, split_batches=config.split_batches)
        if loader is not None:
            connect = getattr(loader, "connect", None)
            if callable(connect):  # collectives the loader needs: a sampler's own seed agreed, a stream's steps
                connect(self._collectives)
            loader.on_batch = self.gradient_state.saw_batch  # the end of a loader closes a window
            self._metrics.watch(loader)
            self._track("dataloader", loader, loader.state_dict, loader.load_state_dict,
                        check=lambda state, _saved_processes: loader.check_state_dict(state))
            self._prepared.add_loader(loader)
            return _marked_prepared(loader)
        result = self._backend.prepare(obj) if isinstance(self._backend, TrainingObjects) else None
        if result is None:
            raise TypeError(
                f"prepare() argument {position} is a {type(obj).__module__}.{type(obj).__qualname__}, which the "
                f"{self.backend!r} backend cannot prepare. Expected a model, optimizer, LR scheduler, "
                "gradient scaler or data loader; register other stateful objects with register_for_checkpointing()."
                + see("cannot-prepare")
            )
        kind, prepared = result
        self._prepared.add(kind, _marked_prepared(prepared))
        backend = self._backend
        self._track(kind, prepared, lambda: backend.state_of(kind, prepared),
                    lambda state: backend.load_state_into(kind, prepared, state), strict=kind == "model",
                    check=lambda state, _saved_processes: backend.check_loadable(kind, prepared, state),
                    absent_group=lambda name: backend.absent_group(kind, name),
                    replaceable=lambda: backend.replaceable_arrays(kind, prepared))
        return prepared

    def _untrack_prepared(self) -> None:
        """`free_memory` (through `PreparedObjects.forget`): what `prepare` tracked is no longer saved."""
        self._checkpoints.entries = [e for e in self._checkpoints.entries
                                     if e.name != "scaler" and e.name.rsplit("_", 1)[0] not in PREPARED_KINDS]
        for kind in PREPARED_KINDS:
            self._counts.pop(kind, None)

    def _track(self, kind: str, obj: Any, get_state: Callable[[], Any], set_state: Callable[[Any], None],
               managed: bool = True, strict: bool = False,
               check: Optional[Callable[[Any, int], None]] = None,
               absent_group: Callable[[str], Optional[str]] = lambda name: None,
               replaceable: Callable[[], Any] = lambda: None) -> None:
        index = self._counts.get(kind, 0)
        self._counts[kind] = index + 1
        name = "scaler" if kind == "scaler" and index == 0 else f"{kind}_{index}"
        self._checkpoints.add(Entry(name, get_state, set_state, managed, strict, check, absent_group, replaceable))

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """The rest of the current epoch of a prepared loader, from absolute position
        ``num_batches`` (see `unified.skip_first_batches`).

        Example:
            >>> for batch in accelerator.skip_first_batches(loader, 100):
            ...     ...
        """
        return skip_first_batches(dataloader, num_batches)

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        """The user's model without distributed wrappers (DDP, ``nn.DataParallel``). As in
        Accelerate, a ``torch.compile``d model stays compiled (around the unwrapped module)
        unless ``keep_torch_compile=False``.

        Example:
            >>> accelerator.unwrap_model(model).state_dict()
            >>> plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)  # forward without autocast
        """
        if not isinstance(self._backend, TrainingObjects):
            return model
        unwrapped = self._backend.unwrap_model(model, keep_compiled=keep_torch_compile)
        if not keep_fp32_wrapper and self._loop is not None:
            self._loop.strip_autocast(self._backend.unwrap_model(unwrapped))  # the module's own forward
        return unwrapped

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """``loss.backward()`` (torch). JAX computes gradients inside the jitted step instead.

        Example:
            >>> accelerator.backward(loss)
        """
        with self._collectives.watched():
            require(self._backend, Autograd, "accelerator.backward()").backward(loss, **kwargs)

    def save_model(self, model: Any, save_directory: str, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Write the model's weights as one ``model.safetensors`` (main process only; not a collective,
        so it may be called under ``if accelerator.is_main_process:``). Call `wait_for_everyone`
        first when other processes are still training.

        With ``fsdp_plugin`` and several processes the weights are split across processes: then
        every process must call it (as with Accelerate's FSDP). Each array is gathered whole, one
        at a time, and the main process writes one consolidated file (for export and inference).

        Example:
            >>> accelerator.wait_for_everyone()
            >>> accelerator.save_model(model, "final_model")
        """
        path = os.path.join(local_folder(save_directory, "save_model(save_directory)"), "model.safetensors")
        state = require(self._backend, TrainingObjects, "save_model()").state_of("model", model)
        if self.fsdp_plugin is None or self.num_processes == 1:
            if self.is_main_process:
                os.makedirs(save_directory, exist_ok=True)
                save_arrays(path, self._backend, state, metadata=self._backend.weights_metadata)
            return path
        sharded = require(self._backend, ShardedTraining, "save_model() of a sharded model")
        failure: Optional[BaseException] = None
        try:
            if self.is_main_process:
                os.makedirs(save_directory, exist_ok=True)
        except OSError as err:
            failure = err
        try:
            save_arrays_gathered(path if self.is_main_process and failure is None else None, self._backend, state,
                                 lambda value, name: self._collectives.keyed(
                                     f"save_model ({name})",
                                     lambda key, timeout: sharded.full_array(value, key, timeout)),
                                 metadata=self._backend.weights_metadata)
        except (OSError, ValueError) as err:
            failure = err
        failed = self._collectives.share_failure(failure, "save_model (written)")
        if failed:
            raise CheckpointError(f"save_model({save_directory!r}) failed on process {failed[0][0]}: {failed[0][1]}"
                                  + see("save-model-failed"))
        return path

    # -- the end ------------------------------------------------------------------------------
    def end_training(self) -> None:
        """Finish pending work and the trackers, wait for every process and leave the process group.

        Example:
            >>> accelerator.end_training()
        """
        if self._ended:
            return
        self._finish_pending()
        self._trackers.finish()
        self._checkpoints.release_folder()
        self._collectives.barrier("end_training")
        if self._watchdog is not None:
            self._watchdog.close()
        self._backend.shutdown()
        self._ended = True
        set_ended(self)

    def _finish_pending(self) -> None:
        self.wait_for_checkpoint()

    def __repr__(self) -> str:
        return (
            f"Accelerator(backend={self.backend!r}, process {self.process_index}/{self.num_processes}, "
            f"device={self.device})"
        )


def _check_handlers(backend: Backend, handlers: List[Any]) -> None:
    """Each kwargs handler given must be one the backend applies (torch's DDP, GradScaler and
    autocast options mean nothing to JAX)."""
    accepted = backend.kwargs_handlers if isinstance(backend, TrainingLoop) else ()
    for handler in handlers:
        if handler is not None and type(handler).__name__ not in accepted:
            raise NotImplementedError(f"kwargs_handlers: {type(handler).__name__} means nothing to the "
                                      f"{backend.name!r} backend (it applies {', '.join(accepted) or 'none'}); "
                                      "remove it." + see("not-supported-yet"))


def _check_device_placement(device_placement: Any) -> None:
    """Accelerate's ``device_placement=`` of ``prepare*``: only what unified always does (every
    object on ``accelerator.device``) is accepted."""
    values = device_placement if isinstance(device_placement, (list, tuple)) else [device_placement]
    if any(value not in (None, True) for value in values):
        raise NotImplementedError(f"prepare(device_placement={device_placement!r}) is not supported: unified always "
                                  "places prepared objects and batches on accelerator.device. Remove the argument."
                                  + see("not-supported-yet"))


def _marked_prepared(obj: Any) -> Any:
    """Accelerate's mark on what `prepare` returned (``obj._is_accelerate_prepared``), where the
    object takes attributes."""
    try:
        obj._is_accelerate_prepared = True
    except (AttributeError, TypeError):
        pass
    return obj


def _sharding_backend(backend: Backend, plugin: Optional[FullyShardedDataParallelPlugin]
                      ) -> Optional[FullyShardedDataParallelPlugin]:
    """Hand ``plugin`` to the backend before anything is prepared; a clear error for a backend
    that cannot shard or for something that is not a plugin."""
    if plugin is None:
        return None
    if not isinstance(plugin, FullyShardedDataParallelPlugin):
        raise TypeError(f"fsdp_plugin must be a unified.FullyShardedDataParallelPlugin, not {type(plugin).__name__}."
                        + see("fsdp-plugin"))
    require(backend, ShardedTraining, "Accelerator(fsdp_plugin=...)").configure_sharding(plugin)
    return plugin


def _parallelism_backend(backend: Backend, config: Optional[ParallelismConfig], user_plugin: bool
                         ) -> Optional[MeshPlace]:
    """Fit ``config`` to the joined group and hand it to the backend, which builds its named
    mesh; where this process sits on it (its data-parallel rank), or None without a config.
    A backend whose processes may each hold several devices of the mesh (JAX) says how many
    (``parallel_devices_per_process()``): the mesh is then one of devices, not of processes."""
    if config is None:
        return None
    per_process = getattr(backend, "parallel_devices_per_process", None)
    devices = int(per_process()) if callable(per_process) else 1
    check_parallelism(config, backend.num_processes, user_plugin, devices)
    place = config.place_of(backend.process_index, devices)  # refuses a layout it cannot feed
    configure = getattr(backend, "configure_parallelism", None)
    if not callable(configure):
        raise NotImplementedError(f"Accelerator(parallelism_config=...) needs a backend with a named device mesh; "
                                  f"the {backend.name!r} backend has none (configure_parallelism). Leave "
                                  "parallelism_config out." + see("parallelism-config"))
    configure(config)
    return place


def _loop_backend(backend: Backend, precision: str, steps: int) -> Optional[TrainingLoop]:
    """The backend's `TrainingLoop`, or None when the run asks nothing of one; a clear error when
    it asks what the backend cannot do."""
    if not isinstance(backend, TrainingLoop):
        if precision != "no" or steps > 1:
            what = f"mixed_precision={precision!r}" if precision != "no" else f"gradient_accumulation_steps={steps}"
            require(backend, TrainingLoop, f"Accelerator({what})")
        return None
    if precision not in backend.mixed_precisions:
        others = [p for p in backend.mixed_precisions if p != "no"]
        hint = f" Use mixed_precision={others[-1]!r}" + (
            " (bfloat16 has float32's range, so it needs no loss scaling)."
            if others[-1] == "bf16" else ".") if others else ""
        raise ValueError(f"mixed_precision={precision!r} is not supported by the {backend.name!r} backend.{hint}"
                         + see("mixed-precision-unsupported"))
    return backend
