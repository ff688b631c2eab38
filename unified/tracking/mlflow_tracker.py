"""MLflow: a local store under the logging directory, through mlflow-skinny."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

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
            return (f"sqlite:///{os.path.join(self.logging_dir, 'mlflow.db')}",
                    Path(self.logging_dir, "mlartifacts").as_uri())
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
                warn_not_logged(self.name, key, value)
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
            mlflow.end_run()
        else:  # the script started another run meanwhile: end ours only
            self._client.set_terminated(self.run_id)
