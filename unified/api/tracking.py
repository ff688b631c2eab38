"""Experiment trackers (`unified.Accelerator`'s part): ``init_trackers``, ``log``,
``get_tracker``; the trackers are `unified.tracking`'s."""
from __future__ import annotations

from typing import Any, Dict, Optional


class Tracking:
    """Mixed into `unified.Accelerator`: uses its backend, collectives and state."""

    # -- experiment trackers (the logic: unified/tracking/) ---------------------------------------
    @property
    def trackers(self) -> list:
        """The started trackers (`unified.tracking.GeneralTracker`); empty off the main process."""
        return list(self._trackers.trackers)

    def init_trackers(self, project_name: str, config: Optional[Dict[str, Any]] = None,
                      init_kwargs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Start the ``log_with`` trackers on the main process (elsewhere: nothing), writing under
        ``logging_dir``; ``config`` (hyperparameters) is stored with the run, ``init_kwargs`` maps a
        tracker's name to keywords for it (e.g. ``{"wandb": {"tags": [...]}}``).

        A job that will resume continues the runs of the checkpoint ``load_state()`` would load
        (every checkpoint names them): W&B logs into the same run id (``resume="allow"``), MLflow
        into the same run, TensorBoard into the same folder, so a restarted or requeued job's
        steps go on in one run. A run the script names itself (``init_kwargs={"wandb": {"id":
        ...}}``, MLflow's ``run_id=`` / ``MLFLOW_RUN_ID``) wins; so does a new ``project_dir``.

        Example:
            >>> accelerator = Accelerator(log_with="all", project_dir="runs/exp")
            >>> accelerator.init_trackers("mnist", config={"lr": 1e-3, "batch_size": 64})
        """
        self._trackers.start(self._backend, project_name, self.logging_dir, config, init_kwargs,
                             saved=self._checkpoints.saved_tracker_identities)

    def log(self, values: Dict[str, Any], step: Optional[int] = None,
            log_kwargs: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Log ``values`` (name -> number, 0-d framework array, string or dict of numbers) at
        ``step`` to every tracker; a no-op off the main process and before `init_trackers`.

        Example:
            >>> accelerator.log({"train_loss": loss, "lr": scheduler.get_last_lr()[0]}, step=step)
        """
        self._trackers.log(self._backend, values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (``unwrap=True``: the library's own object, e.g. the
        ``SummaryWriter``, ``mlflow.ActiveRun`` or ``wandb.Run``); off the main process a tracker
        whose calls do nothing.

        Example:
            >>> run = accelerator.get_tracker("wandb", unwrap=True)
            >>> writer = accelerator.get_tracker("tensorboard").tracker
        """
        return self._trackers.get(name, unwrap)
