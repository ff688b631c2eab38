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

The package: `base` (what every tracker shares), one module per built-in tracker
(`tensorboard_tracker`, `mlflow_tracker`, `wandb_tracker`), and `registry` (the registry,
``log_with`` and one Accelerator's `TrackerSet`). It runs on the main process of each worker
group; ``from unified.tracking import ...`` is Accelerate's ``accelerate.tracking``.
"""
from .base import GeneralTracker, LoggerType, TrackerUnavailable
from .mlflow_tracker import MLflowTracker
from .registry import LOGGER_TYPE_TO_CLASS, TRACKERS, available_trackers, get_available_trackers, register_tracker_class
from .tensorboard_tracker import TensorBoardTracker
from .wandb_tracker import WandBTracker

__all__ = ["GeneralTracker", "TensorBoardTracker", "MLflowTracker", "WandBTracker", "LoggerType",
           "register_tracker_class", "LOGGER_TYPE_TO_CLASS",
           "TrackerUnavailable", "TRACKERS", "available_trackers", "get_available_trackers"]
