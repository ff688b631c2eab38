"""Experiment trackers, with Accelerate's names and meaning: ``Accelerator(log_with=...)``,
``init_trackers``, ``log``, ``get_tracker``, closed by ``end_training``.

Each tracker writes through its own package, under ``ProjectConfiguration.logging_dir``, on the
main process only (the other processes import none of these packages):

===============  ==============  ==============================================================
name             package         what it writes
===============  ==============  ==============================================================
``tensorboard``  tensorboardX    event files in ``{logging_dir}/{project_name}/`` (framework-
                                 neutral: it imports no backend's framework that the run has not)
``mlflow``       mlflow-skinny   a local MLflow store: ``sqlite:///{logging_dir}/mlflow.db``
                                 (artifacts in ``{logging_dir}/mlartifacts``) where the installed
                                 MLflow keeps file stores behind ``MLFLOW_ALLOW_FILE_STORE``,
                                 else the file store ``{logging_dir}/mlruns``
``wandb``        wandb           an offline run in ``{logging_dir}/wandb/offline-run-*``
===============  ==============  ==============================================================

``pip install 'unified[tracking]'`` installs all three. A tracker of your own subclasses
`GeneralTracker` and is passed as an instance: ``Accelerator(log_with=[MyTracker(...)])``.
Nothing here imports torch or jax: the backend brings values to the host.
"""
from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.util
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

from .errors import UnifiedError, see
from .rng import capture_host_rng, restore_host_rng

__all__ = ["GeneralTracker", "TensorBoardTracker", "MLflowTracker", "WandBTracker", "LoggerType",
           "register_tracker_class", "LOGGER_TYPE_TO_CLASS",
           "TrackerUnavailable", "TRACKERS", "available_trackers"]

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


class TensorBoardTracker(GeneralTracker):
    """TensorBoard event files through tensorboardX, in ``{logging_dir}/{run_name}/``.

    ``kwargs`` go to ``tensorboardX.SummaryWriter``. Numbers become scalars, strings text and a
    dict of numbers one group of scalars (``add_scalars``); the configuration is written with
    ``add_hparams`` into the sub-folder ``hparams``.

    Example:
        >>> accelerator = Accelerator(log_with="tensorboard", project_dir="runs/exp")   # doctest: +SKIP
        >>> accelerator.init_trackers("mnist", config={"lr": 1e-3})   # runs/exp/mnist/events.out.tfevents.*
    """

    name = "tensorboard"
    requires_logging_directory = True
    packages = ("tensorboardX",)

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike], **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.join(os.path.abspath(os.fspath(logging_dir)), run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        """The ``tensorboardX.SummaryWriter``."""
        return self.writer

    def start(self) -> None:
        self.writer = _import_alone("tensorboardX").SummaryWriter(self.logging_dir, **self.init_kwargs)

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        hparams = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()}
        self.writer.add_hparams(hparams, {}, name="hparams")
        self.writer.flush()

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            else:
                _skipped(self.name, key, value)
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def identity(self) -> Optional[Dict[str, str]]:
        return {"folder": self.logging_dir}  # a resumed run writes new event files into the same folder


class MLflowTracker(GeneralTracker):
    """An MLflow run in a local store under ``logging_dir`` (Accelerate's `MLflowTracker`).

    The store is ``tracking_uri`` when given, else ``MLFLOW_TRACKING_URI`` when set, else local:
    ``sqlite:///{logging_dir}/mlflow.db`` with artifacts in ``{logging_dir}/mlartifacts`` (MLflow 3
    keeps its file store behind ``MLFLOW_ALLOW_FILE_STORE``), or the file store
    ``{logging_dir}/mlruns`` where the installed MLflow allows it. The experiment is
    ``experiment_name`` (the project name; ``MLFLOW_EXPERIMENT_NAME`` overrides it, as in
    Accelerate). Numbers are logged as metrics and the configuration as parameters (a value over
    MLflow's length limit is dropped with a warning); other values are skipped with a warning.

    Example:
        >>> accelerator = Accelerator(log_with="mlflow", project_dir="runs/exp")   # doctest: +SKIP
        >>> accelerator.init_trackers("mnist", init_kwargs={"mlflow": {"run_name": "baseline"}})
        >>> mlflow.MlflowClient("sqlite:///runs/exp/mlflow.db").search_experiments()   # later, anywhere
    """

    name = "mlflow"
    requires_logging_directory = False
    packages = ("mlflow", "sqlalchemy", "alembic")

    def __init__(self, experiment_name: Optional[str] = None, logging_dir: Optional[Union[str, os.PathLike]] = None,
                 run_id: Optional[str] = None, tags: Optional[Dict[str, Any]] = None, nested_run: bool = False,
                 run_name: Optional[str] = None, description: Optional[str] = None,
                 tracking_uri: Optional[str] = None) -> None:
        super().__init__()
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = tags
        self.nested_run = nested_run
        self.run_name = run_name
        self.description = description
        self.logging_dir = os.path.abspath(os.fspath(logging_dir) if logging_dir is not None else os.getcwd())
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.active_run: Any = None
        self._client: Any = None
        self._continued: Optional[str] = None  # the run a resumed job continues (continue_run)

    @property
    def tracker(self) -> Any:
        """The ``mlflow.ActiveRun``."""
        return self.active_run

    def _local_store(self) -> Tuple[str, Optional[str]]:
        """(tracking URI, artifact location) of the local store under ``logging_dir``."""
        from mlflow import environment_variables

        gate = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
        if gate is not None and not gate.get():
            return f"sqlite:///{os.path.join(self.logging_dir, 'mlflow.db')}", Path(self.logging_dir, "mlartifacts").as_uri()
        return Path(self.logging_dir, "mlruns").as_uri(), None

    def start(self) -> None:
        import mlflow

        os.makedirs(self.logging_dir, exist_ok=True)
        artifacts = None
        if self.tracking_uri is None:
            self.tracking_uri, artifacts = self._local_store()
        exported = os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(self.tracking_uri)
        # MLflow also exports the URI; leave the environment as Accelerate's tracker does (untouched),
        # so that a later run in this process, or a process it starts, does not write into this store.
        if exported is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = exported
        self._client = mlflow.MlflowClient(self.tracking_uri)
        experiment = mlflow.get_experiment_by_name(self.experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None else
                         mlflow.create_experiment(self.experiment_name, artifact_location=artifacts, tags=self.tags))
        if self._continued is not None:
            try:
                self._client.get_run(self._continued)
                self.run_id = self._continued
            except Exception:  # not in this store (another tracking URI): a new run, said once
                logger.warning("mlflow: the checkpoint's run %s is not in %s; logging into a new run.",
                               self._continued, self.tracking_uri)
        self.active_run = mlflow.start_run(run_id=self.run_id, experiment_id=experiment_id, run_name=self.run_name,
                                           nested=self.nested_run, tags=self.tags, description=self.description)
        self.run_id = self.active_run.info.run_id

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = []
        for key, value in values.items():
            text = str(value)
            if len(text) > MAX_PARAM_VAL_LENGTH:
                logger.warning("mlflow: the configuration value of %r is longer than MLflow's limit of %d "
                               "characters; it is not logged.", key, MAX_PARAM_VAL_LENGTH)
                continue
            params.append(Param(key, text))
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        metrics = []
        for key, value in values.items():
            if isinstance(value, (int, float)):
                metrics.append(Metric(key, float(value), now, step or 0))
            else:
                _skipped(self.name, key, value)
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):  # kwargs: `log_kwargs={"mlflow": {...}}` (synchronous=)
            self._client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH], **kwargs)

    def identity(self) -> Optional[Dict[str, str]]:
        return {"run_id": self.run_id} if self.run_id else None

    def continue_run(self, identity: Dict[str, str]) -> None:
        if self.run_id is None and identity.get("run_id"):  # run_id= or MLFLOW_RUN_ID win
            self._continued = str(identity["run_id"])

    def log_artifact(self, local_path: Union[str, os.PathLike], artifact_path: Optional[str] = None) -> None:
        """Store the file ``local_path`` with the run (under ``artifact_path``), as Accelerate's.

        Example:
            >>> accelerator.get_tracker("mlflow").log_artifact("config.yaml", artifact_path="configs")   # doctest: +SKIP
        """
        self._client.log_artifact(self.run_id, os.fspath(local_path), artifact_path)

    def log_artifacts(self, local_dir: Union[str, os.PathLike], artifact_path: Optional[str] = None) -> None:
        """Store every file of the folder ``local_dir`` with the run, as Accelerate's.

        Example:
            >>> accelerator.get_tracker("mlflow").log_artifacts("plots", artifact_path="plots")   # doctest: +SKIP
        """
        self._client.log_artifacts(self.run_id, os.fspath(local_dir), artifact_path)

    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Store a matplotlib or plotly ``figure`` with the run as ``artifact_file``, as Accelerate's.

        Example:
            >>> accelerator.get_tracker("mlflow").log_figure(fig, "loss.png")   # doctest: +SKIP
        """
        self._client.log_figure(self.run_id, figure, artifact_file, save_kwargs=save_kwargs or None)

    def finish(self) -> None:
        if self.active_run is None:
            return
        import mlflow

        current = mlflow.active_run()
        if current is not None and current.info.run_id == self.run_id:
            mlflow.end_run()
        else:  # the script started another run meanwhile: end ours only
            self._client.set_terminated(self.run_id)


class WandBTracker(GeneralTracker):
    """A Weights & Biases run, offline by default, in ``{logging_dir}/wandb/`` (Accelerate's `WandBTracker`).

    ``kwargs`` go to ``wandb.init`` (``project`` is the run name). The mode is ``kwargs["mode"]``,
    else ``WANDB_MODE``, else ``"offline"``: nothing leaves the machine unless asked for
    (``wandb sync {logging_dir}/wandb/offline-run-*`` uploads a run later).

    Example:
        >>> accelerator = Accelerator(log_with="wandb", project_dir="runs/exp")   # doctest: +SKIP
        >>> accelerator.init_trackers("mnist", init_kwargs={"wandb": {"tags": ["baseline"]}})
    """

    name = "wandb"
    requires_logging_directory = False
    packages = ("wandb",)

    def __init__(self, run_name: str, logging_dir: Optional[Union[str, os.PathLike]] = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.abspath(os.fspath(logging_dir) if logging_dir is not None else os.getcwd())
        self.init_kwargs = kwargs
        self.run: Any = None

    @property
    def tracker(self) -> Any:
        """The ``wandb.Run``."""
        return self.run

    def start(self) -> None:
        import wandb

        kwargs = dict(self.init_kwargs)
        kwargs.setdefault("mode", os.environ.get("WANDB_MODE") or "offline")
        kwargs.setdefault("dir", self.logging_dir)
        os.makedirs(kwargs["dir"], exist_ok=True)
        self.run = wandb.init(project=self.run_name, **kwargs)

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()

    def identity(self) -> Optional[Dict[str, str]]:
        return {"id": str(self.run.id)} if self.run is not None else None

    def continue_run(self, identity: Dict[str, str]) -> None:
        if identity.get("id") and "id" not in self.init_kwargs and "resume" not in self.init_kwargs:
            self.init_kwargs.update(id=str(identity["id"]), resume="allow")  # steps go on in the same run


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
        raise ValueError("The tracker class to register must define a non-empty `name` attribute." + see("custom-tracker"))
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
    """The built-in trackers whose packages are installed (what ``log_with="all"`` starts).

    Example:
        >>> from unified.tracking import available_trackers
        >>> available_trackers()            # doctest: +SKIP
        ['tensorboard', 'mlflow', 'wandb']
    """
    return [name for name, cls in TRACKERS.items() if all(_installed(m) for m in getattr(cls, "packages", ()))]


def _import_alone(module: str) -> Any:
    """Import ``module`` (tensorboardX) without letting it import, on the side, the framework of
    a backend that this process has not imported: tensorboardX imports torch when it can (for
    a type hint only; it converts torch tensors with a lazy import), which would cost a JAX run
    seconds and memory."""
    if module in sys.modules:
        return sys.modules[module]
    from .registry import backend_names, backend_spec

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


def _skipped(tracker: str, key: str, value: Any) -> None:
    """Warn once per tracker and name that a value is not logged."""
    if (tracker, key) in _warned:
        return
    _warned.add((tracker, key))
    logger.warning("%s: %r of type %s is not logged (expected a number%s).", tracker, key, type(value).__name__,
                   "" if tracker == "mlflow" else ", a string or a dict of numbers")


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
        if not isinstance(name, str) or (name.lower() not in TRACKERS and name.lower() != "all"):
            raise ValueError(
                f"Unsupported tracker in log_with: {item!r}. Expected {', '.join(repr(n) for n in TRACKERS)}, "
                "'all', a unified.tracking.GeneralTracker instance, or a list of these." + see("unknown-tracker"))
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
                f"Logging with {name!r} needs a logging directory: pass Accelerator(project_dir=...) or "
                "ProjectConfiguration(logging_dir=...)." + see("tracker-needs-logging-dir"))
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


@contextlib.contextmanager
def _random_streams_untouched() -> Iterator[None]:
    """Python's ``random`` and NumPy's global generator as they were before the body: trackers run
    on the main process only, and MLflow's ``start_run`` draws from ``random`` (its run names), which
    would move the main process's training randomness away from the other processes' and from the
    same run without trackers."""
    saved = capture_host_rng()
    try:
        yield
    finally:
        restore_host_rng(saved)


class TrackerSet:
    """The trackers of one Accelerator: chosen and checked when it is created (before it joins
    the group), started by ``init_trackers`` on the main process only, closed by ``end_training``.
    No tracker call moves the script's random numbers (`_random_streams_untouched`)."""

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
        with _random_streams_untouched():
            self._start(project_name, logging_dir, config, init_kwargs, saved)

    def _start(self, project_name: str, logging_dir: Optional[str], config: Optional[Dict[str, Any]],
               init_kwargs: Optional[Dict[str, Dict[str, Any]]], saved: Callable[[], Dict[str, Dict[str, str]]]) -> None:
        names = [t for t in self.requested if isinstance(t, str)]
        resolve_log_with(names, logging_dir)  # logging_dir may have changed since the Accelerator was made
        init_kwargs = init_kwargs or {}
        runs = saved() if any(isinstance(item, str) for item in self.requested) else {}
        for item in self.requested:
            tracker = _build(item, project_name, logging_dir, init_kwargs.get(item, {})) if isinstance(item, str) else item
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
        with _random_streams_untouched():
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
        raise ValueError(f"{name!r} is not a tracker of this Accelerator; its trackers: {started}." + see("no-such-tracker"))

    def finish(self) -> None:
        trackers, self.trackers = self.trackers, []
        with _random_streams_untouched():
            for tracker in trackers:
                tracker.finish()
