"""torch's named mesh of a `unified.ParallelismConfig`, mixed into `TorchBackend`.

`configure_parallelism` builds the ``DeviceMesh`` of the configuration (its active dimensions
``dp_replicate``, ``dp_shard``, ``tp`` in Accelerate's order, and the flattened views ``dp``,
``dp_shard_cp``, ``dp_cp``) after the group is joined; `tensor_parallel` applies a model's
tensor-parallel plan (``parallelize_module`` over ``mesh["tp"]``); `backends.torch.sharding`
then applies FSDP2 over ``mesh["dp_shard_cp"]`` (or the 2-D ``("dp_replicate", "dp_shard_cp")``:
HSDP). The rules (sizes, ranks, which process gets which batch) are `unified.training.parallelism`'s.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

from unified.errors import see

__all__ = ["TorchParallelism", "build_device_mesh", "parallel_styles", "tp_plan_of"]

# transformers' names of the styles a plan may give (transformers.integrations.tensor_parallel)
_STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate")


def build_device_mesh(config: Any, device_type: str) -> Optional[Any]:
    """The ``DeviceMesh`` of ``config`` with its flattened views, as Accelerate's
    ``ParallelismConfig.build_device_mesh``; None when no dimension is enabled (one process).

    Example:
        >>> mesh = build_device_mesh(ParallelismConfig(dp_shard_size=2, tp_size=2), "cpu")  # doctest: +SKIP
        >>> mesh.mesh_dim_names, mesh["dp"].size()                                           # doctest: +SKIP
        (('dp_shard', 'tp'), 2)
    """
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = config.mesh_shape()
    if not names:
        return None
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    for view, dims in config.flattened_views().items():
        mesh[tuple(dims)]._flatten(view)
    return mesh


def tp_plan_of(model: torch.nn.Module) -> Optional[Mapping[str, Any]]:
    """The tensor-parallel plan a model carries: ``model.tp_plan`` or ``model._tp_plan`` (as
    transformers' models do), a mapping of submodule names (``*`` as a wildcard) to styles."""
    for name in ("tp_plan", "_tp_plan"):
        plan = getattr(model, name, None)
        if plan:
            return plan
    return None


def parallel_styles(plan: Mapping[str, Any]) -> Dict[str, Any]:
    """``plan`` with transformers' style names as torch's ``ParallelStyle`` objects
    (``"colwise"`` -> ``ColwiseParallel()``, ``"rowwise"`` -> ``RowwiseParallel()``; a
    ``ParallelStyle`` given is kept).

    Example:
        >>> parallel_styles({"fc1": "colwise", "fc2": "rowwise"})  # doctest: +SKIP
        {'fc1': ColwiseParallel(...), 'fc2': RowwiseParallel(...)}
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
    )

    made = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence_parallel": SequenceParallel}
    styles: Dict[str, Any] = {}
    for name, style in plan.items():
        if isinstance(style, ParallelStyle):
            styles[name] = style
        elif style == "replicate":
            continue  # left whole on every process of the tensor-parallel group
        elif style in made:
            styles[name] = made[style]()
        else:
            raise ValueError(f"tp_plan[{name!r}] = {style!r}: use one of {', '.join(_STYLES)} or a "
                             "torch.distributed.tensor.parallel.ParallelStyle." + see("tensor-parallel-plan"))
    return styles


class TorchParallelism:
    """What ``Accelerator(parallelism_config=...)`` asks of torch (mixed into `TorchBackend`)."""

    _parallel_config: Optional[Any] = None
    _parallel_mesh: Optional[Any] = None

    def configure_parallelism(self, config: Any) -> None:
        """Build the named mesh of ``config`` over the group (the group must be joined)."""
        self._parallel_config = config
        self._parallel_mesh = build_device_mesh(config, self.device.type) if self.num_processes > 1 else None
        config.device_mesh = self._parallel_mesh

    @property
    def parallel_mesh(self) -> Optional[Any]:
        """The ``DeviceMesh`` of the configuration (``accelerator.torch_device_mesh``)."""
        return self._parallel_mesh

    def fsdp_mesh(self) -> Optional[Any]:
        """The (sub)mesh FSDP2 shards over: ``mesh["dp_shard_cp"]``, or for HSDP the 2-D
        ``mesh["dp_replicate", "dp_shard_cp"]``; None without a configuration, or when it has
        no dimension to shard over (tensor parallelism alone)."""
        config, mesh = self._parallel_config, self._parallel_mesh
        if config is None or mesh is None or not config.dp_shard_enabled:
            return None
        return mesh[tuple(config.fsdp_dim_names)]

    def tensor_parallel(self, model: torch.nn.Module) -> torch.nn.Module:
        """``parallelize_module`` over ``mesh["tp"]`` with the model's plan (`tp_plan_of`);
        the model as it is without tensor parallelism, or when it is split already (DTensor
        parameters: what Accelerate expects, e.g. transformers' ``from_pretrained(tp_plan="auto")``
        or the script's own ``parallelize_module``; applying the plan again would fail).

        Raises:
            ValueError: ``tp_size > 1`` and the model carries no plan.
        """
        config, mesh = self._parallel_config, self._parallel_mesh
        if config is None or mesh is None or not config.tp_enabled:
            return model
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in model.parameters()):
            return model
        plan = tp_plan_of(model)
        if plan is None:
            raise ValueError(f"tp_size={config.tp_size} needs a tensor-parallel plan: set model.tp_plan (or "
                             "model._tp_plan, as transformers' models have) to a dict of submodule names to "
                             "'colwise' / 'rowwise', e.g. {'fc1': 'colwise', 'fc2': 'rowwise'}, before prepare()."
                             + see("tensor-parallel-plan"))
        from torch.distributed.tensor.parallel import parallelize_module

        return parallelize_module(model, mesh["tp"], parallel_styles(plan))
