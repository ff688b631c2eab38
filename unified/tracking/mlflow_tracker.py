"""MLflow: a local store under the logging directory, through mlflow-skinny."""
from __future__ import annotations

import contextlib
import inspect
import os
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple, Union

from ..errors import see
from .base import GeneralTracker, logger, warn_not_logged


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
        self.nested_run = _flag(os.environ.get("MLFLOW_NESTED_RUN"), nested_run)  # the variable wins, as Accelerate's
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
            database = os.path.join(self.logging_dir, "mlflow.db")
            _create_database_whole(database)
            return f"sqlite:///{database}", Path(self.logging_dir, "mlartifacts").as_uri()
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
        """Log the numbers of ``values`` as metrics at ``step`` (other values are skipped with a
        warning). ``kwargs`` (``accelerator.log(..., log_kwargs={"mlflow": {...}})``) go to
        ``mlflow.log_metrics``, as in Accelerate: ``timestamp``, ``synchronous``, ``run_id`` (another
        run of this tracker's store), and MLflow 3's ``model_id`` and ``dataset``; anything else is
        MLflow's ``TypeError``.

        Example:
            >>> accelerator.log({"loss": 0.5}, step=10, log_kwargs={"mlflow": {"synchronous": True}})  # doctest: +SKIP
        """
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        numbers = {}
        for key, value in values.items():
            if isinstance(value, (int, float)):
                numbers[key] = float(value)
            else:
                warn_not_logged(self.name, key, value)
        if kwargs:
            self._log_metrics(numbers, step, kwargs)
            return
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step or 0) for key, value in numbers.items()]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])

    def _log_metrics(self, metrics: Dict[str, float], step: Optional[int], kwargs: Dict[str, Any]) -> None:
        """``mlflow.log_metrics(metrics, step, **kwargs)`` into this tracker's store (and run, unless
        ``kwargs`` name another): MLflow's process-wide tracking URI is this store's meanwhile, then
        put back, with ``MLFLOW_TRACKING_URI`` as it was."""
        import mlflow

        if "run_id" in inspect.signature(mlflow.log_metrics).parameters:
            kwargs = {"run_id": self.run_id, **kwargs}
        with self._own_store():
            mlflow.log_metrics(metrics, step=step, **kwargs)

    @contextlib.contextmanager
    def _own_store(self) -> Iterator[None]:
        """MLflow's process-wide tracking URI is this tracker's store for the body (the script may
        have pointed MLflow elsewhere since `start`), then as it was, ``MLFLOW_TRACKING_URI`` too."""
        import mlflow

        if mlflow.get_tracking_uri() == self.tracking_uri:
            yield
            return
        is_set = getattr(mlflow, "is_tracking_uri_set", lambda: True)  # an older MLflow: keep what it resolves to
        previous = mlflow.get_tracking_uri() if is_set() else None
        exported = os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(self.tracking_uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(previous)
            if exported is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = exported

    def identity(self) -> Optional[Dict[str, str]]:
        return {"run_id": self.run_id} if self.run_id else None

    def continue_run(self, identity: Dict[str, str]) -> None:
        if self.run_id is None and identity.get("run_id"):  # run_id= or MLFLOW_RUN_ID win
            self._continued = str(identity["run_id"])

    def log_artifact(self, local_path: Union[str, os.PathLike], artifact_path: Optional[str] = None) -> None:
        """Store the file ``local_path`` with the run (under ``artifact_path``), as Accelerate's.

        Example:
            >>> accelerator.get_tracker("mlflow").log_artifact("config.yaml", artifact_path="configs")  # doctest: +SKIP
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
            with self._own_store():
                mlflow.end_run()
        else:  # the script started another run meanwhile: end ours only
            self._client.set_terminated(self.run_id)


def _create_database_whole(database: str) -> None:
    """Create MLflow's SQLite store at ``database`` whole before MLflow opens it. MLflow builds a new
    store by running its schema migrations one after another (8 s on a busy 2-core machine); two
    openers of a store still being built (a restarted attempt while the last one's process still
    ran, a second process or thread) both migrated it, and one failed with ``table ... already
    exists``, which ended the job on every restart. Each creator builds its own copy under a
    temporary name and links it into place unless another creator did first; a killed creator's
    copy is removed by the next."""
    if os.path.exists(database):
        return
    import mlflow

    folder, name = Path(database).parent, Path(database).name
    temporary = folder / f"{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    mlflow.MlflowClient(f"sqlite:///{temporary}").search_experiments()  # runs every migration
    try:  # never over a store another creator put in place first: its openers would lose their file
        os.link(temporary, database)
    except FileExistsError:
        pass
    os.unlink(temporary)
    for leftover in folder.glob(f"{name}.tmp-*"):
        pid = leftover.name[len(name) + 5:].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            leftover.unlink(missing_ok=True)


def _flag(text: Optional[str], default: bool) -> bool:
    """An environment variable read as Accelerate's ``str_to_bool`` (``"False"``, ``"0"``, ``"off"``
    are False); ``default`` when it is unset.

    Example:
        >>> _flag("off", True), _flag(None, True), _flag("Yes", False)
        (False, True, True)
    """
    if text is None:
        return bool(default)
    value = text.strip().lower()
    if value in ("y", "yes", "t", "true", "on", "1"):
        return True
    if value in ("n", "no", "f", "false", "off", "0"):
        return False
    raise ValueError(f"MLFLOW_NESTED_RUN={text!r}: expected a truth value (true/false, yes/no, on/off, 1/0)."
                     + see("mlflow-nested-run"))
