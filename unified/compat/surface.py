"""Accelerate's smaller public names on `Accelerator`: process-selecting decorators, ``state``,
``save``, ``free_memory`` and the like. Each is a thin layer over what the Accelerator already
does; the `Accelerator` class inherits them so that ``accelerator.py`` keeps the semantics."""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, List, Optional, TypeVar

from ..config import GradientAccumulationPlugin
from ..errors import see
from .state import AcceleratorState

if TYPE_CHECKING:
    from ..backend import Backend

F = TypeVar("F", bound=Callable[..., Any])

# The kinds of objects `prepare` tracks, which `free_memory` forgets (registered objects stay, as
# in Accelerate).
PREPARED_KINDS = ("model", "optimizer", "scheduler", "scaler", "dataloader")


def only_if(condition: Callable[[], bool], function: F) -> F:
    """``function`` where ``condition()`` holds at call time; elsewhere the call returns None."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if condition():
            return function(*args, **kwargs)
        return None

    return wrapper  # type: ignore[return-value]


class RemovableHandle:
    """What ``register_*_hook`` returns: ``handle.remove()`` unregisters the hook (torch's
    ``RemovableHandle`` protocol, which Accelerate returns).

    Example:
        >>> handle = accelerator.register_save_state_pre_hook(hook)   # doctest: +SKIP
        >>> handle.remove()                                           # doctest: +SKIP
    """

    _next_id = 0

    def __init__(self, hooks: Dict[int, Callable[..., None]], hook: Callable[..., None]) -> None:
        RemovableHandle._next_id += 1
        self.id = RemovableHandle._next_id
        self._hooks = hooks
        hooks[self.id] = hook

    def remove(self) -> None:
        self._hooks.pop(self.id, None)

    def __enter__(self) -> "RemovableHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


# Accelerate's constructor keywords for features unified does not have: accepted at the values
# that mean "not in use" (as scripts pass them), refused otherwise with what to do instead.
_ACCELERATE_KWARGS = {
    "cpu": ((False, True), "unified runs on the backend's device"),
    "dispatch_batches": ((None, False), "every process reads its own share"),
    "even_batches": ((True,), "prepared loaders are always even"),
    "device_placement": ((True,), "prepared objects are always placed on accelerator.device"),
    "rng_types": ((None,), "every generator is saved and restored; none is synchronised per batch"),
    "deepspeed_plugin": ((None,), "shard models with fsdp_plugin=unified.FullyShardedDataParallelPlugin() (FSDP2)"),
    "deepspeed_plugins": ((None,), "shard models with fsdp_plugin=unified.FullyShardedDataParallelPlugin() (FSDP2)"),
    "megatron_lm_plugin": ((None,), "Megatron-LM is not supported; shard with fsdp_plugin"),
    "torch_tp_plugin": ((None,), "tensor parallelism is not supported; shard with fsdp_plugin"),
    "parallelism_config": ((None,), "shard with fsdp_plugin; other parallelism is not supported"),
    "dynamo_plugin": ((None,), "call torch.compile(model) yourself before prepare()"),
    "dynamo_backend": ((None, "no", "NO"), "call torch.compile(model) yourself before prepare()"),
}


def check_accelerate_kwargs(kwargs: Dict[str, Any], gradient_accumulation_steps: int) -> int:
    """Accelerate's other constructor keywords (`_ACCELERATE_KWARGS`, ``split_batches`` and
    ``gradient_accumulation_plugin``); returns the accumulation steps to use. A keyword Accelerate
    does not have is a `TypeError`; a value unified does not implement a `NotImplementedError`."""
    if kwargs.pop("split_batches", False):
        # Accelerate 1.15 takes the argument and ignores it (DataLoaderConfiguration holds the
        # setting); a script passing it runs as it runs there, and is told so
        warnings.warn("Accelerator(split_batches=True) is ignored, as Accelerate 1.15 ignores it: each process gets "
                      "the loader's batch_size. DataLoaderConfiguration(split_batches=True) is not supported by "
                      "unified." + see("not-supported-yet"), FutureWarning, stacklevel=3)
    plugin = kwargs.pop("gradient_accumulation_plugin", None)
    if plugin is not None:
        gradient_accumulation_steps = GradientAccumulationPlugin.steps_of(plugin, gradient_accumulation_steps)
    for name, value in kwargs.items():
        if name not in _ACCELERATE_KWARGS:
            raise TypeError(
                f"Accelerator() got an unexpected keyword argument {name!r}. Accepted: backend, mixed_precision, "
                f"gradient_accumulation_steps, gradient_accumulation_plugin, handle_preemption, log_with, fsdp_plugin, "
                f"dataloader_config, step_scheduler_with_optimizer, project_dir, project_config, seed, timeout, and "
                f"Accelerate's {', '.join(sorted(_ACCELERATE_KWARGS))} at their default values."
                + see("unexpected-keyword"))
        accepted, instead = _ACCELERATE_KWARGS[name]
        if value not in accepted:
            raise NotImplementedError(f"Accelerator({name}={value!r}) is not supported by unified: {instead} (or pass "
                                      f"one of {accepted!r})." + see("not-supported-yet"))
    return gradient_accumulation_steps


def _unsupported(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not supported by unified: {instead}." + see("not-supported-yet"))


class AccelerateSurface:
    """Mixed into `unified.Accelerator`; relies on its identity properties and ``_backend``."""

    # Accelerate's handlers and plugins of features unified does not have (DeepSpeed, fp8, LOMO,
    # parallelism_config, dynamo, profiling): always their "not in use" value, as on an
    # Accelerate run that does not use them. The four kwargs handlers unified takes are set by
    # the constructor (see `unified.compat.kwargs_handlers`).
    profile_handler = None
    fp8_recipe_handler = None
    ao_recipe_handler = None
    te_recipe_handler = None
    msamp_recipe_handler = None
    deepspeed_plugin = None
    parallelism_config = None
    torch_device_mesh = None
    rng_types = None  # unified saves and restores every generator; none is synchronised per batch
    flag_tensor = None  # the trigger travels through the backend's collectives, not a tensor
    device_placement = True
    fp8_enabled = False
    delayed_fp8_autocast = False
    has_fp8_handler = False
    has_lomo_optimizer = False
    fp8_backend = "NO"
    is_composable_parallelism_enabled = False

    _backend: "Backend"
    process_index: int
    local_process_index: int
    num_processes: int
    is_main_process: bool
    is_local_main_process: bool

    @property
    def state(self) -> AcceleratorState:
        """Accelerate's ``AcceleratorState`` view: prints as Accelerate's does.

        Example:
            >>> logger.info(accelerator.state, main_process_only=False)   # doctest: +SKIP
        """
        return AcceleratorState(self)  # type: ignore[arg-type]

    # Accelerate's lists of what `prepare` returned, which its tests and some scripts read
    def _prepared_of(self, kind: str) -> List[Any]:
        return [obj for k, obj in self._prepared if k == kind]  # type: ignore[attr-defined]

    _models = property(lambda self: self._prepared_of("model"))
    _optimizers = property(lambda self: self._prepared_of("optimizer"))
    _schedulers = property(lambda self: self._prepared_of("scheduler"))
    _dataloaders = property(lambda self: list(self._loaders))  # type: ignore[attr-defined]

    # Accelerate's views of `dataloader_config`
    split_batches = property(lambda self: self.dataloader_config.split_batches)  # type: ignore[attr-defined]
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)  # type: ignore[attr-defined]
    even_batches = property(lambda self: self.dataloader_config.even_batches)  # type: ignore[attr-defined]
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)  # type: ignore[attr-defined]
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)  # type: ignore[attr-defined]
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)  # type: ignore[attr-defined]

    @property
    def is_fsdp2(self) -> bool:
        """Whether prepared models are sharded with FSDP2 (torch, ``fsdp_plugin``, several processes)."""
        return (self.fsdp_plugin is not None and self.num_processes > 1  # type: ignore[attr-defined]
                and getattr(self._backend, "is_fsdp2", False))

    @property
    def multi_device(self) -> bool:
        """Accelerate's: several processes on accelerator devices (False on CPU, whatever the
        group's distributed type)."""
        device = self.device  # type: ignore[attr-defined]
        kind = getattr(device, "platform", None) or getattr(device, "type", None) or str(device)  # JAX, torch
        return self.num_processes > 1 and kind != "cpu"

    @property
    def native_amp(self) -> bool:
        """Whether mixed precision is on."""
        return self.mixed_precision != "no"  # type: ignore[attr-defined]

    @property
    def should_save_model(self) -> bool:
        """Accelerate's: whether this process writes model files (the first process of each machine)."""
        return self.is_local_main_process

    @property
    def save_iteration(self) -> int:
        """The number of the next automatically named checkpoint."""
        return self.project_configuration.iteration  # type: ignore[attr-defined]

    @property
    def step(self) -> int:
        """Micro-batches since the accumulation window opened (Accelerate's counter)."""
        return self.gradient_state.step  # type: ignore[attr-defined]

    @property
    def log_with(self) -> List[Any]:
        """The trackers ``log_with`` asked for (names and tracker objects)."""
        return list(self._trackers.requested)  # type: ignore[attr-defined]

    @property
    def scaler(self) -> Any:
        """The fp16 loss scaler (torch's ``GradScaler``) where there is one, else None."""
        return getattr(self._loop, "loss_scaler", None)  # type: ignore[attr-defined]

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide the gradients by the fp16 loss scale now (once per step); nothing without a
        loss scaler (every process calls it, as Accelerate's).

        Example:
            >>> accelerator.unscale_gradients()
        """
        if self._loop is not None:  # type: ignore[attr-defined]
            self._loop.unscale_gradients()  # type: ignore[attr-defined]

    def _no_parallelism(self, what: str) -> Any:
        raise RuntimeError(f"{what} is not configured: unified has no parallelism_config; each process's data "
                           "rank is accelerator.process_index." + see("no-parallelism-config"))

    data_parallel_rank = property(lambda self: self._no_parallelism("Data parallelism"))
    data_parallel_shard_rank = property(lambda self: self._no_parallelism("Shard-based data parallelism"))
    tensor_parallel_rank = property(lambda self: self._no_parallelism("Tensor parallelism"))

    @property
    def pipeline_parallel_rank(self) -> int:
        raise _unsupported("Pipeline parallelism", "as in Accelerate, which does not support it either")

    @property
    def context_parallel_rank(self) -> int:
        raise _unsupported("Context parallelism", "as in Accelerate, which does not support it either")

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: Any = None, buffer_seq_dims: Any = None,
                               no_restore_buffers: Any = None) -> Any:
        """A no-op context, as Accelerate's without context parallelism.

        Example:
            >>> with accelerator.maybe_context_parallel():
            ...     loss = model(batch)
        """
        yield

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Any, even_batches: Optional[bool] = None) -> Any:
        """A no-op context: unified's prepared loaders give every process the same number of
        batches (the last global batch is filled up), so no process waits in a collective for
        another that ran out.

        Example:
            >>> with accelerator.join_uneven_inputs([model]):
            ...     train()
        """
        if even_batches is False:
            raise _unsupported("join_uneven_inputs(even_batches=False)", "prepared loaders always give even batches")
        yield

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        """``dl`` unchanged, as Accelerate's without DeepSpeed sequence parallelism.

        Example:
            >>> loader = accelerator.deepspeed_ulysses_dl_adapter(loader, model)
        """
        return dl

    def lomo_backward(self, loss: Any, learning_rate: float) -> None:
        """Not supported (LOMO optimizers).

        Example:
            >>> accelerator.backward(loss)   # what to call instead
        """
        raise _unsupported("lomo_backward (LOMO optimizers)", "use a standard optimizer and accelerator.backward(loss)")

    def profile(self, profile_handler: Any = None) -> Any:
        """Not supported: profile with the framework's own profiler.

        Example:
            >>> with torch.profiler.profile() as prof:   # torch
            ...     train_step()
        """
        raise _unsupported("accelerator.profile()", "use torch.profiler.profile() (torch) or jax.profiler.trace() "
                           "(JAX) around the code to profile")

    @staticmethod
    def trigger_sync_in_backward(model: Any) -> Any:
        """Not supported: unified's `accumulate` synchronises gradients on the micro-batch that
        closes the window.

        Example:
            >>> with accelerator.accumulate(model):   # what to use instead
            ...     accelerator.backward(loss)
        """
        raise _unsupported("trigger_sync_in_backward", "accelerator.accumulate(model) synchronises gradients on the "
                           "micro-batch that closes the window; call backward outside no_sync() to sync earlier")

    def verify_device_map(self, model: Any) -> bool:
        """True when ``model`` (or a submodule) was dispatched over several devices with a
        transformers ``device_map`` (``hf_device_map`` with more than one entry).

        Example:
            >>> accelerator.verify_device_map(model)
            False
        """
        modules = model.modules() if callable(getattr(model, "modules", None)) else [model]
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in modules)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Any:
        """Give each process its contiguous share of ``inputs`` (a list, tuple, array or a dict
        of them), the first processes one more when it does not divide evenly; with
        ``apply_padding`` every share is made as long as the longest by repeating its last
        item (lists and tuples). As Accelerate's, for inference over prompts and the like.

        Example:
            >>> with accelerator.split_between_processes(["a", "b", "c"]) as mine:
            ...     outputs = [generate(p) for p in mine]     # process 0: ["a", "b"], process 1: ["c"]
        """
        if self.num_processes == 1:
            yield inputs
            return
        values = list(inputs.values()) if isinstance(inputs, dict) else [inputs]
        length = len(values[0])
        if any(len(v) != length for v in values):
            raise ValueError("split_between_processes needs every value of the dict to have the same length."
                             + see("split-between-processes"))
        each, extra = divmod(length, self.num_processes)
        start = self.process_index * each + min(self.process_index, extra)
        end = start + each + (1 if self.process_index < extra else 0)
        longest = each + (1 if extra else 0)

        def share(value: Any) -> Any:
            part = value[start:end] if start < len(value) else value[-1:]
            if apply_padding and len(part) < longest:
                if not isinstance(part, (list, tuple)):
                    raise _unsupported("split_between_processes(apply_padding=True) of arrays",
                                       "pad lists, or call accelerator.pad_across_processes on the share")
                part = part + type(part)([part[-1]] * (longest - len(part)))
            return part

        yield {k: share(v) for k, v in inputs.items()} if isinstance(inputs, dict) else share(inputs)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> Any:
        """The model's state as its framework gives it (torch: the ``state_dict()`` of the
        unwrapped model). With ``fsdp_plugin`` on several processes every array is gathered
        whole, one at a time (every process must call it): the main process gets the full state,
        the others ``{}`` (Accelerate's FSDP default).

        Example:
            >>> state = accelerator.get_state_dict(model)
        """
        from ..backend import ShardedTraining, TrainingObjects, require
        from ..checkpoint.files import flat_names

        objects = require(self._backend, TrainingObjects, "get_state_dict()")
        if self.fsdp_plugin is None or self.num_processes == 1:  # type: ignore[attr-defined]
            return objects.state_of("model", model) if unwrap else model.state_dict()
        sharded = require(self._backend, ShardedTraining, "get_state_dict() of a sharded model")
        full = {}
        for name, value in flat_names(objects.state_of("model", model)).items():
            whole = self._collectives.keyed(  # type: ignore[attr-defined]
                f"get_state_dict ({name})", lambda key, timeout, v=value: sharded.full_array(v, key, timeout))
            if self.is_main_process:
                full[name] = self._backend.from_numpy(whole)
        return full

    @property
    def use_distributed(self) -> bool:
        """Whether several processes run.

        Example:
            >>> accelerator.use_distributed
            False
        """
        return self.num_processes > 1

    def on_process(self, function: Optional[F] = None, process_index: Optional[int] = None) -> Any:
        """Decorator: run ``function`` on process ``process_index`` only (elsewhere it returns None).

        Example:
            >>> @accelerator.on_process(process_index=1)
            ... def report():
            ...     print("I am process 1")
        """
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        if process_index is None:
            raise TypeError("on_process needs process_index=: @accelerator.on_process(process_index=1)."
                            + see("on-process-index"))
        return only_if(lambda: self.process_index == process_index, function)

    def on_local_process(self, function: Optional[F] = None, local_process_index: Optional[int] = None) -> Any:
        """Decorator: run ``function`` on the process with this local index on each machine only.

        Example:
            >>> @accelerator.on_local_process(local_process_index=0)
            ... def clean_tmp():
            ...     ...
        """
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        if local_process_index is None:
            raise TypeError("on_local_process needs local_process_index=: "
                            "@accelerator.on_local_process(local_process_index=0)." + see("on-process-index"))
        return only_if(lambda: self.local_process_index == local_process_index, function)

    def on_last_process(self, function: F) -> F:
        """Decorator: run ``function`` on the last process only.

        Example:
            >>> @accelerator.on_last_process
            ... def report():
            ...     print("last")
        """
        return only_if(lambda: self.process_index == self.num_processes - 1, function)

    def _prepare_kind(self, obj: Any, kind: str, call: str, device_placement: Optional[bool] = None) -> Any:
        prepared = self.prepare(obj, device_placement=device_placement)  # type: ignore[attr-defined]
        found = [k for k, mine in self._prepared if mine is prepared]  # type: ignore[attr-defined]
        is_loader = any(prepared is mine for mine in self._loaders)  # type: ignore[attr-defined]
        if (kind == "dataloader") != is_loader or (found and found[0] != kind):
            raise TypeError(f"{call} was given a {type(obj).__name__}, which is not a {kind}; use prepare() for it."
                            + see("cannot-prepare"))
        return prepared

    def prepare_model(self, model: Any, device_placement: Optional[bool] = None, evaluation_mode: bool = False) -> Any:
        """`prepare` for one model (Accelerate's name).

        Example:
            >>> model = accelerator.prepare_model(model)
        """
        if evaluation_mode:
            raise NotImplementedError("prepare_model(evaluation_mode=True) is not supported: prepare the model for "
                                      "training, or use it unprepared for evaluation only." + see("not-supported-yet"))
        return self._prepare_kind(model, "model", "prepare_model()", device_placement)

    def prepare_optimizer(self, optimizer: Any, device_placement: Optional[bool] = None) -> Any:
        """`prepare` for one optimizer (Accelerate's name).

        Example:
            >>> optimizer = accelerator.prepare_optimizer(optimizer)
        """
        return self._prepare_kind(optimizer, "optimizer", "prepare_optimizer()", device_placement)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """`prepare` for one LR scheduler (Accelerate's name).

        Example:
            >>> scheduler = accelerator.prepare_scheduler(scheduler)
        """
        return self._prepare_kind(scheduler, "scheduler", "prepare_scheduler()")

    def prepare_data_loader(self, data_loader: Any, device_placement: Optional[bool] = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """`prepare` for one data loader (Accelerate's name).

        Example:
            >>> loader = accelerator.prepare_data_loader(loader)
        """
        if slice_fn_for_dispatch is not None:
            raise NotImplementedError("prepare_data_loader(slice_fn_for_dispatch=...) is not supported: unified does "
                                      "not dispatch batches from one process." + see("not-supported-yet"))
        return self._prepare_kind(data_loader, "dataloader", "prepare_data_loader()", device_placement)

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Write ``obj`` to the path ``f`` on the main process only, as Accelerate's ``save``:
        ``safe_serialization=True`` writes safetensors (``obj``: a dict of arrays); otherwise the
        framework's own format (torch: ``torch.save``). The file appears whole or not at all.
        ``transformers``' ``save_pretrained(..., save_function=accelerator.save)`` calls it.

        Example:
            >>> accelerator.save(model.state_dict(), "weights.safetensors", safe_serialization=True)
        """
        if not self.is_main_process:
            return
        from ..checkpoint.files import save_arrays

        path = os.fspath(f)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            if safe_serialization:
                if not isinstance(obj, dict):
                    raise TypeError(f"save(safe_serialization=True) writes a dict of arrays; got a "
                                    f"{type(obj).__name__}. Pass safe_serialization=False for other objects."
                                    + see("save-object"))
                save_arrays(tmp, self._backend, obj, metadata=self._backend.weights_metadata)
            else:
                self._backend.save_object(obj, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.remove(tmp)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` on every process in each `save_state`, before
        unified writes its files (Accelerate's hook). ``models``: the prepared models;
        ``weights``: their state dicts; ``output_dir``: the checkpoint's temporary folder, where
        the files the hook writes are committed with the checkpoint (and checked when loaded);
        on an object store, a local temporary folder whose files are uploaded into the
        checkpoint (write each file on one process).
        A model whose weights the hook removes from ``weights`` (on the main process) is not
        saved by unified: the hook saved it, and a load-state hook must restore it.

        Example:
            >>> def save_config(models, weights, output_dir):
            ...     if accelerator.is_main_process:
            ...         with open(os.path.join(output_dir, "config.json"), "w") as f:
            ...             json.dump({"name": type(models[0]).__name__}, f)
            >>> handle = accelerator.register_save_state_pre_hook(save_config)
        """
        return RemovableHandle(self._save_state_pre_hooks, hook)  # type: ignore[attr-defined]

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` on every process in each `load_state`, after every
        file was verified and before anything is restored (Accelerate's hook). A model the hook
        removes from ``models`` is restored by the hook, not by unified. From an object store,
        ``input_dir`` is a local temporary folder holding the save hooks' files (downloaded and
        verified), removed once `load_state` returns.

        Example:
            >>> def load_config(models, input_dir):
            ...     with open(os.path.join(input_dir, "config.json")) as f:
            ...         models[0].name = json.load(f)["name"]
            >>> handle = accelerator.register_load_state_pre_hook(load_config)
        """
        return RemovableHandle(self._load_state_pre_hooks, hook)  # type: ignore[attr-defined]

    def _model_names(self) -> List[str]:
        return [f"model_{i}" for i in range(len(self._models))]

    def _run_save_state_pre_hooks(self, output_dir: str) -> List[str]:
        """The save hooks, on every process; returns the models they saved themselves, as the
        main process's hooks decided (the main process writes the manifest)."""
        os.makedirs(output_dir, exist_ok=True)
        models = self._models
        weights = [self._backend.state_of("model", model) for model in models]  # type: ignore[attr-defined]
        given = list(weights)
        for hook in list(self._save_state_pre_hooks.values()):  # type: ignore[attr-defined]
            hook(models, weights, output_dir)
        kept = {id(w) for w in weights}
        skip = [name for name, w in zip(self._model_names(), given) if id(w) not in kept]
        return self._collectives.broadcast_json(skip if self.is_main_process else None,  # type: ignore[attr-defined]
                                                operation="save_state (hooks)")

    def _run_load_state_pre_hooks(self, input_dir: str) -> Collection[str]:
        """The load hooks, on every process; returns the models they restored themselves."""
        if not self._load_state_pre_hooks:  # type: ignore[attr-defined]
            return ()
        given = self._models
        models = list(given)
        for hook in list(self._load_state_pre_hooks.values()):  # type: ignore[attr-defined]
            hook(models, input_dir)
        left = {id(m) for m in models}
        return [name for name, model in zip(self._model_names(), given) if id(model) not in left]

    def free_memory(self, *objects: Any) -> List[None]:
        """Forget the prepared models, optimizers, schedulers and loaders (they are no longer
        saved by `save_state`), collect garbage and free the device's cached memory; returns as
        many ``None`` as objects were given, as Accelerate does. Registered objects stay.

        Example:
            >>> model, optimizer = accelerator.free_memory(model, optimizer)
        """
        self.wait_for_checkpoint()  # type: ignore[attr-defined]
        self._forget_prepared()  # type: ignore[attr-defined]
        released: List[None] = [None] * len(objects)
        gc.collect()
        self._backend.release_device_memory()
        return released

    def clear(self, *objects: Any) -> List[None]:
        """Accelerate's alias of `free_memory`.

        Example:
            >>> model, optimizer = accelerator.clear(model, optimizer)
        """
        return self.free_memory(*objects)
