"""Logging and progress bars that speak from the main process only (unless asked otherwise);
``from unified.logging import get_logger``, as ``accelerate.logging`` offers it.

They need no Accelerator: the process index comes from the variables every launcher sets
(`unified.runtime.environment.ProcessEnvironment`), so they also work at import time, before the
Accelerator exists.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import time
from typing import Any, Dict, MutableMapping, Optional, Tuple

from .runtime.environment import ProcessEnvironment

__all__ = ["get_logger", "tqdm", "process_index_from_env", "MultiProcessAdapter", "PROGRESS_INTERVAL"]

# Seconds between two lines of a progress bar whose output is not a terminal (a log file, a pipe,
# the launcher): tqdm's TQDM_MININTERVAL variable or a bar's own mininterval= overrides it.
PROGRESS_INTERVAL = 30.0


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
        # the record names the caller's file and line, not this module's (as Accelerate's does)
        kwargs.setdefault("stacklevel", 2)
        self._log(level, msg, args, main_process_only, local, kwargs)

    def _log(self, level: int, msg: Any, args: Any, main_process_only: bool, local: bool,
             kwargs: MutableMapping[str, Any]) -> None:
        if main_process_only and process_index_from_env(local) != 0:
            return
        if self.isEnabledFor(level):
            if not main_process_only:
                msg = f"[process {process_index_from_env()}] {msg}"
            kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1  # and this frame
            self.logger.log(level, msg, *args, **kwargs)

    def _at(self, level: int, msg: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        """`log` for the level-named methods: one frame more between the caller and the logger."""
        kwargs.setdefault("stacklevel", 2)
        kwargs["stacklevel"] += 1
        self._log(level, msg, args, kwargs.pop("main_process_only", True), kwargs.pop("local", False), kwargs)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> Tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self._at(logging.DEBUG, msg, args, kwargs)

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self._at(logging.INFO, msg, args, kwargs)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self._at(logging.WARNING, msg, args, kwargs)

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self._at(logging.ERROR, msg, args, kwargs)


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
    """``tqdm.auto.tqdm`` that is silent off the main process (like Accelerate's), and sparse
    when its output is not a terminal.

    Written into a log, a pipe or through ``unified launch`` (whose processes write into pipes),
    the bar prints whole lines instead of redrawing one: its first state, then at most one line
    every `PROGRESS_INTERVAL` seconds (30; ``TQDM_MININTERVAL`` or ``mininterval=`` change it,
    ``set_postfix`` and ``refresh`` too wait for it), and its final state when it closes. On a
    terminal and in notebooks it is tqdm's own bar.

    Example:
        >>> for batch in unified.tqdm(loader, desc="train"):
        ...     ...
    """
    from tqdm.auto import tqdm as _tqdm

    if main_process_only and process_index_from_env() != 0:
        kwargs["disable"] = True
        return _tqdm(*args, **kwargs)
    if _is_terminal(kwargs.get("file")) or any(c.__module__ == "tqdm.notebook" for c in _tqdm.__mro__):
        return _tqdm(*args, **kwargs)
    if "mininterval" not in kwargs:
        kwargs["mininterval"] = float(os.environ.get("TQDM_MININTERVAL", PROGRESS_INTERVAL))
    # tqdm's monitor thread refreshes a bar silent for maxinterval seconds: no sooner than a line is due
    kwargs["maxinterval"] = max(float(kwargs.get("maxinterval", 10.0)), kwargs["mininterval"])
    return _line_bar(_tqdm)(*args, **kwargs)


def _is_terminal(file: Any) -> bool:
    try:
        return bool((file if file is not None else sys.stderr).isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


@functools.lru_cache(maxsize=None)
def _line_bar(base: type) -> type:
    """``base`` (a tqdm class) printing one line per update, at most one per ``mininterval``."""

    class LineProgressBar(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._line_interval = float(kwargs["mininterval"])
            self._last_line: Optional[float] = None
            super().__init__(*args, **kwargs)

        def display(self, msg: Optional[str] = None, pos: Optional[int] = None) -> bool:
            if msg == "":  # tqdm clearing a bar closed with leave=False: nothing to erase in a log
                return False
            closing = self.disable  # close() disables the bar, displays it one last time, then writes "\n"
            now = time.monotonic()
            if not closing and self._last_line is not None and now - self._last_line < self._line_interval:
                return True
            self._last_line = now
            text = self.__str__() if msg is None else msg
            self.fp.write(text if closing else text + "\n")
            self.fp.flush()
            return True

        def clear(self, nolock: bool = False) -> None:  # before tqdm.write(): lines need no erasing
            pass

        def moveto(self, n: int) -> None:  # nested bars: one line each, no cursor movement
            pass

    LineProgressBar.__name__ = LineProgressBar.__qualname__ = f"Line{base.__name__}"
    return LineProgressBar
