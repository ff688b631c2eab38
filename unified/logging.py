"""``from unified.logging import get_logger``, as ``accelerate.logging`` offers it."""
from .log import MultiProcessAdapter, get_logger

__all__ = ["get_logger", "MultiProcessAdapter"]
