"""unified: one Accelerator API for distributed training on PyTorch and JAX.

Importing this package imports neither torch nor jax; a backend's framework is imported when
an `Accelerator` selects that backend.

Example:
    >>> from unified import Accelerator
    >>> accelerator = Accelerator()
    >>> accelerator.print("process", accelerator.process_index, "of", accelerator.num_processes)
"""
from . import utils
from .accelerator import Accelerator
from .backend import Backend
from .backend.registry import available_backends
from .compat.kwargs_handlers import (
                     AutocastKwargs,
                     DistributedDataParallelKwargs,
                     GradScalerKwargs,
                     InitProcessGroupKwargs,
)
from .config import DataLoaderConfiguration, DistributedType, ProjectConfiguration
from .data import DataLoader, skip_first_batches
from .errors import (
                     BackendUnavailable,
                     BarrierTimeout,
                     CheckpointError,
                     DistributedError,
                     MissingCapability,
                     UnifiedError,
)
from .logging import get_logger, tqdm
from .runtime.preemption import PREEMPTED_EXIT_CODE
from .training.parallelism import ParallelismConfig
from .training.sharding import FullyShardedDataParallelPlugin

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "Backend",
    "BackendUnavailable",
    "BarrierTimeout",
    "CheckpointError",
    "DataLoader",
    "DataLoaderConfiguration",
    "DistributedError",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "ParallelismConfig",
    "MissingCapability",
    "PREEMPTED_EXIT_CODE",
    "ProjectConfiguration",
    "UnifiedError",
    "available_backends",
    "get_logger",
    "skip_first_batches",
    "tqdm",
    "utils",
]
