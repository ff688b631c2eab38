"""Accelerate-compatible helpers: ``from unified.utils import set_seed, ProjectConfiguration``."""
from .config import DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin, ProjectConfiguration
from .logging import tqdm
from .rng import set_seed
from .tracking import LoggerType

__all__ = ["set_seed", "ProjectConfiguration", "DataLoaderConfiguration", "GradientAccumulationPlugin", "DistributedType", "LoggerType", "tqdm"]
