"""Weights & Biases: an offline run under the logging directory."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

from .base import GeneralTracker


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
