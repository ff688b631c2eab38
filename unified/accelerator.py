"""The `Accelerator` facade: one object that wires a backend to the shared semantics."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

from .backend import Autograd, Backend, DeviceMesh, KeyStream, ShardedTraining, TrainingLoop, TrainingObjects, WriteGuards, require
from .collectives import Collectives
from .config import DataLoaderConfiguration, DistributedType, ProjectConfiguration, local_folder
from .environment import restart_count
from .checkpoint.asynchronous import AsyncSave
from .checkpoint.manager import CheckpointManager, Entry
from .checkpoint.files import save_arrays, save_arrays_gathered
from .data import prepare_loader, skip_first_batches
from .errors import CheckpointError, RegistrationError, see
from .kwargs_handlers import options_of, resolve_handlers
from .operations import set_current
from .metrics import Metrics
from .preemption import PREEMPTED_EXIT_CODE, SignalFlag, record_status, resolve_handle_preemption, resolve_preemption_signals
from .registry import create_backend, resolve_backend_name
from .rng import set_seed
from .sharding import FullyShardedDataParallelPlugin
from .surface import PREPARED_KINDS, AccelerateSurface, check_accelerate_kwargs, only_if
from .training_loop import GradientState, LoopSettings, resolve_accumulation_steps, resolve_mixed_precision
from .tracking.registry import TrackerSet
from .watchdog import Watchdog

__all__ = ["Accelerator"]

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_TIMEOUT = 1800.0


class Accelerator(AccelerateSurface):
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
        step_scheduler_with_optimizer: as in Accelerate: True steps a prepared LR scheduler only
            when the optimizer stepped (``num_processes`` times); False once per ``step()``.
        kwargs_handlers: Accelerate's `unified.kwargs_handlers` (DDP's, ``GradScaler``'s and
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
        self.fsdp_plugin = _sharding_backend(self._backend, fsdp_plugin)
        self._backend.start(float(timeout))
        self._collectives = Collectives(self._backend, timeout)
        self._watchdog = self._start_watchdog(float(timeout))
        self._trigger = False
        self._preempted = False
        self._ended = False
        # installed once the group is joined: a signal during the join keeps its default action
        self._signals: Optional[SignalFlag] = SignalFlag.install(self.preemption_signals) if self.handle_preemption else None
        self._signals_seen = 0
        self.project_configuration = project_config if project_config is not None else ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        self.seed = seed
        if seed is not None:
            set_seed(seed, backend=self._backend)
        self._init_state()
        set_current(self)  # for unified.utils' function forms of the collectives

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

    def _init_state(self) -> None:
        self._checkpoints = CheckpointManager(self._backend, self._collectives, self.project_configuration)
        self._checkpoints.tracker_identities = self._trackers.identities
        self._counts: Dict[str, int] = {}
        self._async_save: Optional[AsyncSave] = None
        self._prepared: List[Tuple[str, Any]] = []
        self._loaders: List[Any] = []
        self._save_state_pre_hooks: Dict[int, Callable[..., None]] = {}
        self._load_state_pre_hooks: Dict[int, Callable[..., None]] = {}
        self._metrics = Metrics(self._collectives)
        if self._loop is not None:
            self._loop.configure_loop(LoopSettings(
                self.mixed_precision, self.gradient_state, self.num_processes, self.step_scheduler_with_optimizer,
                data_parallel_options=options_of(self.ddp_handler), loss_scaler_options=options_of(self.scaler_handler),
                autocast_options=options_of(self.autocast_handler)))
            self._checkpoint_loop_state()

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
        axis named ``"data"``).

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

    # -- running and deferring jobs ---------------------------------------------------------
    def wait_for_everyone(self, timeout: Optional[float] = None) -> None:
        """Block until every process reached this call (a no-op with one process).

        Raises `unified.BarrierTimeout` naming the missing processes when some process does
        not arrive within ``timeout`` seconds (default: the Accelerator's) or died.

        Example:
            >>> accelerator.wait_for_everyone()
            >>> accelerator.wait_for_everyone(timeout=60)
        """
        self._collectives.barrier("wait_for_everyone", timeout)

    def main_process_first(self) -> "contextlib.AbstractContextManager[None]":
        """Run the body on the main process first, then on the others; all leave together.

        An exception in any process's body reaches the others as `unified.DistributedError`.

        Example:
            >>> with accelerator.main_process_first():
            ...     dataset = prepare_dataset()      # downloads once, others read the cache
        """
        return self._collectives.ordered(self.is_main_process, "main_process_first")

    def local_main_process_first(self) -> "contextlib.AbstractContextManager[None]":
        """Like `main_process_first`, with the first process of each machine going first.

        Example:
            >>> with accelerator.local_main_process_first():
            ...     cache = build_local_cache()
        """
        return self._collectives.ordered(self.is_local_main_process, "local_main_process_first")

    def set_trigger(self) -> None:
        """Raise this process's trigger flag; `check_trigger` reports it on every process.

        Example:
            >>> if loss < target:
            ...     accelerator.set_trigger()
        """
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process, in the same call, if any process called `set_trigger` since
        the last check; resets the flag. A collective: every process must call it equally often.

        With ``handle_preemption``, a preemption signal (`preemption_signals`) received by any process since the last
        check fires it too and sets `preempted` on every process; from then on it returns True
        at every call (the job is going away).

        Example:
            >>> if accelerator.check_trigger():
            ...     accelerator.save_state()
            ...     break
        """
        if self._preempted:  # the same on every process: no collective needed
            self._trigger = False
            return True
        signalled = False
        if self._signals is not None:
            signalled, self._signals_seen = self._signals.consume(self._signals_seen)
        fired = self._collectives.any_flag(self._trigger or signalled, "check_trigger")
        self._trigger = False
        if fired and self._signals is not None:  # was it a preemption? (the same call count everywhere)
            self._preempted = self._collectives.any_flag(signalled, "check_trigger (preemption)")
        return fired

    @property
    def preempted(self) -> bool:
        """True on every process once `check_trigger` reported a preemption signal (one of
        `preemption_signals`, SIGTERM or SIGUSR1 by default, to any process, with ``handle_preemption``).

        Example:
            >>> if accelerator.check_trigger():
            ...     accelerator.save_state()
            ...     if accelerator.preempted:
            ...         print("preempted: saved, exiting for a requeue")
        """
        return self._preempted

    def exit_if_preempted(self) -> None:
        """When `preempted`: finish pending work (`end_training`, unless it ran already) and end
        the process with ``unified.PREEMPTED_EXIT_CODE`` (75, ``EX_TEMPFAIL``), the status a
        requeue script tests (`unified launch` exits with it too when every process did).
        Otherwise, nothing. It raises ``SystemExit``, so ``finally`` blocks and ``atexit`` run.

        Example:
            >>> accelerator = Accelerator(handle_preemption=True, project_dir="run")
            >>> for step, batch in enumerate(loader):
            ...     train_step(batch)
            ...     if accelerator.check_trigger():
            ...         accelerator.save_state()
            ...         break
            >>> accelerator.exit_if_preempted()
        """
        if not self._preempted:
            return
        if not self._ended:
            self.end_training()
        record_status("preempted", self.process_index)
        sys.exit(PREEMPTED_EXIT_CODE)  # an exit status, not a message

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main process only.

        Example:
            >>> accelerator.print("epoch", 3, "loss", 0.25)
        """
        if self.is_main_process:
            print(*args, **kwargs)

    def on_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on the main process only (elsewhere it returns ``None``).

        Example:
            >>> @accelerator.on_main_process
            ... def log(msg):
            ...     print(msg)
        """
        return only_if(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on the first process of each machine only.

        Example:
            >>> @accelerator.on_local_main_process
            ... def clean_tmp():
            ...     ...
        """
        return only_if(lambda: self.is_local_main_process, function)

    # -- collectives on arrays ----------------------------------------------------------------
    def gather(self, tree: Any) -> Any:
        """Concatenate every process's arrays along the first axis, on every process.

        Works on framework tensors/arrays and dicts/lists/tuples of them; 0-d values become
        one element per process.

        Example:
            >>> accelerator.gather(torch.tensor([accelerator.process_index]))   # tensor([0, 1])
        """
        return self._collectives.gather(tree)

    def gather_for_metrics(self, tree: Any, use_gather_object: bool = False) -> Any:
        """`gather`, minus the samples that a prepared loader repeated to even out the end of the
        epoch, so that an evaluation sees each sample exactly once.

        Call it on per-sample values (first axis: the rows of the batch in use) while iterating a
        prepared loader; the innermost loader being iterated decides which gathered rows are
        repeats. On JAX a global ``jax.Array`` sharded over the processes (a prepared batch, a
        jitted step's per-sample output) is already global: the result is its rows without the
        repeats, as a process-local array equal on every process. With ``use_gather_object=True``
        (or a list of values that are not arrays, e.g. strings) it returns one list of the
        per-sample values of every process, without repeats (JSON and arrays; no pickle).

        Example:
            >>> for x, y in eval_loader:            # 10 samples, batch 3, 3 processes
            ...     preds, labels = accelerator.gather_for_metrics((model(x).argmax(-1), y))
            ...     correct += (preds == labels).sum()   # the last batch: 1 sample, not 9
        """
        return self._metrics.gather_for_metrics(tree, use_gather_object)

    def pad_across_processes(self, tree: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Pad every array of ``tree`` along ``dim`` to its largest size over the processes, with
        ``pad_index`` after the data (before it with ``pad_first``), so that they can be gathered.
        Arrays without axis ``dim`` are returned as they are. A collective.

        Example:
            >>> tokens = accelerator.pad_across_processes(generated, dim=1, pad_index=tokenizer.pad_token_id)
            >>> tokens = accelerator.gather_for_metrics(tokens)
        """
        return self._metrics.pad_across_processes(tree, dim, pad_index, pad_first)

    def reduce(self, tree: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Element-wise ``"sum"`` or ``"mean"`` over processes, on every process. ``scale`` is
        accepted and, as in Accelerate everywhere but on XLA devices, not applied (a warning says
        so when it is not 1).

        Example:
            >>> accelerator.reduce({"loss": loss}, "mean")
        """
        if scale != 1.0:
            warnings.warn(f"reduce(scale={scale!r}) is ignored, as Accelerate ignores it off XLA devices: multiply "
                          "the result yourself." + see("not-supported-yet"), UserWarning, stacklevel=2)
        return self._collectives.reduce(tree, reduction)

    def broadcast(self, tree: Any, from_process: int = 0) -> Any:
        """Every process receives ``from_process``'s arrays (same shapes on every process).

        Example:
            >>> weights = accelerator.broadcast(weights, from_process=0)
        """
        return self._collectives.broadcast(tree, from_process)

    def gather_object(self, value: Any) -> list:
        """Every process's JSON-serialisable ``value``, in process order (no pickle).

        Example:
            >>> accelerator.gather_object({"rank": accelerator.process_index})
        """
        return self._collectives.all_gather_json(value)

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
        if any(obj is mine for mine in self._loaders) or any(obj is mine for _, mine in self._prepared):
            return obj  # prepared already: the same object, tracked once
        seed = self.dataloader_config.data_seed if self.dataloader_config.data_seed is not None else self.seed
        loader = prepare_loader(obj, self._backend, seed)
        if loader is not None:
            connect = getattr(loader, "connect", None)
            if callable(connect):  # collectives the loader needs: a sampler's own seed agreed, a stream's steps
                connect(self._collectives)
            loader.on_batch = self.gradient_state.saw_batch  # the end of a loader closes a window
            self._metrics.watch(loader)
            self._track("dataloader", loader, loader.state_dict, loader.load_state_dict,
                        check=lambda state, _saved_processes: loader.check_state_dict(state))
            self._loaders.append(loader)
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
        self._prepared.append((kind, _marked_prepared(prepared)))
        backend = self._backend
        self._track(kind, prepared, lambda: backend.state_of(kind, prepared),
                    lambda state: backend.load_state_into(kind, prepared, state), strict=kind == "model",
                    check=lambda state, _saved_processes: backend.check_loadable(kind, prepared, state),
                    absent_group=lambda name: backend.absent_group(kind, name),
                    replaceable=lambda: backend.replaceable_arrays(kind, prepared))
        return prepared

    def _forget_prepared(self) -> None:
        """`free_memory`: what `prepare` tracked is no longer saved or guarded."""
        self._checkpoints.entries = [e for e in self._checkpoints.entries
                                     if e.name != "scaler" and e.name.rsplit("_", 1)[0] not in PREPARED_KINDS]
        for kind in PREPARED_KINDS:
            self._counts.pop(kind, None)
        self._prepared.clear()
        self._loaders.clear()

    def _track(self, kind: str, obj: Any, get_state: Callable[[], Any], set_state: Callable[[Any], None],
               managed: bool = True, strict: bool = False,
               check: Optional[Callable[[Any, int], None]] = None,
               absent_group: Callable[[str], Optional[str]] = lambda name: None,
               replaceable: Callable[[], Any] = lambda: None) -> None:
        index = self._counts.get(kind, 0)
        self._counts[kind] = index + 1
        name = "scaler" if kind == "scaler" and index == 0 else f"{kind}_{index}"
        self._checkpoints.add(Entry(name, get_state, set_state, managed, strict, check, absent_group, replaceable))

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` with every checkpoint; each needs ``state_dict()`` and
        ``load_state_dict()``. Their state may hold arrays, numbers, strings, lists and dicts.

        Raises an error that is both `ValueError` and `TypeError`, listing every offending
        object by position, when some object lacks either method.

        Example:
            >>> accelerator.register_for_checkpointing(scheduler, my_counter)
        """
        bad = [f"\n\t- Item at index {i}, `{_pretty_name(o)}`" for i, o in enumerate(objects)
               if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if bad:  # Accelerate's wording, which its tests and scripts match
            raise RegistrationError(
                "All `objects` must include a `state_dict` and `load_state_dict` function to be stored. "
                "The following inputs are invalid:" + "".join(bad) + see("registration-error")
            )
        for obj in objects:
            self._track("custom_checkpoint", obj, obj.state_dict,
                        lambda state, o=obj: o.load_state_dict(state), managed=False)

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   async_save: Optional[bool] = None, **save_model_func_kwargs: Any) -> str:
        """Write models, optimizers, schedulers, scalers, data positions, registered objects and
        every RNG state of every process into a checkpoint directory, atomically.

        With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the directory is
        ``{project_dir}/checkpoints/checkpoint_{iteration}``. ``async_save=True`` returns after
        a host snapshot and writes in the background (see `wait_for_checkpoint`); arrays sharded
        across processes too: every process takes a host copy of its own shards (a collective,
        with the plan of the write) and writes them in the background; the checkpoint is
        committed once every process's files are written.
        ``safe_serialization`` is accepted for Accelerate scripts: files are always safetensors.

        Returns the checkpoint directory.

        Example:
            >>> path = accelerator.save_state()            # automatic naming
            >>> path = accelerator.save_state("ckpt/last")  # an explicit directory
        """
        self.wait_for_checkpoint()
        manager = self._checkpoints
        final = manager.resolve_save_dir(output_dir)
        if async_save is None:
            async_save = self.project_configuration.async_save
        iteration = self.project_configuration.iteration
        if self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration += 1
        begun, skip, hooks = None, [], ({}, None)
        if self._save_state_pre_hooks:  # they write into the checkpoint before its files are written
            begun = manager.begin(final)
            skip, *hooks = manager.run_save_hooks(begun[1], self._run_save_state_pre_hooks)
        if not async_save:
            snapshot = manager.safe_snapshot(iteration, skip=skip)
            snapshot.hook_files, snapshot.hook_error = hooks
            return manager.save(final, snapshot, begun)
        # Where the backend can hold back the next in-place update until the files are written
        # (torch: hooks before a prepared optimizer's step and a prepared model's forward) and
        # detect the others (version counters), the snapshot needs no copy of the framework arrays.
        guarded = isinstance(self._backend, WriteGuards)
        snapshot = manager.safe_snapshot(iteration, detach=True, skip=skip)
        snapshot.hook_files, snapshot.hook_error = hooks
        manager.refuse_sharded_on_store(final, snapshot)
        token, tmp = begun if begun is not None else manager.begin(final)
        # Arrays sharded across processes: their collective part (the plan, host copies of each
        # process's own shards) runs here; only their writes go to the background.
        sharded = manager.begin_sharded(tmp, snapshot)
        detached = threading.Event()  # set once the background no longer reads live memory
        pending = AsyncSave(lambda: manager.save_in_background(final, token, tmp, snapshot, sharded, detached.set),
                            detached=detached)
        if guarded:
            pending.release = self._backend.guard_writes(self._prepared, pending.wait_detached)
        self._async_save = pending
        return final

    def wait_for_checkpoint(self) -> None:
        """Block until a background `save_state(async_save=True)` is committed; re-raise its error.

        Example:
            >>> accelerator.save_state(async_save=True)
            >>> accelerator.wait_for_checkpoint()
        """
        pending, self._async_save = self._async_save, None
        if pending is None:
            return
        pending.release()
        error: Optional[BaseException] = None
        try:
            pending.result()
        except BaseException as err:  # noqa: BLE001 - shared with the other processes below
            error = err
        # A collective after the join: the main process has committed when anyone returns, and
        # a failure on any process fails the call everywhere, with every process's reason.
        failed = self._collectives.share_failure(error, "wait_for_checkpoint")
        if failed:  # the main process's reason already lists every process's report
            rank, reason = failed[0]
            raise CheckpointError(reason if rank == 0 else f"a background save_state failed on process {rank}: {reason}"
                                  + see("background-save-failed"))

    def load_state(self, input_dir: Optional[str] = None, *, if_exists: bool = False,
                   **load_kwargs: Any) -> Optional[str]:
        """Restore everything `save_state` wrote, in place, on every process.

        Without ``input_dir`` and with automatic naming, loads the newest checkpoint of
        ``{project_dir}/checkpoints`` that verifies; afterwards the next automatic save never
        collides. A damaged newer one (a checksum mismatch, a missing, truncated or unparseable
        file or manifest, a hostile header: what verification finds before anything is
        restored) is skipped and set aside as ``checkpoint_N.damaged`` (on a store: its manifest
        moved to ``manifest.json.damaged``), never deleted, and the main process warns which one
        and why; every process takes the same decision. Any other failure (the checkpoint does
        not fit this run, a store out of reach) raises as it is. Accelerate's
        ``map_location``/``strict`` keywords are accepted. Returns the directory.

        ``if_exists=True``: resume if there is a checkpoint, else start fresh: returns ``None``
        and changes nothing when there is none yet (no complete automatically named checkpoint,
        or no ``manifest.json`` in ``input_dir``), which every process agrees on. With automatic
        naming it skips damaged checkpoints as above. The one line a script restarted by
        ``unified launch --max-restarts`` needs.

        Raises `unified.CheckpointError` naming the file for a missing, truncated, corrupted or
        mismatched checkpoint, before any object is modified: always for an explicit
        ``input_dir`` (nothing is skipped or set aside then), and with automatic naming when no
        checkpoint verifies, naming each one skipped, ``if_exists=True`` included (starting
        fresh would silently throw away the training the damaged ones hold).

        Example:
            >>> accelerator.load_state()                    # newest checkpoint that verifies
            >>> accelerator.load_state("ckpt/last")         # this one, or CheckpointError
            >>> accelerator.load_state(if_exists=True)      # resume, or start fresh
        """
        unknown = set(load_kwargs) - {"map_location", "strict", "load_kwargs"}
        if unknown:
            raise TypeError(f"load_state() got unexpected keyword argument(s): {', '.join(sorted(unknown))}"
                            + see("load-unexpected-keyword"))
        self.wait_for_checkpoint()
        if if_exists:
            if not self._checkpoints.has_checkpoint(input_dir):
                return None
        return self._checkpoints.load_newest(input_dir, self._run_load_state_pre_hooks, if_exists=if_exists)

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
                                     f"save_model ({name})", lambda key, timeout: sharded.full_array(value, key, timeout)),
                                 metadata=self._backend.weights_metadata)
        except (OSError, ValueError) as err:
            failure = err
        failed = self._collectives.share_failure(failure, "save_model (written)")
        if failed:
            raise CheckpointError(f"save_model({save_directory!r}) failed on process {failed[0][0]}: {failed[0][1]}"
                                  + see("save-model-failed"))
        return path

    # -- the training loop ----------------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (``Accelerator(gradient_accumulation_steps=...)``);
        settable, as in Accelerate (``accelerator.gradient_accumulation_steps = 4``).

        Example:
            >>> accelerator.gradient_accumulation_steps = 4
        """
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        steps = resolve_accumulation_steps(value)
        if steps > 1 and self._loop is None:
            require(self._backend, TrainingLoop, f"accelerator.gradient_accumulation_steps = {steps}")
        self.gradient_state.num_steps = steps
        self._checkpoint_loop_state()

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-batch that closes an accumulation window (every N-th one, and the
        last batch of a prepared loader): the optimizer really steps then.

        Example:
            >>> with accelerator.accumulate(model):
            ...     accelerator.backward(loss)
            ...     if accelerator.sync_gradients:
            ...         accelerator.clip_grad_norm_(model.parameters(), 1.0)
        """
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = bool(value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when a prepared optimizer skipped its last step (fp16 gradients with inf/NaN).

        Example:
            >>> if not accelerator.optimizer_step_was_skipped:
            ...     ema.update(model)
        """
        return self.gradient_state.optimizer_step_skipped

    @contextlib.contextmanager
    def accumulate(self, *models: Any) -> Any:
        """One micro-batch of gradient accumulation: inside, gradients are not synchronised
        across processes and prepared optimizers/schedulers do not step, except on the
        micro-batch that closes the window (`sync_gradients`). ``backward`` divides the loss by
        ``gradient_accumulation_steps``. On JAX the prepared ``nnx.Optimizer`` accumulates by
        itself; ``accumulate`` keeps the count (and closes the window at a loader's end).

        Example:
            >>> accelerator = Accelerator(gradient_accumulation_steps=4)
            >>> for batch in loader:
            ...     with accelerator.accumulate(model):
            ...         loss = model(batch).mean()
            ...         accelerator.backward(loss)
            ...         optimizer.step()
            ...         optimizer.zero_grad()
        """
        self.gradient_state.advance()
        with contextlib.ExitStack() as stack:
            if self._loop is not None:
                self._loop.before_micro_step()
                if not self.gradient_state.sync_gradients:
                    for model in models:
                        stack.enter_context(self._loop.no_sync(model))
            yield

    def no_sync(self, model: Any) -> "contextlib.AbstractContextManager[None]":
        """Gradients computed inside are not synchronised across processes (DDP's ``no_sync``;
        a no-op on JAX, whose jitted step computes global gradients).

        Example:
            >>> with accelerator.no_sync(model):
            ...     accelerator.backward(loss)       # local gradients only
        """
        return require(self._backend, TrainingLoop, "accelerator.no_sync()").no_sync(model)

    def autocast(self) -> "contextlib.AbstractContextManager[None]":
        """Compute in the Accelerator's mixed precision outside a prepared forward (torch:
        ``torch.autocast``; JAX: a no-op, prepared modules already compute in bf16).

        Example:
            >>> with accelerator.autocast():
            ...     loss = loss_fn(model(x), y)
        """
        if self._loop is None:
            return contextlib.nullcontext()
        return self._loop.autocast()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """Clip gradients to a total ``max_norm``. torch: ``parameters`` as for
        ``torch.nn.utils.clip_grad_norm_`` (unscaled first under fp16); returns the total norm
        before clipping. JAX: ``parameters`` is the gradient tree; returns ``(clipped, norm)``
        and works inside ``jit``.

        Example:
            >>> norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)          # torch
            >>> grads, norm = accelerator.clip_grad_norm_(grads, 1.0)                # JAX
        """
        return require(self._backend, TrainingLoop, "accelerator.clip_grad_norm_()").clip_grad_norm_(
            parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> Any:
        """Clip every gradient element to ``[-clip_value, clip_value]`` (torch: in place, unscaled
        first under fp16; JAX: returns the clipped gradient tree).

        Example:
            >>> accelerator.clip_grad_value_(model.parameters(), 0.5)
        """
        return require(self._backend, TrainingLoop, "accelerator.clip_grad_value_()").clip_grad_value_(
            parameters, clip_value)

    def next_key(self) -> Any:
        """A fresh ``jax.random`` key from the Accelerator's stream (seeded by ``seed``; saved
        and restored with every checkpoint). JAX backend only.

        Example:
            >>> dropout_key = accelerator.next_key()
        """
        return require(self._backend, KeyStream, "accelerator.next_key()").next_key()

    # -- experiment trackers (the logic: unified/tracking/) ---------------------------------------
    @property
    def trackers(self) -> list:
        """The started trackers (`unified.tracking.GeneralTracker`); empty off the main process."""
        return list(self._trackers.trackers)

    def init_trackers(self, project_name: str, config: Optional[Dict[str, Any]] = None,
                      init_kwargs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Start the ``log_with`` trackers on the main process (elsewhere: nothing), writing under
        ``logging_dir``; ``config`` (hyperparameters) is stored with the run, ``init_kwargs`` maps a
        tracker's name to keywords for it (e.g. ``{"wandb": {"tags": [...]}}``).

        A job that will resume continues the runs of the checkpoint ``load_state()`` would load
        (every checkpoint names them): W&B logs into the same run id (``resume="allow"``), MLflow
        into the same run, TensorBoard into the same folder, so a restarted or requeued job's
        steps go on in one run. A run the script names itself (``init_kwargs={"wandb": {"id":
        ...}}``, MLflow's ``run_id=`` / ``MLFLOW_RUN_ID``) wins; so does a new ``project_dir``.

        Example:
            >>> accelerator = Accelerator(log_with="all", project_dir="runs/exp")
            >>> accelerator.init_trackers("mnist", config={"lr": 1e-3, "batch_size": 64})
        """
        self._trackers.start(self._backend, project_name, self.logging_dir, config, init_kwargs,
                             saved=self._checkpoints.saved_tracker_identities)

    def log(self, values: Dict[str, Any], step: Optional[int] = None,
            log_kwargs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Log ``values`` (name -> number, 0-d framework array, string or dict of numbers) at
        ``step`` to every tracker; a no-op off the main process and before `init_trackers`.

        Example:
            >>> accelerator.log({"train_loss": loss, "lr": scheduler.get_last_lr()[0]}, step=step)
        """
        self._trackers.log(self._backend, values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (``unwrap=True``: the library's own object, e.g. the
        ``SummaryWriter``, ``mlflow.ActiveRun`` or ``wandb.Run``); off the main process a tracker
        whose calls do nothing.

        Example:
            >>> run = accelerator.get_tracker("wandb", unwrap=True)
            >>> writer = accelerator.get_tracker("tensorboard").tracker
        """
        return self._trackers.get(name, unwrap)

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
            raise NotImplementedError(f"kwargs_handlers: {type(handler).__name__} means nothing to the {backend.name!r} "
                                      f"backend (it applies {', '.join(accepted) or 'none'}); remove it."
                                      + see("not-supported-yet"))


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
            " (bfloat16 has float32's range, so it needs no loss scaling)." if others[-1] == "bf16" else ".") if others else ""
        raise ValueError(f"mixed_precision={precision!r} is not supported by the {backend.name!r} backend.{hint}"
                         + see("mixed-precision-unsupported"))
    return backend


def _pretty_name(obj: Any) -> str:
    """Accelerate's ``get_pretty_name``: a class's or function's own name, else its type's."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or obj)


