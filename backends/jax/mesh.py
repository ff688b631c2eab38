"""JAX's named mesh of a `unified.ParallelismConfig`, mixed into `JaxBackend`.

`configure_parallelism` makes ``accelerator.mesh`` a ``jax.sharding.Mesh`` with the axes
``("dp_replicate", "dp_shard", "tp")`` (Accelerate's names and order; an axis whose size is 1 is
kept, so an annotation naming it is valid everywhere) over every process's devices, process
``p`` at the same coordinates as on torch's ``DeviceMesh`` (row-major, ``tp`` innermost). A
process may hold several devices (e.g. CPU devices from
``XLA_FLAGS=--xla_force_host_platform_device_count``): they are consecutive positions of the
mesh, and a process whose devices hold several data-parallel ranks splits its batch over them
(`unified.training.parallelism.MeshPlace`).
`prepare` places each parameter by its ``nnx.with_partitioning`` annotation naming those axes
(or Accelerate's flattened views ``dp``, ``dp_shard_cp``, ``dp_cp``); with ``dp_shard_size > 1``
a dimension left unnamed is also split over ``dp_shard`` (`parallel_spec`). Batches are split
over ``("dp_replicate", "dp_shard")`` and replicated over ``tp`` (`data_sharding`).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np

from unified.errors import see

__all__ = ["JaxParallelism", "AXES", "DATA_AXES", "parallel_spec"]

AXES = ("dp_replicate", "dp_shard", "tp")
DATA_AXES = ("dp_replicate", "dp_shard")
# Accelerate's flattened views, as the axes they join (cp and sp are never enabled in unified)
_VIEWS = {"dp": DATA_AXES, "dp_shard_cp": ("dp_shard",), "dp_cp": DATA_AXES}


def _axes_of(name: Any) -> Tuple[str, ...]:
    """The mesh axes an annotation entry names (a name, a view, or a tuple of them)."""
    if name is None:
        return ()
    if isinstance(name, (tuple, list)):
        return tuple(a for n in name for a in _axes_of(n))
    if name in _VIEWS:
        return _VIEWS[name]
    if name not in AXES:
        raise ValueError(f"nnx.with_partitioning names the axis {name!r}, which the mesh of a ParallelismConfig has "
                         f"not: use {', '.join(AXES)} or {', '.join(_VIEWS)}." + see("tensor-parallel-plan"))
    return (name,)


def parallel_spec(shape: Sequence[int], sizes: dict, annotation: Optional[Tuple[Any, ...]]) -> Any:
    """The ``PartitionSpec`` of an array of ``shape``: the axes its annotation names (a
    dimension an axis does not divide stays whole), then, with ``dp_shard`` > 1 and not named,
    the largest remaining dimension ``dp_shard`` divides split over it (FSDP).

    Example:
        >>> parallel_spec((8, 4), {"dp_replicate": 1, "dp_shard": 2, "tp": 2}, (None, "tp"))
        PartitionSpec('dp_shard', 'tp')
    """
    from jax.sharding import PartitionSpec

    entries: list = [None] * len(shape)
    used: set = set()
    for d, name in enumerate((annotation or ())[:len(shape)]):
        axes = tuple(a for a in _axes_of(name) if sizes[a] > 1)
        count = int(np.prod([sizes[a] for a in axes])) if axes else 1
        if axes and shape[d] % count == 0:
            entries[d] = axes[0] if len(axes) == 1 else axes
            used.update(axes)
    if sizes["dp_shard"] > 1 and "dp_shard" not in used:
        free = [d for d in range(len(shape)) if entries[d] is None and shape[d] % sizes["dp_shard"] == 0]
        if free:
            best = max(free, key=lambda d: (shape[d], -d))
            entries[best] = "dp_shard"
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


class JaxParallelism:
    """What ``Accelerator(parallelism_config=...)`` asks of JAX (mixed into `JaxBackend`)."""

    _parallel_config: Optional[Any] = None
    _feeding_size = 1  # data-parallel ranks the prepared loaders see (one per process holding several)
    _ranks_held = 1  # data-parallel ranks this process's devices hold (its batch is split over them)

    def parallel_devices_per_process(self) -> int:
        """Devices of the mesh each process holds (every process must hold as many)."""
        counts = Counter(d.process_index for d in jax.devices())
        if len(set(counts.values())) > 1:
            raise ValueError(f"Accelerator(parallelism_config=...) on JAX needs every process to hold as many devices; "
                             f"this group's processes hold {dict(sorted(counts.items()))} (process: devices)."
                             + see("parallelism-config"))
        return jax.local_device_count()

    def configure_parallelism(self, config: Any) -> None:
        """Make `mesh` the named mesh of ``config`` over every process's devices, each process's
        devices consecutive (row-major, ``tp`` innermost), as torch lays out processes."""
        from jax.sharding import Mesh

        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        place = config.place_of(self.process_index, self.parallel_devices_per_process())
        sizes = [config.dp_replicate_size, config.dp_shard_size, config.tp_size]
        self._parallel_config = config
        self._feeding_size, self._ranks_held = place.feeding.data_size, place.data_ranks_held
        self._mesh = Mesh(np.array(devices, dtype=object).reshape(sizes), AXES)

    def axis_sizes(self) -> dict:
        config = self._parallel_config
        return {"dp_replicate": config.dp_replicate_size, "dp_shard": config.dp_shard_size, "tp": config.tp_size}

    def data_sharding(self) -> Tuple[Any, int]:
        """The sharding of a batch (rows over the data axes, replicated over ``tp``) and the
        number of processes' batches it joins (the data-parallel ranks; fewer where a process
        holds several: its batch is split over them); the 1-D ``"data"`` mesh's without a
        configuration."""
        from jax.sharding import NamedSharding, PartitionSpec

        if self._parallel_config is None:
            return NamedSharding(self.mesh, PartitionSpec("data")), self.num_processes
        return NamedSharding(self.mesh, PartitionSpec(DATA_AXES)), self._feeding_size

    def parallel_placement(self, annotated: dict) -> Any:
        """``(like, path) -> sharding`` of a prepared object's leaves under the configuration."""
        from jax.sharding import NamedSharding, PartitionSpec

        from .tensors import is_key

        sizes = self.axis_sizes()

        def sharding_of(like: Any, path: Tuple[Any, ...]) -> Any:
            if is_key(like) or not hasattr(like, "shape"):
                return NamedSharding(self.mesh, PartitionSpec())
            return NamedSharding(self.mesh, parallel_spec(tuple(like.shape), sizes, annotated.get(path)))

        return sharding_of
