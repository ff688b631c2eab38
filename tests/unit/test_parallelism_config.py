"""`unified.ParallelismConfig`: Accelerate 1.15's names, defaults, validation and mesh, checked
against Accelerate's own class; where each process sits on the mesh (`MeshPlace`); the loaders'
view of the data-parallel ranks (`DataRanks`); JAX's placement rule (`parallel_spec`). The
multi-process behaviour is the conformance suite's (unified/testing/suite/test_parallelism.py)."""
from __future__ import annotations

import numpy as np
import pytest

import unified
from unified import ParallelismConfig
from unified.data.layout import DataRanks, data_ranks
from unified.training.parallelism import MeshPlace

from .memory_backend import MemoryGroup

CONFIGS = [dict(dp_shard_size=4), dict(dp_replicate_size=2, dp_shard_size=2), dict(tp_size=4),
           dict(dp_shard_size=2, tp_size=2), dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2),
           dict(dp_replicate_size=4), dict()]
NAMES = ["dp_dim_names", "non_dp_dim_names", "dp_shard_cp_dim_names", "dp_cp_dim_names", "fsdp_dim_names",
         "total_size", "non_data_parallel_size", "data_parallel_size", "active_mesh_dims", "dp_replicate_enabled",
         "dp_shard_enabled", "tp_enabled", "cp_enabled", "sp_enabled"]


def _accelerate(**sizes):
    from accelerate.parallelism_config import ParallelismConfig as Theirs

    # a handler given: Accelerate's default TorchTensorParallelConfig() needs transformers
    return Theirs(**sizes, tp_handler=object() if sizes.get("tp_size", 1) > 1 else None)


@pytest.mark.parametrize("sizes", CONFIGS, ids=str)
def test_names_and_mesh_are_accelerates(sizes):
    ours, theirs = ParallelismConfig(**sizes), _accelerate(**sizes)
    for name in NAMES:
        assert getattr(ours, name) == getattr(theirs, name), name
    mesh = theirs._get_mesh()
    assert ours.mesh_shape() == (tuple(mesh) if mesh else ((), ()))
    assert (ours.dp_replicate_size, ours.dp_shard_size, ours.tp_size, ours.cp_size, ours.sp_size) == \
           (theirs.dp_replicate_size, theirs.dp_shard_size, theirs.tp_size, theirs.cp_size, theirs.sp_size)


def test_defaults_come_from_accelerates_variables(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    config = ParallelismConfig()
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == (1, 2, 2)


def test_importable_as_accelerate_exposes_it():
    from unified.utils import ParallelismConfig as FromUtils

    assert FromUtils is unified.ParallelismConfig


@pytest.mark.parametrize("sizes, error, words", [
    (dict(dp_shard_size=0), ValueError, "dp_shard_size must be at least 1"),
    (dict(tp_size=-1), ValueError, "tp_size must be at least 1"),
    (dict(cp_size=2), NotImplementedError, "Supported: dp_replicate_size, dp_shard_size"),
    (dict(sp_size=2), NotImplementedError, "context and sequence parallelism are not supported"),
    (dict(dp_replicate_size=2, tp_size=2), ValueError, "cannot be used with pure data parallelism"),
    (dict(sp_backend="ulysses"), ValueError, "sp_backend must be one of"),
])
def test_invalid_configurations_are_refused_clearly(sizes, error, words):
    with pytest.raises(error, match=words) as info:
        ParallelismConfig(**sizes)
    assert "docs/troubleshooting.md#parallelism-config" in str(info.value)


def test_the_process_count_must_match():
    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    config.check_processes(4)
    with pytest.raises(ValueError, match=r"total_size \(4\) does not match num_processes \(8\)"):
        config.check_processes(8)
    plain = ParallelismConfig()
    plain.check_processes(3)  # all 1: plain data parallelism over every process, as Accelerate
    assert plain.dp_replicate_size == 3 and plain.mesh_shape() == (("dp_replicate",), (3,))


@pytest.mark.parametrize("sizes", CONFIGS[:-1], ids=str)
def test_places_are_the_row_major_coordinates_of_the_mesh(sizes):
    config = ParallelismConfig(**sizes)
    names, shape = config.mesh_shape()
    grid = np.arange(config.total_size).reshape(shape)  # what init_device_mesh lays out
    for process in range(config.total_size):
        place = config.place_of(process)
        where = dict(zip(names, (int(i[0]) for i in np.nonzero(grid == process))))
        assert {d: where.get(d, 0) for d in ("dp_replicate", "dp_shard", "tp")} == place.coordinates
        assert place.data_rank == process // config.tp_size and place.data_size == config.data_parallel_size


@pytest.mark.parametrize("sizes, held, feeding", [
    ((1, 2, 2), [1, 1], [(0, 2), (1, 2)]),      # each process: one tensor-parallel group
    ((2, 2, 1), [2, 2], [(0, 2), (1, 2)]),      # HSDP: each process two data ranks, one batch split over them
    ((1, 4, 1), [2, 2], [(0, 2), (1, 2)]),
    ((1, 1, 4), [1, 1], [(0, 1), (0, 1)]),      # half a tensor-parallel group each: the same batch
], ids=str)
def test_places_of_processes_holding_several_devices(sizes, held, feeding):
    """2 processes of 2 devices (JAX): a process holds mesh positions 2p, 2p + 1; its coordinates are
    its first device's; the loaders follow one rank per process where it holds several."""
    config = ParallelismConfig(dp_replicate_size=sizes[0], dp_shard_size=sizes[1], tp_size=sizes[2])
    config.check_processes(2, devices_per_process=2)
    for process in range(2):
        place, first = config.place_of(process, 2), config.place_of(2 * process)
        assert place.coordinates == first.coordinates and place.data_rank == first.data_rank
        assert place.data_ranks_held == held[process]
        assert (place.feeding.data_rank, place.feeding.data_size) == feeding[process]


def test_several_devices_per_process_refusals():
    with pytest.raises(ValueError, match=r"does not match the mesh's 4 devices \(2 processes x 2 devices each\)"):
        ParallelismConfig(dp_shard_size=2, tp_size=4).check_processes(2, devices_per_process=2)
    config = ParallelismConfig(dp_shard_size=3, tp_size=2)  # 6 devices, 3 per process: a rank in two processes
    config.check_processes(2, devices_per_process=3)
    with pytest.raises(ValueError, match="parts of two groups") as info:
        config.place_of(0, 3)
    assert "docs/troubleshooting.md#parallelism-config" in str(info.value)


class _Backend:
    process_index, num_processes, uneven_batches = 3, 4, True

    def place_batch(self, batch):
        return batch


def test_loaders_see_the_data_parallel_rank():
    backend = _Backend()
    assert data_ranks(backend, None) is backend
    assert data_ranks(backend, MeshPlace({}, 0, 4)) is backend  # every process its own rank
    view = data_ranks(backend, ParallelismConfig(dp_shard_size=2, tp_size=2).place_of(3))
    assert isinstance(view, DataRanks) and (view.process_index, view.num_processes) == (1, 2)
    assert view.place_batch("b") == "b" and view.uneven_batches is True
    assert view.prepare_loader(object(), 0) is None  # a backend that adapts no foreign loaders
    samples = [{"i": np.int64(i)} for i in range(8)]
    seen = {}
    for rank in (0, 1):
        view.process_index = rank
        loader = unified.data.prepare_loader(unified.DataLoader(samples, batch_size=2), view, 0)
        seen[rank] = [int(i) for batch in loader for i in batch["i"]]
    assert seen == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}


def test_a_backend_without_a_named_mesh_refuses_the_configuration():
    with pytest.raises(NotImplementedError, match="needs a backend with a named device mesh"):
        MemoryGroup(1).accelerator(0, parallelism_config=ParallelismConfig())


def test_without_a_configuration_the_ranks_are_accelerates_error():
    acc = MemoryGroup(1).accelerator(0)
    assert acc.parallelism_config is None and acc.torch_device_mesh is None
    assert acc.state.parallelism_config is None
    with pytest.raises(RuntimeError, match="Set `parallelism_config` first"):
        _ = acc.data_parallel_rank


def test_one_torch_process_runs_a_configuration():
    pytest.importorskip("torch")
    acc = unified.Accelerator(backend="torch", parallelism_config=ParallelismConfig())
    try:
        assert (acc.data_parallel_rank, acc.data_parallel_shard_rank, acc.tensor_parallel_rank) == (0, 0, 0)
        assert acc.torch_device_mesh is None  # one process: no dimension to build
        assert acc.state.parallelism_config is acc.parallelism_config  # Accelerate's state.parallelism_config
        assert isinstance(acc.state.parallelism_config, ParallelismConfig)
    finally:
        acc.end_training()


def test_an_fsdp_plugin_needs_a_dimension_to_shard_over():
    from unified.training.parallelism import check_parallelism

    with pytest.raises(ValueError, match="no dimension for FSDP to shard across"):
        check_parallelism(ParallelismConfig(tp_size=2), 2, user_plugin=True)
    check_parallelism(ParallelismConfig(tp_size=2), 2, user_plugin=False)


def test_jax_places_annotated_axes_and_shards_the_rest_over_dp_shard():
    pytest.importorskip("jax")
    from jax.sharding import PartitionSpec as P

    from backends.jax.mesh import parallel_spec

    sizes = {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    assert parallel_spec((8, 4), sizes, (None, "tp")) == P("dp_shard", "tp")
    assert parallel_spec((4, 6), sizes, ("tp", None)) == P("tp", "dp_shard")
    assert parallel_spec((3,), sizes, None) == P()  # nothing divides: whole
    assert parallel_spec((4, 8), {"dp_replicate": 2, "dp_shard": 1, "tp": 1}, ("dp", None)) == P("dp_replicate")
    with pytest.raises(ValueError, match="names the axis 'model'"):
        parallel_spec((4, 4), sizes, ("model", None))


def test_torch_plans_take_transformers_style_names():
    pytest.importorskip("torch")
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from backends.torch.mesh import parallel_styles, tp_plan_of

    styles = parallel_styles({"fc1": "colwise", "fc2": "rowwise", "norm": "replicate"})
    assert isinstance(styles["fc1"], ColwiseParallel) and isinstance(styles["fc2"], RowwiseParallel)
    assert "norm" not in styles  # left whole on every process of the group
    with pytest.raises(ValueError, match=r"tp_plan\['fc1'\] = 'diagonal'"):
        parallel_styles({"fc1": "diagonal"})
    model = torch.nn.Linear(2, 2)
    assert tp_plan_of(model) is None
    model._tp_plan = {"": "colwise"}
    assert tp_plan_of(model) == {"": "colwise"}
