"""``accelerator.state``: Accelerate's `AcceleratorState` as scripts read it (its fields and how it
prints), a read-only view of one `Accelerator` through its public names (`unified.compat.host.SurfaceHost`)
and its backend, handed to it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ..backend import Backend
    from ..config import DistributedType
    from .host import SurfaceHost

__all__ = ["AcceleratorState"]


class AcceleratorState:
    """What ``accelerator.state`` shows: the process group, the device and the precision.

    Hugging Face's ``*_no_trainer`` scripts log it on every process
    (``logger.info(accelerator.state, main_process_only=False)``); it prints as Accelerate's does.

    Example:
        >>> print(accelerator.state)                   # doctest: +SKIP
        Distributed environment: DistributedType.MULTI_CPU  Backend: gloo
        Num processes: 2
        Process index: 0
        Local process index: 0
        Device: cpu
        <BLANKLINE>
        Mixed precision type: no
        <BLANKLINE>
    """

    # Accelerate's plugins that unified has no counterpart for: always None here.
    deepspeed_plugin = None
    megatron_lm_plugin = None
    torch_tp_plugin = None
    parallelism_config = None
    dynamo_plugin = None

    def __init__(self, accelerator: "SurfaceHost", backend: "Backend") -> None:
        self._accelerator = accelerator
        self._backend = backend

    distributed_type = property(lambda self: self._accelerator.distributed_type)
    num_processes = property(lambda self: self._accelerator.num_processes)
    process_index = property(lambda self: self._accelerator.process_index)
    local_process_index = property(lambda self: self._accelerator.local_process_index)
    is_main_process = property(lambda self: self._accelerator.is_main_process)
    is_local_main_process = property(lambda self: self._accelerator.is_local_main_process)
    is_last_process = property(lambda self: self._accelerator.is_last_process)
    device = property(lambda self: self._accelerator.device)
    mixed_precision = property(lambda self: self._accelerator.mixed_precision)
    fsdp_plugin = property(lambda self: self._accelerator.fsdp_plugin)
    initialized = property(lambda self: True)

    @property
    def backend(self) -> Optional[str]:
        """The group's communication library (``"gloo"``, ``"nccl"``), None with one process."""
        return self._backend.communication_backend

    @property
    def use_distributed(self) -> bool:
        """Whether several processes run (Accelerate: ``num_processes > 1``)."""
        return self.num_processes > 1

    def __repr__(self) -> str:
        kind: "DistributedType" = self.distributed_type
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (f"Distributed environment: DistributedType.{kind.name}{backend}\n"
                f"Num processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\n"
                f"Device: {self.device}\n"
                f"\nMixed precision type: {self.mixed_precision}\n")

