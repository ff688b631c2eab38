"""Parallelism beyond one axis: `ParallelismConfig`, with Accelerate 1.15's names, defaults,
validation and mesh (``dp_replicate``, ``dp_shard``, ``tp``, and the flattened views ``dp``,
``dp_shard_cp``, ``dp_cp``), and `MeshPlace`, where a process sits on that mesh.

The mesh is the same on every backend: its active dimensions in the order ``dp_replicate,
dp_shard, cp, sp, tp`` (Accelerate's), row-major over the process indices, so ``tp`` is the
innermost dimension (the processes of one tensor-parallel group are consecutive). torch builds
a ``DeviceMesh`` of it (`backends.torch.mesh`), JAX a ``jax.sharding.Mesh`` with the same axis
names (`backends.jax.mesh`). This module only holds the settings and the arithmetic of ranks;
it imports neither framework.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional, Tuple

from ..errors import see

__all__ = ["ParallelismConfig", "MeshPlace", "MESH_ORDER", "FLATTENED", "sharding_plugin", "check_parallelism"]

# Accelerate's canonical order of the mesh dimensions (ParallelismConfig._get_mesh)
MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
# the joint views Accelerate builds on the mesh (DeviceMesh._flatten), name -> dimensions
FLATTENED = ("dp", "dp_shard_cp", "dp_cp")


def _env_int(name: str) -> int:
    return int(os.environ.get(name, "1"))


@dataclasses.dataclass
class ParallelismConfig:
    """How models and batches are split over the processes (Accelerate's ``ParallelismConfig``).

    Args:
        dp_replicate_size: processes holding whole replicas of (a shard group of) the model.
            With ``dp_shard_size > 1`` too it is HSDP: replicated over ``dp_replicate``, sharded
            over ``dp_shard``. Default ``PARALLELISM_CONFIG_DP_REPLICATE_SIZE``, else 1.
        dp_shard_size: processes the model's parameters and optimizer state are sharded over
            (FSDP2 on torch; a split over the ``dp_shard`` axis on JAX). Default
            ``PARALLELISM_CONFIG_DP_SHARD_SIZE``, else 1.
        tp_size: processes each layer is split over (tensor parallelism); every process of one
            tensor-parallel group gets the same batch. Default ``PARALLELISM_CONFIG_TP_SIZE``, else 1.
        cp_size, sp_size: context and sequence parallelism; only 1 is supported by unified.
        cp_backend, sp_backend: Accelerate's context- and sequence-parallel backends, kept as
            given for compatibility (nothing uses them with size 1); ``sp_backend`` must be
            ``"deepspeed"`` (its default), as in Accelerate.
        tp_handler, cp_handler, sp_handler: Accelerate's handlers, kept as given.

    The product of the sizes must be the number of processes; all 1 (the default) means plain
    data parallelism over every process (``dp_replicate_size`` becomes the process count, as in
    Accelerate). ``dp_replicate_size > 1`` with ``tp_size > 1`` needs ``dp_shard_size > 1``.

    Example:
        >>> from unified import ParallelismConfig
        >>> config = ParallelismConfig(dp_shard_size=2, tp_size=2)
        >>> config.active_mesh_dims, config.data_parallel_size
        (['dp_shard', 'tp'], 2)
        >>> config.mesh_shape()
        (('dp_shard', 'tp'), (2, 2))
    """

    dp_replicate_size: Optional[int] = None
    dp_shard_size: Optional[int] = None
    tp_size: Optional[int] = None
    cp_size: Optional[int] = None
    cp_backend: Optional[str] = None
    sp_size: Optional[int] = None
    sp_backend: Optional[str] = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None

    # the backend's mesh of this configuration once an Accelerator built it (torch: a DeviceMesh)
    device_mesh = None

    def __post_init__(self) -> None:
        if self.dp_replicate_size is None:
            self.dp_replicate_size = _env_int("PARALLELISM_CONFIG_DP_REPLICATE_SIZE")
        if self.dp_shard_size is None:
            self.dp_shard_size = _env_int("PARALLELISM_CONFIG_DP_SHARD_SIZE")
        if self.tp_size is None:
            self.tp_size = _env_int("PARALLELISM_CONFIG_TP_SIZE")
        if self.cp_size is None:
            self.cp_size = _env_int("PARALLELISM_CONFIG_CP_SIZE")
        if self.cp_backend is None:
            self.cp_backend = os.environ.get("PARALLELISM_CONFIG_CP_BACKEND")
        if self.sp_size is None:
            self.sp_size = _env_int("PARALLELISM_CONFIG_SP_SIZE")
        if self.sp_backend is None:
            self.sp_backend = os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
            value = getattr(self, f"{name}_size")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}_size must be at least 1, but got {value!r}." + see("parallelism-config"))
        if self.sp_backend != "deepspeed":
            raise ValueError(f"sp_backend must be one of ['deepspeed'], but got {self.sp_backend!r}."
                             + see("parallelism-config"))
        if self.cp_size > 1 or self.sp_size > 1:
            what = f"cp_size={self.cp_size}" if self.cp_size > 1 else f"sp_size={self.sp_size}"
            raise NotImplementedError(
                f"ParallelismConfig({what}): context and sequence parallelism are not supported by unified. "
                "Supported: dp_replicate_size, dp_shard_size (FSDP2 / HSDP) and tp_size (tensor parallelism), "
                "with cp_size=1 and sp_size=1." + see("parallelism-config"))
        if self.tp_size > 1 and self.dp_replicate_size > 1 and self.dp_shard_size == 1:
            raise ValueError(
                "Tensor/Context parallelism (tp/cp_size > 1) cannot be used with pure data parallelism "
                "(dp_replicate_size > 1 and dp_shard_size == 1). Please set dp_shard_size > 1 and "
                "dp_replicate_size == 1 to compose FSDP + TP/CP for 2D parallel, or set dp_replicate_size > 1 "
                "and dp_shard_size > 1 to compose HSDP + TP/CP for 3D parallel." + see("parallelism-config"))

    def __repr__(self) -> str:
        return (f"ParallelismConfig(dp_replicate_size={self.dp_replicate_size}, dp_shard_size={self.dp_shard_size}, "
                f"tp_size={self.tp_size}, cp_size={self.cp_size}, sp_size={self.sp_size}, "
                f"total_size={self.total_size})")

    # -- Accelerate's names -----------------------------------------------------------------------
    @property
    def _sizes(self) -> Dict[str, int]:
        return {"dp_replicate": self.dp_replicate_size, "dp_shard": self.dp_shard_size, "tp": self.tp_size,
                "cp": self.cp_size, "sp": self.sp_size}

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    @property
    def dp_dim_names(self) -> List[str]:
        """Enabled dimensions data parallelism runs over (different batches)."""
        return [d for d in ("dp_replicate", "dp_shard") if self._sizes[d] > 1]

    @property
    def non_dp_dim_names(self) -> List[str]:
        """Enabled dimensions whose processes receive the same batch."""
        return [d for d in ("tp", "cp", "sp") if self._sizes[d] > 1]

    @property
    def dp_shard_cp_dim_names(self) -> List[str]:
        """Enabled dimensions flattened into ``dp_shard_cp``, the one FSDP shards over."""
        return [d for d in ("dp_shard", "cp") if self._sizes[d] > 1]

    @property
    def dp_cp_dim_names(self) -> List[str]:
        """Enabled dimensions the loss is averaged over (flattened into ``dp_cp``)."""
        return [d for d in ("dp_replicate", "dp_shard", "cp") if self._sizes[d] > 1]

    @property
    def fsdp_dim_names(self) -> List[str]:
        """The mesh dimensions FSDP is applied over: ``["dp_replicate", "dp_shard_cp"]`` for HSDP."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def total_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size * self.sp_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def active_mesh_dims(self) -> List[str]:
        """Names of every enabled mesh dimension."""
        return self.dp_dim_names + self.non_dp_dim_names

    def mesh_shape(self) -> Tuple[Tuple[str, ...], Tuple[int, ...]]:
        """``(dimension names, sizes)`` of the mesh, in Accelerate's order; ``((), ())`` when no
        dimension is enabled (one process).

        Example:
            >>> ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).mesh_shape()
            (('dp_replicate', 'dp_shard'), (2, 2))
        """
        dims = [d for d in MESH_ORDER if d in self.active_mesh_dims]
        return tuple(dims), tuple(self._sizes[d] for d in dims)

    def flattened_views(self) -> Dict[str, List[str]]:
        """The joint views of the mesh and the dimensions each flattens (only those with any).

        Example:
            >>> ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).flattened_views()["dp"]
            ['dp_replicate', 'dp_shard']
        """
        views = {"dp": self.dp_dim_names, "dp_shard_cp": self.dp_shard_cp_dim_names, "dp_cp": self.dp_cp_dim_names}
        return {name: dims for name, dims in views.items() if dims}

    def get_device_mesh(self, device_type: Optional[str] = None) -> Any:
        """The mesh an Accelerator built of this configuration (torch's ``DeviceMesh``).

        Raises:
            ValueError: no Accelerator has built it yet.

        Example:
            >>> accelerator = Accelerator(parallelism_config=config)  # doctest: +SKIP
            >>> config.get_device_mesh()["tp"].size()                 # doctest: +SKIP
            2
        """
        if self.device_mesh is None:
            raise ValueError("this ParallelismConfig has no device mesh yet: pass it to "
                             "Accelerator(parallelism_config=...), which builds it." + see("parallelism-config"))
        return self.device_mesh

    def to_json(self) -> Dict[str, Any]:
        """The sizes and backends as a dict."""
        return {f"{d}_size": s for d, s in self._sizes.items()} | {"cp_backend": self.cp_backend,
                                                                    "sp_backend": self.sp_backend}

    # -- unified's checks ---------------------------------------------------------------------------
    def check_processes(self, num_processes: int, devices_per_process: int = 1) -> None:
        """Fit the configuration to the group, as Accelerate's ``_validate_accelerator``: all
        sizes 1 on several processes means ``dp_replicate_size=num_processes``; otherwise the
        sizes' product must be the process count. Where each process holds several devices of
        the mesh (JAX: ``devices_per_process``), it is a mesh of devices: the sizes' product
        must be the device count (and all 1 means ``dp_replicate_size`` = the devices).

        Example:
            >>> config = ParallelismConfig()
            >>> config.check_processes(4); config.dp_replicate_size
            4
            >>> ParallelismConfig(dp_shard_size=2, tp_size=2).check_processes(2, devices_per_process=2)
        """
        devices = num_processes * devices_per_process
        if self.total_size == 1 and devices > 1:
            self.dp_replicate_size = devices
        if self.total_size != devices:
            what = f"num_processes ({num_processes})" if devices_per_process == 1 else (
                f"the mesh's {devices} devices ({num_processes} processes x {devices_per_process} devices each)")
            raise ValueError(
                f"ParallelismConfig total_size ({self.total_size}) does not match {what}. "
                "Please adjust dp_replicate_size/dp_shard_size/tp_size/cp_size/sp_size." + see("parallelism-config"))

    @property
    def shards_parameters(self) -> bool:
        """True when a prepared model's parameters are split (``dp_shard`` or ``tp``)."""
        return self.dp_shard_enabled or self.tp_enabled

    def place_of(self, process_index: int, devices_per_process: int = 1) -> "MeshPlace":
        """Where process ``process_index`` sits on the mesh (`MeshPlace`); with
        ``devices_per_process`` > 1 it holds that many consecutive positions (JAX)."""
        return MeshPlace.of(self, process_index, devices_per_process)


@dataclasses.dataclass(frozen=True)
class MeshPlace:
    """A process's coordinates on the mesh of a `ParallelismConfig` (row-major, ``tp``
    innermost) and the data-parallel rank its batches follow.

    A process may hold several consecutive positions of the mesh (JAX: several devices per
    process, ``devices``); its coordinates and ``data_rank`` are those of its first one, and
    ``data_ranks_held`` is how many data-parallel ranks its positions span. Such a process
    reads one batch for all of them (split evenly over them, as JAX splits a process's batch
    over its devices): the ranks prepared loaders follow are `feeding`'s. A process may hold
    whole tensor-parallel groups (``devices`` a multiple of ``tp_size``) or part of one
    (``tp_size`` a multiple of ``devices``); anything else (a data rank split between two
    processes) is a `ValueError`.

    Example:
        >>> place = ParallelismConfig(dp_shard_size=2, tp_size=2).place_of(3)
        >>> place.coordinates, place.data_rank, place.data_size
        ({'dp_replicate': 0, 'dp_shard': 1, 'tp': 1}, 1, 2)
        >>> hsdp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).place_of(1, devices_per_process=2)
        >>> hsdp.data_rank, hsdp.data_ranks_held, (hsdp.feeding.data_rank, hsdp.feeding.data_size)
        (2, 2, (1, 2))
    """

    coordinates: Dict[str, int]
    data_rank: int
    data_size: int
    devices: int = 1  # consecutive mesh positions this process holds (its devices)
    data_ranks_held: int = 1  # data-parallel ranks among them

    @classmethod
    def of(cls, config: ParallelismConfig, process_index: int, devices: int = 1) -> "MeshPlace":
        names, sizes = config.mesh_shape()
        coordinates: Dict[str, int] = {}
        rest = process_index * devices  # the first of this process's positions
        for name, size in reversed(list(zip(names, sizes))):
            coordinates[name] = rest % size
            rest //= size
        ordered = {d: coordinates.get(d, 0) for d in ("dp_replicate", "dp_shard", "tp")}
        data_size = config.data_parallel_size
        data_rank = ordered["dp_replicate"] * config.dp_shard_size + ordered["dp_shard"]
        tp = config.non_data_parallel_size
        if devices % tp and tp % devices:
            raise ValueError(
                f"each process holds {devices} devices of the mesh and a tensor-parallel group is {tp} devices: a "
                "process would hold parts of two groups, and a data-parallel rank's rows would come from two "
                "processes. Use a tp_size that divides the devices per process or is a multiple of it."
                + see("parallelism-config"))
        return cls(ordered, data_rank, data_size, devices, max(1, devices // tp))

    @property
    def feeding(self) -> "MeshPlace":
        """The place prepared loaders follow: this one, or, for a process holding several
        data-parallel ranks, one rank per process (``data_rank // data_ranks_held`` of
        ``data_size // data_ranks_held``), whose batch the process splits over its ranks."""
        if self.data_ranks_held == 1:
            return self
        held = self.data_ranks_held
        return MeshPlace(self.coordinates, self.data_rank // held, self.data_size // held, self.devices, 1)


def sharding_plugin(config: Optional[ParallelismConfig], plugin: Any, plugin_class: Any) -> Any:
    """The ``fsdp_plugin`` a run with ``config`` shards with: the user's, or the defaults
    (``plugin_class()``) when the configuration splits parameters (``dp_shard_size`` or
    ``tp_size`` > 1) and none was given; a configuration that is not a `ParallelismConfig` is a
    `TypeError`.

    Example:
        >>> sharding_plugin(ParallelismConfig(tp_size=2), None, dict)
        {}
    """
    if config is None:
        return plugin
    if not isinstance(config, ParallelismConfig):
        raise TypeError(f"parallelism_config must be a unified.ParallelismConfig, not {type(config).__name__}."
                        + see("parallelism-config"))
    if plugin is None and config.shards_parameters:
        return plugin_class()
    return plugin


def check_parallelism(config: ParallelismConfig, num_processes: int, user_plugin: bool,
                      devices_per_process: int = 1) -> None:
    """`ParallelismConfig.check_processes`, and Accelerate's refusal of an ``fsdp_plugin``
    with no dimension to shard over (``dp_shard_size`` 1)."""
    config.check_processes(num_processes, devices_per_process)
    if user_plugin and config.total_size > 1 and not config.dp_shard_enabled:
        raise ValueError("FSDP is enabled but the parallelism config has no dimension for FSDP to shard across "
                         "(dp_shard_size is 1): set dp_shard_size (HSDP: with dp_replicate_size), or leave out "
                         "fsdp_plugin." + see("parallelism-config"))
