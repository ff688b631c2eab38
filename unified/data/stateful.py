"""Prepared loaders as torchdata ``StatefulDataLoader`` instances: Accelerate's
``DataLoaderConfiguration(use_stateful_dataloader=True)``.

Accelerate then builds its prepared loaders on torchdata's ``StatefulDataLoader``, so that
``isinstance(loader, StatefulDataLoader)`` holds and ``loader.state_dict()``, taken while the
loader is iterated, is restored by ``loader.load_state_dict(state)``: the next iteration starts
with the batch after the one in use. unified's prepared loaders have that meaning already (an
exact position, nothing loaded to skip a batch); `as_stateful` makes one of them an instance of a
subclass of its own class and of ``StatefulDataLoader``. Its iteration, length and state stay
unified's; the other attributes of a torch ``DataLoader`` (``num_workers``, ``sampler``,
``collate_fn``, ...) are the user's loader's, as Accelerate's adapter forwards them.
"""
from __future__ import annotations

from typing import Any, Dict

from ..errors import see

__all__ = ["as_stateful"]

_CLASSES: Dict[type, type] = {}  # a prepared loader's class -> its StatefulDataLoader subclass


def _stateful_dataloader() -> type:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as err:
        raise ImportError(
            "DataLoaderConfiguration(use_stateful_dataloader=True) makes the prepared loaders torchdata "
            "StatefulDataLoaders, and torchdata is not installed: pip install 'unified[torchdata]', or leave "
            "use_stateful_dataloader=False (unified's prepared loaders resume exactly either way)."
            + see("stream-needs-torchdata")) from err
    return StatefulDataLoader


def _users_setting(self: Any, name: str) -> Any:
    """An attribute a prepared loader does not have: the user's loader's (``num_workers``, ...)."""
    users = self.__dict__.get("_users_loader") if not name.startswith("__") else None
    if users is None:
        return object.__getattribute__(self, name)  # the usual AttributeError
    return getattr(users, name)


def _stateful_class(prepared: type, base: type) -> type:
    cls = _CLASSES.get(prepared)
    if cls is None:
        cls = type(f"Stateful{prepared.__name__}", (prepared, base), {
            "__module__": __name__, "__getattr__": _users_setting,
            "__doc__": f"`{prepared.__qualname__}` that is also a torchdata ``StatefulDataLoader`` "
                       "(``use_stateful_dataloader=True``); see `unified.data.stateful`."})
        _CLASSES[prepared] = cls
    return cls


def as_stateful(prepared: Any, users_loader: Any) -> Any:
    """``prepared`` (a prepared form of ``users_loader``) made an instance of torchdata's
    ``StatefulDataLoader``, in place; returns it.

    Example:
        >>> loader = as_stateful(prepare_loader(torch_loader, backend, seed), torch_loader)  # doctest: +SKIP
        >>> isinstance(loader, StatefulDataLoader), loader.num_workers == torch_loader.num_workers
        (True, True)
    """
    base = _stateful_dataloader()
    if not isinstance(prepared, base):
        prepared.__class__ = _stateful_class(type(prepared), base)
    prepared.__dict__["_users_loader"] = users_loader
    return prepared
