"""Accelerate's smaller public names on `Accelerator`: process-selecting decorators, ``state``,
``save``, ``free_memory`` and the like. Each is a thin layer over what the Accelerator already
does; the `Accelerator` class inherits them so that ``accelerator.py`` keeps the semantics."""
from __future__ import annotations

import functools
import gc
import os
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, List, Optional, TypeVar

from .errors import see
from .state import AcceleratorState

if TYPE_CHECKING:
    from .backend import Backend

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


class AccelerateSurface:
    """Mixed into `unified.Accelerator`; relies on its identity properties and ``_backend``."""

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
        from .checkpoint.files import save_arrays

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
        the files the hook writes are committed with the checkpoint (and checked when loaded).
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
        removes from ``models`` is restored by the hook, not by unified.

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
