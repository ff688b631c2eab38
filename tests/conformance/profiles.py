"""What the conformance suite needs to know of each backend: the training setup its checkpoint
scenarios run, and the few expectations that differ by framework.

The built-in backends' profiles are below; a backend from outside ships its own profile through
the ``unified.test_profiles`` entry-point group (an entry named like the backend, pointing to a
`Profile`), so that the suite runs on it without an edit here.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any, Dict, Optional

from unified.registry import load_object

PROFILE_GROUP = "unified.test_profiles"


@dataclasses.dataclass(frozen=True)
class Profile:
    """Attributes:
        training: ``"module:Class"`` of the tiny training setup (see `training.py`); called
            with the Accelerator.
        distributed_type: ``accelerator.distributed_type`` expected in a CPU group.
        torch_worker_loaders: run the torch-DataLoader-with-workers scenario on this backend.
        loop_setup: ``"module:Class"`` of the training-loop setup (see `loop_scenarios.py`) of a
            backend with the TrainingLoop capability; ``None`` skips the training-loop suite.
        torch_loaders: the backend prepares torch DataLoaders (custom samplers, metrics scenarios).
        health_channel: the backend has a `Backend.health_channel` in a process group, through
            which a process that cannot write its part of an async save tells the others at once.
        sharded_training: run the torch sharded-training scenarios (``fsdp_plugin``, test_sharding.py).
        sharded_setup: ``"module:Class"`` of the JAX-style sharded-state setup (see `sharding_jax_scenarios.py`)
            of a backend with the ShardedTraining capability; ``None`` skips the sharded suite.
    """

    training: str
    distributed_type: str
    torch_worker_loaders: bool = False
    loop_setup: Optional[str] = None
    torch_loaders: bool = False
    health_channel: bool = True
    sharded_training: bool = False
    sharded_setup: Optional[str] = None


_BUILT_IN: Dict[str, Profile] = {
    "torch": Profile("training:TorchTraining", "MULTI_CPU", torch_worker_loaders=True,
                     loop_setup="loop_scenarios:TorchSetup", torch_loaders=True,
                     sharded_training=True),
    "jax": Profile("training:JaxTraining", "JAX", loop_setup="loop_scenarios:JaxSetup", torch_loaders=True,
                   sharded_setup="sharding_jax_scenarios:JaxShardedSetup"),
}


def profile(backend: str) -> Profile:
    """The profile of ``backend``: built in, or from the ``unified.test_profiles`` entry points."""
    if backend in _BUILT_IN:
        return _BUILT_IN[backend]
    for entry in importlib.metadata.entry_points(group=PROFILE_GROUP):
        if entry.name == backend:
            return entry.load()
    raise LookupError(f"no conformance profile for backend {backend!r}: add an entry to the "
                      f"{PROFILE_GROUP!r} entry-point group")


def make_training(acc: Any) -> Any:
    """The training setup of ``acc``'s backend."""
    return load_object(profile(acc.backend).training)(acc)
