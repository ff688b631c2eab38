"""Accelerate's kwargs handlers (``Accelerator(kwargs_handlers=[...])``): dataclasses whose
fields that differ from their defaults reach the framework's own call (DDP's constructor,
``GradScaler``, ``torch.autocast``, the process group's timeout). `resolve_handlers` turns a list
of them into what the Accelerator and the backend use; a handler or value unified does not
implement is a clear error when the Accelerator is made."""
from __future__ import annotations

import copy
import dataclasses
import datetime
from typing import Any, Dict, Iterable, Optional

from ..errors import see

__all__ = ["KwargsHandler", "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs",
           "AutocastKwargs", "Handlers", "options_of", "resolve_handlers"]


class KwargsHandler:
    """Accelerate's mixin: `to_kwargs` gives the fields that differ from the class's defaults.

    Example:
        >>> DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs()
        {'find_unused_parameters': True}
    """

    def to_dict(self) -> Dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> Dict[str, Any]:
        default = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if default[k] != v}


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Keyword arguments for torch's ``DistributedDataParallel`` around each prepared model
    (torch with several processes). Communication hooks are not supported.

    Example:
        >>> handler = DistributedDataParallelKwargs(find_unused_parameters=True)
        >>> accelerator = Accelerator(kwargs_handlers=[handler])   # doctest: +SKIP
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Any = "no"
    comm_wrapper: Any = "no"
    comm_state_option: Dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """Keyword arguments for the fp16 loss scaler (torch's ``GradScaler``).

    Example:
        >>> handler = GradScalerKwargs(init_scale=1024.0)
        >>> accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[handler])   # doctest: +SKIP
    """

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclasses.dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """The process group's set-up: ``timeout`` becomes the Accelerator's ``timeout`` (every
    collective's deadline, and torch's process-group timeout). unified chooses the communication
    library itself (gloo on CPU, NCCL on GPU): ``backend`` may be ``"nccl"``, ``"gloo"`` or None
    and does not change that choice; it joins through the launcher's environment, so
    ``init_method`` keeps its default.

    Example:
        >>> handler = InitProcessGroupKwargs(timeout=datetime.timedelta(hours=2))
        >>> accelerator = Accelerator(kwargs_handlers=[handler])   # doctest: +SKIP
    """

    backend: Optional[str] = "nccl"
    init_method: Optional[str] = None
    timeout: Optional[datetime.timedelta] = None


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    """Keyword arguments for ``torch.autocast`` around prepared forwards (mixed precision).

    Example:
        >>> handler = AutocastKwargs(cache_enabled=False)
        >>> accelerator = Accelerator(mixed_precision="bf16", kwargs_handlers=[handler])   # doctest: +SKIP
    """

    enabled: bool = True
    cache_enabled: Optional[bool] = None


@dataclasses.dataclass
class Handlers:
    """What a list of kwargs handlers asks for: the handlers themselves (Accelerate's
    ``ddp_handler`` and friends) and the options the backend applies."""

    ddp_handler: Optional[Any] = None
    scaler_handler: Optional[Any] = None
    init_handler: Optional[Any] = None
    autocast_handler: Optional[Any] = None
    timeout: Optional[float] = None


def options_of(handler: Optional[Any]) -> Dict[str, Any]:
    """A handler's fields that differ from their defaults (``{}`` without a handler)."""
    return handler.to_kwargs() if handler is not None else {}


_SLOTS = {"DistributedDataParallelKwargs": "ddp_handler", "GradScalerKwargs": "scaler_handler",
          "InitProcessGroupKwargs": "init_handler", "AutocastKwargs": "autocast_handler"}


def resolve_handlers(handlers: Optional[Iterable[Any]]) -> Handlers:
    """`Handlers` from ``kwargs_handlers`` (unified's classes, or Accelerate's of the same names);
    one of each kind at most, as in Accelerate.

    Example:
        >>> resolve_handlers([InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))]).timeout
        60.0
    """
    resolved = Handlers()
    for handler in handlers or []:
        slot = _SLOTS.get(type(handler).__name__)
        if slot is None or not callable(getattr(handler, "to_kwargs", None)):
            raise NotImplementedError(f"kwargs_handlers: {type(handler).__name__} is not supported by unified; it "
                                      f"takes {', '.join(_SLOTS)}." + see("not-supported-yet"))
        if getattr(resolved, slot) is not None:
            raise ValueError(f"You can only pass one {type(handler).__name__} in `kwargs_handlers`."
                             + see("not-supported-yet"))
        setattr(resolved, slot, handler)
    ddp = options_of(resolved.ddp_handler)
    if "comm_hook" in ddp or "comm_wrapper" in ddp:  # `to_kwargs` keeps only what differs from the defaults
        raise NotImplementedError("DistributedDataParallelKwargs(comm_hook=...) is not supported by unified: DDP keeps "
                                  "its default all-reduce." + see("not-supported-yet"))
    init = options_of(resolved.init_handler)
    if init.get("init_method") is not None or init.get("backend", "nccl") not in (None, "nccl", "gloo"):
        raise NotImplementedError("InitProcessGroupKwargs(backend=..., init_method=...) is not supported by unified: "
                                  "it picks gloo on CPU and NCCL on GPU and joins through the launcher's environment; "
                                  "only timeout= is taken." + see("not-supported-yet"))
    if init.get("timeout") is not None:
        resolved.timeout = init["timeout"].total_seconds()
    return resolved
