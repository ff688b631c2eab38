"""The trackers of a run: the built-in registry (`TRACKERS`, Accelerate's `LOGGER_TYPE_TO_CLASS`,
`register_tracker_class`), what ``log_with`` asks for (`resolve_log_with`), values brought to
the host (`to_host`), and one Accelerator's `TrackerSet`."""
from __future__ import annotations

import enum
import importlib
import importlib.util
import os
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import numpy as np

from ..errors import see
from .base import EXTRA, GeneralTracker, LoggerType, NoOpTracker, TrackerUnavailable, logger, random_streams_untouched
from .mlflow_tracker import MLflowTracker
from .tensorboard_tracker import TensorBoardTracker
from .wandb_tracker import WandBTracker

TRACKERS: Dict[str, type] = {"tensorboard": TensorBoardTracker, "mlflow": MLflowTracker, "wandb": WandBTracker}
_BUILT_IN = dict(TRACKERS)
LOGGER_TYPE_TO_CLASS = TRACKERS  # Accelerate's name for the same registry


def _is_tracker(obj: Any) -> bool:
    """A tracker object: ours, or one with Accelerate's `GeneralTracker` interface (an
    ``accelerate.tracking.GeneralTracker`` subclass works as it is)."""
    return isinstance(obj, GeneralTracker) or (
        not isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in ("log", "store_init_configuration"))
        and isinstance(getattr(obj, "name", None), str))


def register_tracker_class(tracker_class: type) -> None:
    """Make ``tracker_class`` usable by its ``name`` in ``log_with``, as Accelerate's
    ``register_tracker_class``: it subclasses `GeneralTracker` (ours or Accelerate's) and defines
    ``name`` and ``requires_logging_directory``. `init_trackers` builds it as
    ``tracker_class(project_name, logging_dir, **init_kwargs[name])`` when it needs a logging
    directory, else ``tracker_class(project_name, **init_kwargs[name])``. Register it before the
    Accelerator that uses it is made; a name already taken is overwritten with a warning.

    Example:
        >>> class MyTracker(GeneralTracker):
        ...     name = "my_tracker"
        ...     requires_logging_directory = False
        ...     def __init__(self, run_name, **kwargs):
        ...         super().__init__()
        ...     tracker = None
        >>> register_tracker_class(MyTracker)
        >>> accelerator = Accelerator(log_with="my_tracker")   # doctest: +SKIP
    """
    accelerate_like = isinstance(tracker_class, type) and any(
        base.__name__ == "GeneralTracker" for base in tracker_class.__mro__)
    if not accelerate_like:
        raise ValueError(f"`tracker_class` must be a subclass of `GeneralTracker`, but got {tracker_class}."
                         + see("custom-tracker"))
    if not getattr(tracker_class, "name", None):
        raise ValueError("The tracker class to register must define a non-empty `name` attribute."
                         + see("custom-tracker"))
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError("The tracker class to register must define a `requires_logging_directory` class attribute "
                         "(True if it needs a logging directory)." + see("custom-tracker"))
    name = tracker_class.name
    if name in TRACKERS:
        warnings.warn(f"A tracker with the name '{name}' is already registered and will be overwritten by "
                      f"{tracker_class}.", UserWarning, stacklevel=2)
    TRACKERS[name] = tracker_class


def _build(name: str, project_name: str, logging_dir: Optional[str], kwargs: Dict[str, Any]) -> Any:
    """The tracker registered as ``name`` for a run called ``project_name``."""
    cls = TRACKERS[name]
    if _BUILT_IN.get(name) is cls:
        return cls(project_name, logging_dir=logging_dir, **kwargs)
    if cls.requires_logging_directory:
        return cls(project_name, logging_dir, **kwargs)
    return cls(project_name, **kwargs)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_trackers() -> List[str]:
    """The built-in trackers whose packages are installed (what ``log_with="all"`` starts, as
    Accelerate's ``get_available_trackers()``: a class registered by `register_tracker_class` is
    started by its name only, and one registered under a built-in name replaces that tracker).

    Example:
        >>> from unified.tracking import available_trackers
        >>> available_trackers()            # doctest: +SKIP
        ['tensorboard', 'mlflow', 'wandb']
    """
    return [name for name, cls in _BUILT_IN.items() if all(_installed(m) for m in getattr(cls, "packages", ()))]


def get_available_trackers() -> List[LoggerType]:
    """Accelerate's name for `available_trackers`, as `LoggerType` members.

    Example:
        >>> from unified.tracking import get_available_trackers
        >>> get_available_trackers()        # doctest: +SKIP
        [<LoggerType.TENSORBOARD: 'tensorboard'>, <LoggerType.MLFLOW: 'mlflow'>, <LoggerType.WANDB: 'wandb'>]
    """
    return [LoggerType(name) for name in available_trackers()]


def resolve_log_with(log_with: Any, logging_dir: Optional[str]) -> List[Union[str, GeneralTracker]]:
    """The trackers ``log_with`` asks for: built-in names (checked: known, installed, with a
    logging directory where one is needed) and `GeneralTracker` instances, without duplicates."""
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    names: List[str] = []
    instances: List[GeneralTracker] = []
    for item in items:
        if _is_tracker(item):
            instances.append(item)
            continue
        name = item.value if isinstance(item, enum.Enum) else item
        if not isinstance(name, str) or (name not in TRACKERS and name.lower() not in TRACKERS
                                         and name.lower() != "all"):
            raise ValueError(
                f"Unsupported tracker in log_with: {item!r}. Expected {', '.join(repr(n) for n in TRACKERS)}, "
                "'all', a unified.tracking.GeneralTracker instance, or a list of these." + see("unknown-tracker"))
        if name not in TRACKERS:  # a registered name is exact (as in Accelerate); the built-in ones any case
            name = name.lower()
        if name == "all":
            names += [n for n in available_trackers() if n not in names]
            continue
        missing = [m for m in getattr(TRACKERS[name], "packages", ()) if not _installed(m)]
        if missing:
            raise TrackerUnavailable(
                f"log_with={name!r} needs the package(s) {', '.join(missing)}, which are not installed. "
                f"Install the tracking extra: pip install '{EXTRA}'." + see("tracker-not-installed"))
        if name not in names:
            names.append(name)
    for name in names:
        if TRACKERS[name].requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"Logging with {name!r} needs a logging directory (Accelerate: \"Logging with `{name}` requires a "
                "`logging_dir`\"): pass Accelerator(project_dir=...) or ProjectConfiguration(logging_dir=...)."
                + see("tracker-needs-logging-dir"))
    return [*names, *instances]


def to_host(values: Mapping[str, Any], backend: Any) -> Dict[str, Any]:
    """``values`` with arrays of one element (framework or NumPy) as Python numbers and larger
    framework arrays as NumPy arrays, through the backend's ``to_numpy``; dicts recursively."""
    def convert(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: convert(v) for k, v in value.items()}
        if not isinstance(value, (np.ndarray, np.generic)) and backend is not None and backend.is_array(value):
            value = backend.to_numpy(value)
        if isinstance(value, (np.ndarray, np.generic)) and np.size(value) == 1:
            return np.asarray(value).reshape(()).item()
        return value

    return {key: convert(value) for key, value in values.items()}


class TrackerSet:
    """The trackers of one Accelerator: chosen and checked when it is created (before it joins
    the group), started by ``init_trackers`` on the main process only, closed by ``end_training``.
    No tracker call moves the script's random numbers (`random_streams_untouched`)."""

    def __init__(self, log_with: Any, project_config: Any = None,
                 project_dir: Optional[Union[str, os.PathLike]] = None) -> None:
        logging_dir = project_config.logging_dir if project_config is not None else None
        if logging_dir is None and project_dir is not None:
            logging_dir = os.fspath(project_dir)
        self.requested = resolve_log_with(log_with, logging_dir)
        self.trackers: List[GeneralTracker] = []
        self.started = False

    def start(self, backend: Any, project_name: str, logging_dir: Optional[str], config: Optional[Dict[str, Any]],
              init_kwargs: Optional[Dict[str, Dict[str, Any]]],
              saved: Callable[[], Dict[str, Dict[str, str]]] = dict) -> None:
        """Start the trackers on the main process; ``saved()`` gives the runs of the checkpoint a
        resumed job will load, which built-in trackers continue (W&B run id, MLflow run id)."""
        if self.started:
            raise RuntimeError("init_trackers() was already called for this Accelerator; call it once per run."
                               + see("init-trackers-twice"))
        self.started = True
        if backend.process_index != 0:
            return
        with random_streams_untouched():
            self._start(project_name, logging_dir, config, init_kwargs, saved)

    def _start(self, project_name: str, logging_dir: Optional[str], config: Optional[Dict[str, Any]],
               init_kwargs: Optional[Dict[str, Dict[str, Any]]],
               saved: Callable[[], Dict[str, Dict[str, str]]]) -> None:
        names = [t for t in self.requested if isinstance(t, str)]
        resolve_log_with(names, logging_dir)  # logging_dir may have changed since the Accelerator was made
        init_kwargs = init_kwargs or {}
        runs = saved() if any(isinstance(item, str) for item in self.requested) else {}
        for item in self.requested:
            tracker = (_build(item, project_name, logging_dir, init_kwargs.get(item, {})) if isinstance(item, str)
                       else item)
            if isinstance(item, str) and item in runs and callable(getattr(tracker, "continue_run", None)):
                tracker.continue_run(runs[item])
                logger.info("%s: continuing the run of the checkpoint to resume (%s)", item, runs[item])
            if callable(getattr(tracker, "start", None)):
                tracker.start()
            self.trackers.append(tracker)
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def log(self, backend: Any, values: Mapping[str, Any], step: Optional[int],
            log_kwargs: Optional[Dict[str, Dict[str, Any]]]) -> None:
        if not self.trackers:  # off the main process, or before init_trackers
            return
        host = to_host(values, backend)
        with random_streams_untouched():
            for tracker in self.trackers:
                tracker.log(host, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def identities(self) -> Dict[str, Dict[str, str]]:
        """name -> identity of the started trackers that have one (written into every checkpoint)."""
        found = {}
        for tracker in self.trackers:
            identity = tracker.identity() if callable(getattr(tracker, "identity", None)) else None
            if identity:
                found[tracker.name] = dict(identity)
        return found

    def get(self, name: str, unwrap: bool) -> Any:
        if not self.trackers:  # off the main process, or before init_trackers (as in Accelerate)
            return NoOpTracker(name)
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        started = ", ".join(repr(t.name) for t in self.trackers)
        raise ValueError(f"{name!r} is not a tracker of this Accelerator; its trackers: {started}."
                         + see("no-such-tracker"))

    def finish(self) -> None:
        trackers, self.trackers = self.trackers, []
        with random_streams_untouched():
            for tracker in trackers:
                tracker.finish()
