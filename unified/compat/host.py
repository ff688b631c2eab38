"""What Accelerate's compatibility names use of the `unified.Accelerator`, declared: `SurfaceHost`
is the protocol of the Accelerator's public names that `AccelerateSurface` (mixed into it) and
`AcceleratorState` read, and `HostParts` the composed objects the Accelerator hands them
explicitly when it is made (its backend, collectives, training loop, trackers, prepared objects
and state hooks). Nothing in `unified.compat` reads the Accelerator's private attributes
(``tests/unit/test_compat_composition.py`` holds it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from ..api.prepared import PreparedObjects
    from ..backend import Backend, TrainingLoop
    from ..config import DataLoaderConfiguration, DistributedType, ProjectConfiguration
    from ..runtime.collectives import Collectives
    from ..tracking.registry import TrackerSet
    from ..training.loop import GradientState
    from ..training.sharding import FullyShardedDataParallelPlugin
    from .hooks import StateHooks

__all__ = ["SurfaceHost", "HostParts"]


class SurfaceHost(Protocol):
    """The `unified.Accelerator`'s public names that Accelerate's compatibility names read."""

    mixed_precision: str
    fsdp_plugin: Optional["FullyShardedDataParallelPlugin"]
    dataloader_config: "DataLoaderConfiguration"
    project_configuration: "ProjectConfiguration"
    gradient_state: "GradientState"

    @property
    def process_index(self) -> int: ...

    @property
    def local_process_index(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def is_main_process(self) -> bool: ...

    @property
    def is_local_main_process(self) -> bool: ...

    @property
    def is_last_process(self) -> bool: ...

    @property
    def device(self) -> Any: ...

    @property
    def distributed_type(self) -> "DistributedType": ...

    def prepare(self, *objects: Any, device_placement: Any = None) -> Any: ...

    def wait_for_checkpoint(self) -> None: ...

    def wait_for_everyone(self) -> None: ...

    def end_training(self) -> None: ...


@dataclass(frozen=True)
class HostParts:
    """The objects an Accelerator is composed of that Accelerate's names work through.

    Attributes:
        backend: the `unified.Backend` (its primitives: weights, saving objects, device memory).
        collectives: the timed collectives of the group.
        loop: the backend's `TrainingLoop`, or None when the run asks nothing of one.
        trackers: the experiment trackers (``log_with``).
        prepared: what ``prepare`` returned (`unified.api.prepared.PreparedObjects`).
        hooks: the save- and load-state pre hooks (`unified.compat.hooks.StateHooks`).
    """

    backend: "Backend"
    collectives: "Collectives"
    loop: Optional["TrainingLoop"]
    trackers: "TrackerSet"
    prepared: "PreparedObjects"
    hooks: "StateHooks"
