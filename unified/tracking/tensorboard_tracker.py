"""TensorBoard: event files through tensorboardX."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

from .base import GeneralTracker, import_alone, warn_not_logged


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
        self.writer = import_alone("tensorboardX").SummaryWriter(self.logging_dir, **self.init_kwargs)

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
                warn_not_logged(self.name, key, value)
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def identity(self) -> Optional[Dict[str, str]]:
        return {"folder": self.logging_dir}  # a resumed run writes new event files into the same folder
