"""Logging and progress bars that speak from the main process only (unless asked otherwise);
``from unified.logging import get_logger``, as ``accelerate.logging`` offers it.

They need no Accelerator: the process index comes from the variables every launcher sets
(`unified.environment.ProcessEnvironment`), so they also work at import time, before the
Accelerator exists.
"""
from __future__ import annotations

import logging
import os
from typing import Any, MutableMapping, Optional, Tuple

from .environment import ProcessEnvironment

__all__ = ["get_logger", "tqdm", "process_index_from_env", "MultiProcessAdapter"]


def process_index_from_env(local: bool = False) -> int:
    """This process's (local) index as the launcher announced it; 0 for a plain process."""
    env = ProcessEnvironment.from_env()
    return env.local_process_index if local else env.process_index


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger whose calls accept ``main_process_only`` (default True) and ``local=False``
    (first process of each machine instead of process 0); messages are prefixed with the
    process index when every process logs."""

    def log(self, level: int, msg: Any, *args: Any, main_process_only: bool = True,
            local: bool = False, **kwargs: Any) -> None:
        if main_process_only and process_index_from_env(local) != 0:
            return
        if self.isEnabledFor(level):
            if not main_process_only:
                msg = f"[process {process_index_from_env()}] {msg}"
            self.logger.log(level, msg, *args, **kwargs)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> Tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, **kwargs)


def get_logger(name: str, log_level: Optional[str] = None) -> MultiProcessAdapter:
    """A logger that prints from the main process only, unless a call says
    ``main_process_only=False``.

    Example:
        >>> logger = unified.get_logger(__name__, log_level="INFO")
        >>> logger.info("starting")                           # process 0 only
        >>> logger.info("my shard is ready", main_process_only=False)
    """
    logger = logging.getLogger(name)
    level = log_level or os.environ.get("UNIFIED_LOG_LEVEL")
    if level:
        logger.setLevel(level.upper())
        if not logging.getLogger().handlers and not logger.handlers:
            logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return MultiProcessAdapter(logger, {})


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm`` that is silent off the main process (like Accelerate's).

    Example:
        >>> for batch in unified.tqdm(loader, desc="train"):
        ...     ...
    """
    from tqdm.auto import tqdm as _tqdm

    if main_process_only and process_index_from_env() != 0:
        kwargs["disable"] = True
    return _tqdm(*args, **kwargs)
