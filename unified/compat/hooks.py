"""Accelerate's save- and load-state pre hooks: `StateHooks` keeps the hooks registered with
``register_save_state_pre_hook`` and ``register_load_state_pre_hook`` and runs them inside
``save_state`` and ``load_state`` (over the prepared models it is given); `RemovableHandle` is
what registering a hook returns. The Accelerator owns one `StateHooks`."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, List

if TYPE_CHECKING:
    from ..api.prepared import PreparedObjects
    from ..backend import Backend
    from ..runtime.collectives import Collectives

__all__ = ["RemovableHandle", "StateHooks"]


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


class StateHooks:
    """The save- and load-state pre hooks of one Accelerator, in the order registered.

    Args:
        prepared: what ``prepare`` returned; the hooks see its models (``model_0``, ``model_1``...).
        backend: gives each model's weights (``state_of``).
        collectives: the main process's hooks decide which models they saved, for every process.

    Example:
        >>> handle = hooks.register_save(lambda models, weights, output_dir: None)   # doctest: +SKIP
        >>> hooks.run_save(tmp_dir)                                                  # doctest: +SKIP
        []
    """

    def __init__(self, prepared: "PreparedObjects", backend: "Backend", collectives: "Collectives") -> None:
        self._prepared = prepared
        self._backend = backend
        self._collectives = collectives
        self._save: Dict[int, Callable[..., None]] = {}
        self._load: Dict[int, Callable[..., None]] = {}

    def register_save(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` in each `run_save`."""
        return RemovableHandle(self._save, hook)

    def register_load(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` in each `run_load`."""
        return RemovableHandle(self._load, hook)

    @property
    def has_save_hooks(self) -> bool:
        """Whether any save hook is registered (``save_state`` then opens the checkpoint early)."""
        return bool(self._save)

    def _model_names(self, models: List[Any]) -> List[str]:
        return [f"model_{i}" for i in range(len(models))]

    def run_save(self, output_dir: str) -> List[str]:
        """The save hooks, on every process; returns the models they saved themselves, as the
        main process's hooks decided (the main process writes the manifest)."""
        os.makedirs(output_dir, exist_ok=True)
        models = self._prepared.of("model")
        weights = [self._backend.state_of("model", model) for model in models]  # type: ignore[attr-defined]
        given = list(weights)
        for hook in list(self._save.values()):
            hook(models, weights, output_dir)
        kept = {id(w) for w in weights}
        skip = [name for name, w in zip(self._model_names(given), given) if id(w) not in kept]
        main = self._backend.process_index == 0
        return self._collectives.broadcast_json(skip if main else None, operation="save_state (hooks)")

    def run_load(self, input_dir: str) -> Collection[str]:
        """The load hooks, on every process; returns the models they restored themselves."""
        if not self._load:
            return ()
        given = self._prepared.of("model")
        models = list(given)
        for hook in list(self._load.values()):
            hook(models, input_dir)
        left = {id(m) for m in models}
        return [name for name, model in zip(self._model_names(given), given) if id(model) not in left]
