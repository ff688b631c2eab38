"""What every tracker shares: `GeneralTracker` (Accelerate's interface), `LoggerType`, the
error for a missing package, and the helpers the built-in trackers use (an import that keeps
the other frameworks out, a warning per value not logged, the host RNG left untouched)."""
from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.util
import logging
import sys
from typing import Any, Dict, Iterator, Optional, Tuple

from ..errors import UnifiedError, see
from ..runtime.rng import capture_host_rng, restore_host_rng

EXTRA = "unified[tracking]"
logger = logging.getLogger(__name__)


class LoggerType(enum.StrEnum):
    """The tracker names ``log_with`` accepts (Accelerate's `LoggerType`); plain strings work too.

    Example:
        >>> accelerator = Accelerator(log_with=LoggerType.TENSORBOARD, project_dir="runs/exp")  # doctest: +SKIP
        >>> LoggerType.ALL == "all"
        True
    """

    ALL = "all"
    TENSORBOARD = "tensorboard"
    MLFLOW = "mlflow"
    WANDB = "wandb"


class TrackerUnavailable(UnifiedError, ImportError):
    """``log_with`` names a tracker whose package is not installed (``pip install 'unified[tracking]'``)."""


class GeneralTracker:
    """The interface of an experiment tracker (Accelerate's `GeneralTracker`).

    A subclass sets ``name`` and ``requires_logging_directory`` and has a ``tracker`` attribute or
    property (the library's own object, which ``get_tracker(name, unwrap=True)`` returns); it may
    override `start`, `store_init_configuration`, `log` and `finish`. They run on the main process
    only. Values reach `log` on the host: arrays of one element as Python numbers, larger
    framework arrays as NumPy arrays.

    Example:
        >>> class PrintTracker(GeneralTracker):
        ...     name = "print"
        ...     requires_logging_directory = False
        ...     tracker = None
        ...     def log(self, values, step=None, **kwargs):
        ...         print(step, values)
        >>> accelerator = Accelerator(log_with=[PrintTracker()])          # doctest: +SKIP
    """

    main_process_only = True
    # Modules a built-in tracker needs: checked when the Accelerator is created, imported by `start`.
    packages: Tuple[str, ...] = ()

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [f"`{attr}`" for attr in ("name", "requires_logging_directory") if not hasattr(self, attr)]
        if "tracker" not in dir(self):
            missing.append("`tracker`")
        if missing:
            raise NotImplementedError(
                f"The tracker {type(self).__qualname__} must define {', '.join(missing)} (see "
                "unified.tracking.GeneralTracker)." + see("custom-tracker"))

    def start(self) -> None:
        """Create the run (``init_trackers``, on the main process)."""

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        """Record the run's hyperparameters (``init_trackers(config=...)``)."""

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Record ``values`` (name -> number, string, dict or array) at ``step``."""

    def finish(self) -> None:
        """Close the run (``end_training``)."""

    def identity(self) -> Optional[Dict[str, str]]:
        """What names this tracker's run, saved in every checkpoint (``None``: nothing to continue)."""
        return None

    def continue_run(self, identity: Dict[str, str]) -> None:
        """Before `start`: log into the run that ``identity`` (from the checkpoint a resumed job
        loads) names, unless the script named a run itself."""


class NoOpTracker(GeneralTracker):
    """What `get_tracker` returns off the main process (and before ``init_trackers``): every call
    does nothing and ``tracker`` is ``None``."""

    requires_logging_directory = False
    tracker = None

    def __init__(self, name: str) -> None:
        super().__init__(_blank=True)
        self.name = name


def import_alone(module: str) -> Any:
    """Import ``module`` (tensorboardX) without letting it import, on the side, the framework of
    a backend that this process has not imported: tensorboardX imports torch when it can (for
    a type hint only; it converts torch tensors with a lazy import), which would cost a JAX run
    seconds and memory."""
    if module in sys.modules:
        return sys.modules[module]
    from ..backend.registry import backend_names, backend_spec

    try:
        frameworks = {backend_spec(name).framework for name in backend_names()}
    except Exception:  # noqa: BLE001 - a broken plugin: import without the precaution
        frameworks = set()
    blocked = sorted(f for f in frameworks if f not in sys.modules)
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # meanwhile `import name` raises ImportError
    try:
        return importlib.import_module(module)
    finally:
        for name in blocked:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


_warned: set = set()


def warn_not_logged(tracker: str, key: str, value: Any) -> None:
    """Warn once per tracker and name that a value is not logged."""
    if (tracker, key) in _warned:
        return
    _warned.add((tracker, key))
    logger.warning("%s: %r of type %s is not logged (expected a number%s).", tracker, key, type(value).__name__,
                   "" if tracker == "mlflow" else ", a string or a dict of numbers")


@contextlib.contextmanager
def random_streams_untouched() -> Iterator[None]:
    """Python's ``random`` and NumPy's global generator as they were before the body: trackers run
    on the main process only, and MLflow's ``start_run`` draws from ``random`` (its run names), which
    would move the main process's training randomness away from the other processes' and from the
    same run without trackers."""
    saved = capture_host_rng()
    try:
        yield
    finally:
        restore_host_rng(saved)
