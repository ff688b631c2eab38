"""Accelerate's smaller public names on `Accelerator`: process-selecting decorators, ``state``,
``save``, ``free_memory``, ``prepare_model`` and the like, each a thin layer over what the
Accelerator already does. `AccelerateSurface` is mixed into the `unified.Accelerator` (so that
``help(Accelerator)`` shows every name) but reads it only through its public names, declared by
`unified.compat.host.SurfaceHost`, and through the composed parts the Accelerator hands it
(`unified.compat.host.HostParts`: backend, collectives, loop, trackers, prepared objects, state
hooks); ``accelerator.py`` keeps the semantics."""
from __future__ import annotations

import contextlib
import functools
import gc
import os
from typing import TYPE_CHECKING, Any, Callable, List, Optional, TypeVar

from ..api.prepared import PREPARED_KINDS
from ..backend import TrainingLoop
from ..errors import see
from .hooks import RemovableHandle
from .join import uneven_inputs
from .state import AcceleratorState
from .unsupported import AbsentFeatures, _unsupported, check_accelerate_kwargs

if TYPE_CHECKING:
    from .host import HostParts, SurfaceHost

    _Host = SurfaceHost  # what the mixin reads of its host, for the type checker
else:
    _Host = object

# PREPARED_KINDS, RemovableHandle and check_accelerate_kwargs are importable from here as before
__all__ = ["AccelerateSurface", "only_if", "PREPARED_KINDS", "RemovableHandle", "check_accelerate_kwargs"]

F = TypeVar("F", bound=Callable[..., Any])


def only_if(condition: Callable[[], bool], function: F) -> F:
    """``function`` where ``condition()`` holds at call time; elsewhere the call returns None."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if condition():
            return function(*args, **kwargs)
        return None

    return wrapper  # type: ignore[return-value]


class AccelerateSurface(AbsentFeatures, _Host):
    """Mixed into `unified.Accelerator`: reads its public names (`unified.compat.host.SurfaceHost`)
    and the parts `_compose` hands it, nothing else of it."""

    def _compose(self, parts: "HostParts") -> None:
        """Called once by the Accelerator's constructor: the objects it is composed of."""
        self._parts = parts

    @property
    def state(self) -> AcceleratorState:
        """Accelerate's ``AcceleratorState`` view: prints as Accelerate's does.

        Example:
            >>> logger.info(accelerator.state, main_process_only=False)   # doctest: +SKIP
        """
        view = self.__dict__.get("_state_view")
        if view is None:
            view = self._state_view = AcceleratorState(self, self._parts.backend)
        return view

    # Accelerate's lists of what `prepare` returned, which its tests and some scripts read
    _models = property(lambda self: self._parts.prepared.of("model"))
    _optimizers = property(lambda self: self._parts.prepared.of("optimizer"))
    _schedulers = property(lambda self: self._parts.prepared.of("scheduler"))
    _dataloaders = property(lambda self: self._parts.prepared.of("dataloader"))

    # Accelerate's views of `dataloader_config`
    split_batches = property(lambda self: self.dataloader_config.split_batches)
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    even_batches = property(lambda self: self.dataloader_config.even_batches)
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)

    @property
    def is_fsdp2(self) -> bool:
        """Whether prepared models are sharded with FSDP2 (torch, ``fsdp_plugin``, several processes)."""
        return (self.fsdp_plugin is not None and self.num_processes > 1
                and getattr(self._parts.backend, "is_fsdp2", False))

    @property
    def multi_device(self) -> bool:
        """Accelerate's: several processes on accelerator devices (False on CPU, whatever the
        group's distributed type)."""
        device = self.device
        kind = getattr(device, "platform", None) or getattr(device, "type", None) or str(device)  # JAX, torch
        return self.num_processes > 1 and kind != "cpu"

    @property
    def native_amp(self) -> bool:
        """Whether mixed precision is on."""
        return self.mixed_precision != "no"

    @property
    def should_save_model(self) -> bool:
        """Accelerate's: whether this process writes model files (the first process of each machine)."""
        return self.is_local_main_process

    @property
    def save_iteration(self) -> int:
        """The number of the next automatically named checkpoint."""
        return self.project_configuration.iteration

    @property
    def step(self) -> int:
        """Micro-batches since the accumulation window opened (Accelerate's counter)."""
        return self.gradient_state.step

    @property
    def log_with(self) -> List[Any]:
        """The trackers ``log_with`` asked for (names and tracker objects)."""
        return list(self._parts.trackers.requested)

    @property
    def scaler(self) -> Any:
        """The fp16 loss scaler (torch's ``GradScaler``) where there is one, else None."""
        return getattr(self._parts.loop, "loss_scaler", None)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide the gradients by the fp16 loss scale now (once per step); nothing without a
        loss scaler (every process calls it, as Accelerate's).

        Example:
            >>> accelerator.unscale_gradients()
        """
        if self._parts.loop is not None:
            self._parts.loop.unscale_gradients()

    def trigger_sync_in_backward(self, model: Any) -> Any:
        """A context in which the next `backward` synchronises ``model``'s gradients across
        processes even inside `no_sync`, as Accelerate's (torch DDP; a no-op elsewhere, e.g. on
        one process or on JAX, whose gradients are global). For several forwards under
        ``no_sync`` followed by their backwards, the last one synchronising.

        Example:
            >>> with accelerator.trigger_sync_in_backward(model):
            ...     accelerator.backward(loss)
        """
        loop = self._parts.backend
        if not isinstance(loop, TrainingLoop):
            return contextlib.nullcontext()
        return loop.sync_in_backward(model)

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

        backend = self._parts.backend
        objects = require(backend, TrainingObjects, "get_state_dict()")
        if self.fsdp_plugin is None or self.num_processes == 1:
            return objects.state_of("model", model) if unwrap else model.state_dict()
        sharded = require(backend, ShardedTraining, "get_state_dict() of a sharded model")
        full = {}
        for name, value in flat_names(objects.state_of("model", model)).items():
            whole = self._parts.collectives.keyed(
                f"get_state_dict ({name})", lambda key, timeout, v=value: sharded.full_array(v, key, timeout))
            if self.is_main_process:
                full[name] = backend.from_numpy(whole)
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
        prepared = self.prepare(obj, device_placement=device_placement)
        found = self._parts.prepared.kind_of(prepared)  # None: prepare(None) returned None
        if (kind == "dataloader") != (found == "dataloader") or (found is not None and found != kind):
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

    def join_uneven_inputs(self, joinables: Any, even_batches: Optional[bool] = None) -> Any:
        """Accelerate's context for processes with different numbers of batches
        (``DataLoaderConfiguration(even_batches=False)``): torch's ``Join`` over ``joinables`` (the
        prepared models), so that the processes that ran out shadow the collectives of the others.
        ``even_batches`` overrides the configuration's for the map-style loaders prepared, within
        the block (`unified.compat.join.uneven_inputs`).

        Example:
            >>> with accelerator.join_uneven_inputs([model], even_batches=False):
            ...     for batch in loader:
            ...         accelerator.backward(model(batch).sum())
        """
        loop = self._parts.loop
        join = loop.join_uneven_inputs if loop is not None else (lambda _: contextlib.nullcontext())
        return uneven_inputs(joinables, even_batches, self.dataloader_config.even_batches,
                             self._parts.prepared.of("dataloader"), self.state.distributed_type, join)

    def prepare_data_loader(self, data_loader: Any, device_placement: Optional[bool] = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """`prepare` for one data loader (Accelerate's name). ``slice_fn_for_dispatch``, with
        ``dispatch_batches=True``: ``slice_fn(step_batch, slice, process_index=, num_processes=)``
        picks each process's part of a step (default: its rows); ignored otherwise, as in Accelerate.

        Example:
            >>> loader = accelerator.prepare_data_loader(loader)
        """
        loader = self._prepare_kind(data_loader, "dataloader", "prepare_data_loader()", device_placement)
        if slice_fn_for_dispatch is not None and hasattr(loader, "slice_fn"):  # a `DispatchedLoader`
            loader.slice_fn = slice_fn_for_dispatch
        return loader

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
                save_arrays(tmp, self._parts.backend, obj, metadata=self._parts.backend.weights_metadata)
            else:
                self._parts.backend.save_object(obj, tmp)
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
        return self._parts.hooks.register_save(hook)

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
        return self._parts.hooks.register_load(hook)

    def free_memory(self, *objects: Any) -> List[None]:
        """Forget the prepared models, optimizers, schedulers and loaders (they are no longer
        saved by `save_state`), collect garbage and free the device's cached memory; returns as
        many ``None`` as objects were given, as Accelerate does. Registered objects stay.

        Example:
            >>> model, optimizer = accelerator.free_memory(model, optimizer)
        """
        self.wait_for_checkpoint()
        self._parts.prepared.forget()
        released: List[None] = [None] * len(objects)
        gc.collect()
        self._parts.backend.release_device_memory()
        return released

    def clear(self, *objects: Any) -> List[None]:
        """Accelerate's alias of `free_memory`.

        Example:
            >>> model, optimizer = accelerator.clear(model, optimizer)
        """
        return self.free_memory(*objects)
