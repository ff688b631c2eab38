"""What a backend supplies to the conformance suite: tiny training setups written in its framework.

Everything else the suite needs it learns from the backend itself (its capabilities, its
``group_distributed_type``, its health channel). A backend names its kit in its
`unified.backend.registry.BackendSpec` (``testing_kit="my_package.testing:Kit"``); a backend without one
runs every scenario that needs no training setup, and the others are reported as skipped.

Example (a backend whose models train with its own ``MyModel`` / ``MySGD``)::

    from unified.testing import Kit
    from unified.testing.training import Counter

    class MyTraining:
        '''step(), draws(), param_hash(), edit_in_place(delta, tracked), change_first_layer(change)'''
        def __init__(self, acc):
            self.model, self.optimizer = acc.prepare(MyModel(), MySGD(lr=0.1))
            self.counter = Counter()
            acc.register_for_checkpointing(self.counter)
        ...

    class MyKit(Kit):
        training = MyTraining
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, FrozenSet, Optional

from unified.backend import CAPABILITIES, Backend, HealthChannel
from unified.backend.registry import backend_spec, load_object

__all__ = ["Kit", "kit_of", "make_training", "backend_class", "distributed_type", "has_health_channel"]


KIT_SLOTS = ("training", "loop", "sharded", "sharded_table", "local_devices")
# what a backend has when it overrides `Backend.health_channel` (a scenario may require it)
HEALTH_CHANNEL = HealthChannel.__name__


class Kit:
    """The training setups of one backend. Each attribute is a class called with the
    Accelerator (and keyword arguments where said); ``None`` where the backend has none.

    Attributes:
        training: the checkpoint scenarios' training (`unified.testing.training`): ``step()``,
            ``draws()`` (one value from each random generator), ``param_hash()``,
            ``edit_in_place(delta, tracked=True)``, ``change_first_layer("dtype" | "shape")``.
            Needs `unified.backend.TrainingObjects`.
        loop: the training-loop scenarios' setup (`unified.testing.loop_scenarios`), called
            ``loop(acc, lr=0.05)``: ``micro_step(batch, loss_scale)``, ``params()``,
            ``compute_dtypes()``, ``clip(grads, max_norm)``, ``scheduler_steps()``,
            ``returns_float32``. Needed by a backend with `unified.backend.TrainingLoop`.
        sharded: the sharded-state scenarios' setup (`unified.testing.sharding_scenarios.ShardedSetup`),
            called ``sharded(acc, optimizer_first=False)``. Needed by a backend with
            `unified.backend.ShardedTraining`.
        sharded_table: ``sharded_table(acc, fill)``, a registered object whose ``table`` is
            one array of 2 rows per process filled with ``fill + process_index``, split by rows
            over the processes (``state_dict`` / ``load_state_dict``), with ``mine()`` (this
            process's shards as nested lists) and ``same_layout()`` (its array is still split as
            it was built); for a backend with `unified.backend.ShardedArrays`, whose scenario
            is skipped without.
        local_devices: ``local_devices(n)``, the environment variables under which every process
            a group starts holds ``n`` devices (JAX: CPU devices, from ``XLA_FLAGS``), for the
            scenarios of several devices per process (`unified.testing.parallel_scenarios`'
            ``par_devices_*``); a backend whose processes hold one device each has none, and
            those scenarios are reported as skipped.
    """

    training: Optional[Callable[..., Any]] = None
    loop: Optional[Callable[..., Any]] = None
    sharded: Optional[Callable[..., Any]] = None
    sharded_table: Optional[Callable[..., Any]] = None
    local_devices: Optional[Callable[[int], Dict[str, str]]] = None


@functools.lru_cache(maxsize=None)
def kit_of(backend: str) -> Kit:
    """The kit of ``backend`` (an empty `Kit` when its spec names none)."""
    target = backend_spec(backend).testing_kit
    if target is None:
        return Kit()
    kit = load_object(target)
    kit = kit() if isinstance(kit, type) else kit
    if not isinstance(kit, Kit):
        raise TypeError(f"testing_kit {target!r} of backend {backend!r} is not a unified.testing.Kit "
                        "(docs/certify-a-backend.md)")
    return kit


def backend_class(backend: str) -> type:
    """The `unified.Backend` subclass of ``backend`` (imports its framework)."""
    return load_object(backend_spec(backend).backend)


def distributed_type(backend: str) -> str:
    """``accelerator.distributed_type`` of a group of several processes of ``backend``."""
    return backend_class(backend).group_distributed_type


def has_health_channel(backend: str) -> bool:
    """Whether ``backend`` tells every process when one fails alone (`Backend.health_channel`)."""
    return HEALTH_CHANNEL in backend_features(backend)


@functools.lru_cache(maxsize=None)
def backend_features(backend: str) -> FrozenSet[str]:
    """The requirement names backend ``backend`` satisfies (imports its framework)."""
    cls = backend_class(backend)
    names = {c.__name__ for c in CAPABILITIES if issubclass(cls, c)}
    if cls.health_channel is not Backend.health_channel:
        names.add(HEALTH_CHANNEL)
    return frozenset(names)


def make_training(acc: Any) -> Any:
    """The kit's training setup for ``acc``'s backend."""
    training = kit_of(acc.backend).training
    if training is None:
        raise LookupError(f"the {acc.backend!r} backend's testing kit has no training setup (Kit.training) "
                          "(docs/certify-a-backend.md)")
    return training(acc)
