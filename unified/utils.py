"""Accelerate-compatible helpers: ``from unified.utils import set_seed, ProjectConfiguration``,
the kwargs handlers, the function forms of the collectives and the memory helpers."""
import contextlib
import os
from typing import Any, Iterator

from .compat.kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from .compat.operations import (
    broadcast,
    broadcast_object_list,
    find_executable_batch_size,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    release_memory,
)
from .config import DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin, ProjectConfiguration
from .logging import tqdm
from .runtime.rng import set_seed
from .tracking import LoggerType
from .training.parallelism import ParallelismConfig
from .training.sharding import FullyShardedDataParallelPlugin

__all__ = ["set_seed", "ProjectConfiguration", "DataLoaderConfiguration", "GradientAccumulationPlugin",
           "DistributedType", "LoggerType", "tqdm", "KwargsHandler", "DistributedDataParallelKwargs",
           "GradScalerKwargs", "InitProcessGroupKwargs", "AutocastKwargs", "gather_object", "broadcast_object_list",
           "gather", "reduce", "broadcast", "pad_across_processes", "release_memory", "find_executable_batch_size",
           "patch_environment", "ParallelismConfig", "FullyShardedDataParallelPlugin"]


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables (names upper-cased, values as strings) for the ``with`` block,
    then put back what was there (Accelerate's ``patch_environment``).

    Example:
        >>> with patch_environment(unified_backend="torch"):
        ...     accelerator = Accelerator()   # doctest: +SKIP
    """
    saved = {}
    for key, value in kwargs.items():
        key = key.upper()
        saved[key] = os.environ.get(key)
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
