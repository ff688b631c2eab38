"""``accelerator.state``: Accelerate's `AcceleratorState` as scripts read it (its fields and how it
prints), a read-only view of one `Accelerator` through its public names (`unified.compat.host.SurfaceHost`)
and its backend, handed to it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..errors import see

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
    dynamo_plugin = None

    def __init__(self, accelerator: "SurfaceHost", backend: "Backend") -> None:
        self._accelerator = accelerator
        self._backend = backend

    @property
    def distributed_type(self) -> "DistributedType":
        """The Accelerator's `DistributedType`, unless assigned here (below)."""
        override = self.__dict__.get("_distributed_type")
        return override if override is not None else self._accelerator.distributed_type

    @distributed_type.setter
    def distributed_type(self, value: "DistributedType") -> None:
        """Accelerate's own tests assign it to act as another kind of run (its state is a mutable
        singleton). Here it changes what this view shows and what ``join_uneven_inputs`` decides
        on, nothing of how the run trains (docs/migration.md)."""
        self._distributed_type = value
    num_processes = property(lambda self: self._accelerator.num_processes)
    process_index = property(lambda self: self._accelerator.process_index)
    local_process_index = property(lambda self: self._accelerator.local_process_index)
    is_main_process = property(lambda self: self._accelerator.is_main_process)
    is_local_main_process = property(lambda self: self._accelerator.is_local_main_process)
    is_last_process = property(lambda self: self._accelerator.is_last_process)
    device = property(lambda self: self._accelerator.device)
    mixed_precision = property(lambda self: self._accelerator.mixed_precision)
    fsdp_plugin = property(lambda self: self._accelerator.fsdp_plugin)
    # Accelerate's ``state.parallelism_config``: the Accelerator's `unified.ParallelismConfig` (None without one)
    parallelism_config = property(lambda self: getattr(self._accelerator, "parallelism_config", None))
    initialized = property(lambda self: True)

    @property
    def backend(self) -> Optional[str]:
        """The group's communication library (``"gloo"``, ``"nccl"``), None with one process."""
        return self._backend.communication_backend

    @property
    def use_distributed(self) -> bool:
        """Whether several processes run (Accelerate: ``num_processes > 1``)."""
        return self.num_processes > 1

    def wait_for_everyone(self) -> None:
        """Accelerate's ``AcceleratorState.wait_for_everyone``: the Accelerator's barrier.

        Example:
            >>> accelerator.state.wait_for_everyone()          # doctest: +SKIP
        """
        self._accelerator.wait_for_everyone()

    def destroy_process_group(self, group: Any = None) -> None:
        """Accelerate's ``AcceleratorState.destroy_process_group()``: leave the process group, as
        ``accelerator.end_training()`` does (pending saves finished, trackers closed, every
        process waited for). unified hands out no sub-groups, so ``group`` must be None.

        Example:
            >>> accelerator.state.destroy_process_group()      # doctest: +SKIP
        """
        if group is not None:
            raise NotImplementedError("AcceleratorState.destroy_process_group(group=...) is not supported: unified "
                                      "creates no sub-groups; call it without a group (or accelerator.end_training())."
                                      + see("not-supported-yet"))
        self._accelerator.end_training()

    def __repr__(self) -> str:
        kind: "DistributedType" = self.distributed_type
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (f"Distributed environment: DistributedType.{kind.name}{backend}\n"
                f"Num processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\n"
                f"Device: {self.device}\n"
                f"\nMixed precision type: {self.mixed_precision}\n")

