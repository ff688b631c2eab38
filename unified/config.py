"""Run configuration objects and enums shared by every backend."""
from __future__ import annotations

import dataclasses
import enum
import os
import re
from typing import Any, Optional

from .errors import see

__all__ = ["ProjectConfiguration", "DistributedType", "DataLoaderConfiguration", "GradientAccumulationPlugin"]


class DistributedType(enum.StrEnum):
    """How the processes of a run are connected: Accelerate's values, the contract's ``JAX``, and
    any other upper-case value a backend declares (``Backend.group_distributed_type``).

    Example:
        >>> accelerator.distributed_type == DistributedType.NO   # doctest: +SKIP
        True
        >>> DistributedType("MLX") == "MLX"                      # a plugin backend's own value
        True
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    JAX = "JAX"
    # Accelerate 1.15's other members, so that scripts comparing against them run; no unified
    # backend reports them today (FSDP on CPU is MULTI_CPU there too).
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"

    @classmethod
    def _missing_(cls, value: object) -> "DistributedType":
        if not (isinstance(value, str) and value.isidentifier() and value.isupper()):
            return None  # type: ignore[return-value]  (Enum then raises its ValueError)
        member = str.__new__(cls, value)
        member._name_, member._value_ = value, value
        return cls._value2member_map_.setdefault(value, member)


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: Any) -> bool:
    """Whether ``path`` names an object store (``s3://bucket/run``, any ``scheme://``) rather
    than a folder.

    Example:
        >>> is_url("s3://bucket/run"), is_url("runs/exp1")
        (True, False)
    """
    return isinstance(path, str) and _URL.match(path) is not None


def local_folder(path: Any, what: str) -> str:
    """``path`` as a string, refused when it is a URL (``s3://bucket/run``) for a call that writes
    to a folder (`Accelerator.save_model`): ``os`` functions would otherwise make a local folder
    named ``s3:`` and write there without a word.

    Example:
        >>> local_folder("runs/exp1", "project_dir")
        'runs/exp1'
    """
    path = os.fspath(path)
    if is_url(path):
        raise ValueError(
            f"{what}={path!r} is an object-storage URL; this call writes to a folder of the file system (save_state "
            "and load_state take URLs). Write to a local folder and upload it, or mount the bucket (e.g. "
            "mountpoint-s3, gcsfuse) and pass its local path." + see("object-storage-url"))
    return path


def checkpoint_location(path: Any) -> str:
    """``path`` as a string: a folder, or an object store's URL (``s3://bucket/run``, any fsspec
    protocol; see docs/object-storage.md), where checkpoints may live.

    Example:
        >>> checkpoint_location("s3://bucket/run")
        's3://bucket/run'
    """
    return os.fspath(path)


@dataclasses.dataclass
class ProjectConfiguration:
    """Where and how `save_state` writes checkpoints (Accelerate's fields and meanings).

    Args:
        project_dir: root of the run's files; checkpoints go to ``{project_dir}/checkpoints``
            with automatic naming. A folder, or an object store's URL (``s3://bucket/run``).
        logging_dir: where trackers would log; defaults to ``project_dir``.
        automatic_checkpoint_naming: name saves ``checkpoint_{iteration}`` and count up.
        total_limit: keep only the newest N automatically named checkpoints.
        iteration: number of the next automatically named checkpoint.
        save_on_each_node: accepted for compatibility (every node writes its own shard anyway).
        async_save: make `save_state` write in the background by default.

    Example:
        >>> config = ProjectConfiguration("runs/exp1", automatic_checkpoint_naming=True, total_limit=3)
        >>> accelerator = Accelerator(project_config=config)   # doctest: +SKIP
    """

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    save_on_each_node: bool = False
    async_save: bool = False

    def __post_init__(self) -> None:
        if self.project_dir is not None:
            self.project_dir = checkpoint_location(self.project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(f"Invalid total_limit: expected an integer >= 1 or None; received {self.total_limit!r}."
                             + see("invalid-total-limit"))

    def set_directories(self, project_dir: Optional[str] = None) -> None:
        """Set ``project_dir`` (and ``logging_dir`` when unset), as Accelerate does."""
        self.project_dir = checkpoint_location(project_dir) if project_dir is not None else None
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How `prepare` treats data loaders: Accelerate's fields and defaults.

    unified's prepared loaders always give each process its own ``batch_size`` per step (Accelerate's
    ``split_batches=False``), read on every process unless ``dispatch_batches=True`` (then process 0
    reads and sends every process its part, as Accelerate's dispatcher: `unified.data.dispatch`;
    ``even_batches`` has no effect there, as in Accelerate), fill the last global batch
    up (``even_batches=True``, the repeats dropped by `gather_for_metrics`; ``False`` leaves a map-style
    loader's last batch short or absent on some processes, as Accelerate's), shuffle by seed and
    epoch (``use_seedable_sampler``: always, so both values are accepted) and resume from
    their state (always; ``use_stateful_dataloader=True`` also makes the prepared torch loaders
    torchdata ``StatefulDataLoader`` instances, as in Accelerate). ``data_seed`` seeds the loaders' shuffling
    instead of ``Accelerator(seed=...)``. ``non_blocking`` is accepted (batches are copied to
    the device without blocking anyway). Values unified does not implement are refused with a
    clear error when the Accelerator is made.

    Example:
        >>> config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=1234)
        >>> accelerator = Accelerator(dataloader_config=config)   # doctest: +SKIP
    """

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    # field -> (accepted values, what to do instead)
    _UNSUPPORTED = {
        "split_batches": ((False,), "pass the per-process batch size (batch_size // num_processes) to your DataLoader, "
                          "or set dispatch_batches=True too"),
        "dispatch_batches": ((None, False, True), "pass None, False or True"),
    }

    def check(self) -> None:
        """Raise `NotImplementedError` naming a value unified does not implement."""
        for name, (accepted, instead) in self._UNSUPPORTED.items():
            value = getattr(self, name)
            if name == "split_batches" and self.dispatch_batches is True:
                continue  # process 0 reads one batch a step and splits it, as Accelerate's dispatcher
            if value not in accepted:
                raise NotImplementedError(f"DataLoaderConfiguration({name}={value!r}) is not supported by unified: "
                                          f"{instead}." + see("not-supported-yet"))
        if self.data_seed is not None and (isinstance(self.data_seed, bool) or not isinstance(self.data_seed, int)):
            raise TypeError(f"DataLoaderConfiguration(data_seed=...) must be an int or None; received "
                            f"{self.data_seed!r}." + see("not-supported-yet"))


@dataclasses.dataclass
class GradientAccumulationPlugin:
    """Accelerate's accumulation settings, for ``Accelerator(gradient_accumulation_plugin=...)``.

    ``num_steps`` is ``gradient_accumulation_steps``. The window also closes at the end of a
    prepared loader (``sync_with_dataloader=True``, the only value unified implements), and
    gradients are synchronised once per window (``sync_each_batch=False``, likewise).
    ``adjust_scheduler`` is accepted and, as in Accelerate 1.15 (where neither value reaches
    the scheduler), has no effect.

    Example:
        >>> plugin = GradientAccumulationPlugin(num_steps=4)
        >>> accelerator = Accelerator(gradient_accumulation_plugin=plugin)   # doctest: +SKIP
    """

    num_steps: Optional[int] = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    @staticmethod
    def steps_of(plugin: "GradientAccumulationPlugin", steps: int) -> int:
        """The accumulation steps ``plugin`` asks for (``steps``, the constructor's, must be 1 then:
        Accelerate refuses both); a clear error for values unified does not implement."""
        if not all(hasattr(plugin, f) for f in ("num_steps", "sync_with_dataloader", "sync_each_batch")):
            raise TypeError("gradient_accumulation_plugin must be a GradientAccumulationPlugin, not "
                            f"{type(plugin).__name__}." + see("not-supported-yet"))
        if steps != 1:
            raise ValueError("You can only pass one of `gradient_accumulation_steps` and "
                             "`gradient_accumulation_plugin`. Please only pass in the created "
                             "`GradientAccumulationPlugin` object." + see("not-supported-yet"))
        if plugin.sync_with_dataloader is not True:
            raise NotImplementedError("GradientAccumulationPlugin(sync_with_dataloader=False) is not supported by "
                                      "unified: the window always closes at the end of a prepared loader."
                                      + see("not-supported-yet"))
        if plugin.sync_each_batch is not False:
            raise NotImplementedError("GradientAccumulationPlugin(sync_each_batch=True) is not supported by unified: "
                                      "gradients are synchronised once per window." + see("not-supported-yet"))
        return 1 if plugin.num_steps is None else plugin.num_steps
