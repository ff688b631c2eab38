"""The `Accelerator` facade: one object that wires a backend to the shared semantics."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Iterator, Optional, TypeVar, Union

from .backend import Backend, create_backend, resolve_backend_name
from .collectives import Collectives
from .config import DistributedType, ProjectConfiguration
from .rng import set_seed

__all__ = ["Accelerator"]

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_TIMEOUT = 1800.0


class Accelerator:
    """One API for distributed training on PyTorch and on JAX.

    Args:
        backend: ``"torch"``, ``"jax"``, a `unified.Backend` instance, or ``None`` to use
            ``UNIFIED_BACKEND``, the launcher's choice, the only installed framework, or torch.
        project_dir: shortcut for ``ProjectConfiguration(project_dir=...)``.
        project_config: a `ProjectConfiguration` (checkpoint naming and retention).
        seed: seeds Python, NumPy and the framework (and the JAX key stream) on every process.
        timeout: default seconds any collective waits for the other processes (1800).

    Example:
        >>> from unified import Accelerator
        >>> accelerator = Accelerator(seed=0)
        >>> accelerator.num_processes
        1
    """

    def __init__(
        self,
        backend: Union[str, Backend, None] = None,
        project_dir: Optional[str] = None,
        project_config: Optional[ProjectConfiguration] = None,
        seed: Optional[int] = None,
        timeout: float = DEFAULT_TIMEOUT,
        **accelerate_kwargs: Any,
    ) -> None:
        _reject_unknown(accelerate_kwargs)
        if isinstance(backend, Backend):
            self._backend = backend
        else:
            self._backend = create_backend(resolve_backend_name(backend))
        self._backend.start(float(timeout))
        self._collectives = Collectives(self._backend, timeout)
        self._trigger = False
        self.project_configuration = project_config if project_config is not None else ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        self.seed = seed
        if seed is not None:
            set_seed(seed, self._backend)
        self._init_state()

    def _init_state(self) -> None:
        """Hook for the checkpoint and data mixins (kept empty here)."""

    # -- identity -----------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The backend's name, ``"torch"`` or ``"jax"``."""
        return self._backend.name

    @property
    def process_index(self) -> int:
        """This process's index in ``0 .. num_processes - 1``."""
        return self._backend.process_index

    @property
    def local_process_index(self) -> int:
        """This process's index among the processes of its machine."""
        return self._backend.local_process_index

    @property
    def num_processes(self) -> int:
        """Number of processes in the group."""
        return self._backend.num_processes

    @property
    def is_main_process(self) -> bool:
        """True on process 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on the first process of each machine."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """True on process ``num_processes - 1``."""
        return self.process_index == self.num_processes - 1

    @property
    def device(self) -> Any:
        """This process's device: a ``torch.device`` or a ``jax.Device``."""
        return self._backend.device

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's distributed type (``NO`` for one process; ``JAX`` for a JAX group)."""
        return DistributedType(self._backend.distributed_type)

    @property
    def project_dir(self) -> Optional[str]:
        """``project_configuration.project_dir``."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> Optional[str]:
        """``project_configuration.logging_dir``."""
        return self.project_configuration.logging_dir

    # -- running and deferring jobs ---------------------------------------------------------
    def wait_for_everyone(self, timeout: Optional[float] = None) -> None:
        """Block until every process reached this call (a no-op with one process).

        Raises `unified.BarrierTimeout` naming the missing processes when some process does
        not arrive within ``timeout`` seconds (default: the Accelerator's) or died.

        Example:
            >>> accelerator.wait_for_everyone()
            >>> accelerator.wait_for_everyone(timeout=60)
        """
        self._collectives.barrier("wait_for_everyone", timeout)

    def main_process_first(self) -> "contextlib.AbstractContextManager[None]":
        """Run the body on the main process first, then on the others; all leave together.

        An exception in any process's body reaches the others as `unified.DistributedError`.

        Example:
            >>> with accelerator.main_process_first():
            ...     dataset = prepare_dataset()      # downloads once, others read the cache
        """
        return self._collectives.ordered(self.is_main_process, "main_process_first")

    def local_main_process_first(self) -> "contextlib.AbstractContextManager[None]":
        """Like `main_process_first`, with the first process of each machine going first.

        Example:
            >>> with accelerator.local_main_process_first():
            ...     cache = build_local_cache()
        """
        return self._collectives.ordered(self.is_local_main_process, "local_main_process_first")

    def set_trigger(self) -> None:
        """Raise this process's trigger flag; `check_trigger` reports it on every process.

        Example:
            >>> if loss < target:
            ...     accelerator.set_trigger()
        """
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process, in the same call, if any process called `set_trigger` since
        the last check; resets the flag. A collective: every process must call it equally often.

        Example:
            >>> if accelerator.check_trigger():
            ...     break
        """
        fired = self._collectives.any_flag(self._trigger, "check_trigger")
        self._trigger = False
        return fired

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main process only.

        Example:
            >>> accelerator.print("epoch", 3, "loss", 0.25)
        """
        if self.is_main_process:
            print(*args, **kwargs)

    def on_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on the main process only (elsewhere it returns ``None``).

        Example:
            >>> @accelerator.on_main_process
            ... def log(msg):
            ...     print(msg)
        """
        return _only_if(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on the first process of each machine only.

        Example:
            >>> @accelerator.on_local_main_process
            ... def clean_tmp():
            ...     ...
        """
        return _only_if(lambda: self.is_local_main_process, function)

    # -- collectives on arrays ----------------------------------------------------------------
    def gather(self, tree: Any) -> Any:
        """Concatenate every process's arrays along the first axis, on every process.

        Works on framework tensors/arrays and dicts/lists/tuples of them; 0-d values become
        one element per process.

        Example:
            >>> accelerator.gather(torch.tensor([accelerator.process_index]))   # tensor([0, 1])
        """
        return self._collectives.gather(tree)

    def reduce(self, tree: Any, reduction: str = "sum") -> Any:
        """Element-wise ``"sum"`` or ``"mean"`` over processes, on every process.

        Example:
            >>> accelerator.reduce({"loss": loss}, "mean")
        """
        return self._collectives.reduce(tree, reduction)

    def broadcast(self, tree: Any, from_process: int = 0) -> Any:
        """Every process receives ``from_process``'s arrays (same shapes on every process).

        Example:
            >>> weights = accelerator.broadcast(weights, from_process=0)
        """
        return self._collectives.broadcast(tree, from_process)

    def gather_object(self, value: Any) -> list:
        """Every process's JSON-serialisable ``value``, in process order (no pickle).

        Example:
            >>> accelerator.gather_object({"rank": accelerator.process_index})
        """
        return self._collectives.all_gather_json(value)

    # -- the end ------------------------------------------------------------------------------
    def end_training(self) -> None:
        """Finish pending work, wait for every process and leave the process group.

        Example:
            >>> accelerator.end_training()
        """
        self._finish_pending()
        self._collectives.barrier("end_training")
        self._backend.shutdown()

    def _finish_pending(self) -> None:
        """Hook for background checkpoint writes (kept empty here)."""

    def __repr__(self) -> str:
        return (
            f"Accelerator(backend={self.backend!r}, process {self.process_index}/{self.num_processes}, "
            f"device={self.device})"
        )


def _only_if(condition: Callable[[], bool], function: F) -> F:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if condition():
            return function(*args, **kwargs)
        return None

    return wrapper  # type: ignore[return-value]


# Accelerate keywords accepted so that scripts run unchanged, with the values that mean
# "nothing special"; any other value is refused rather than silently ignored.
_NEUTRAL_ACCELERATE_KWARGS = {
    "mixed_precision": (None, "no"),
    "gradient_accumulation_steps": (1,),
    "cpu": (False, True),
    "log_with": (None,),
    "split_batches": (False,),
    "dispatch_batches": (None, False),
    "even_batches": (True,),
    "device_placement": (True,),
    "step_scheduler_with_optimizer": (True,),
    "kwargs_handlers": (None, []),
    "rng_types": (None,),
}


def _reject_unknown(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name not in _NEUTRAL_ACCELERATE_KWARGS:
            raise TypeError(
                f"Accelerator() got an unexpected keyword argument {name!r}. Accepted: backend, "
                f"project_dir, project_config, seed, timeout, and Accelerate's "
                f"{', '.join(sorted(_NEUTRAL_ACCELERATE_KWARGS))} at their default values."
            )
        if value not in _NEUTRAL_ACCELERATE_KWARGS[name]:
            raise NotImplementedError(
                f"Accelerator({name}={value!r}) is not supported by unified yet; remove the argument "
                f"or pass one of {_NEUTRAL_ACCELERATE_KWARGS[name]!r}."
            )
