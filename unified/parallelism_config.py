"""``from unified.parallelism_config import ParallelismConfig``: Accelerate's module path for
`unified.ParallelismConfig` (defined in `unified.training.parallelism`), so that a script that
imports it from ``accelerate.parallelism_config`` changes only the package name.

Example:
    >>> from unified.parallelism_config import ParallelismConfig
    >>> ParallelismConfig(dp_shard_size=2, tp_size=2).tp_enabled
    True
"""
from .training.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
