"""Conformance: ``Accelerator(parallelism_config=...)`` on both backends, one group of 4
processes per backend (process start-up is the expensive part): HSDP, tensor parallelism,
``dp_shard x tp`` and ``dp_shard`` train as one process on the global batch; batches are identical
within a tensor-parallel group and disjoint across data-parallel ranks; a resume is exact; the
sharded state saved on each mesh loads on every other mesh, and (a second group, of 1 process) on
one plain process; ``save_model`` writes the whole parameters. A third group, of 2 processes holding 2
devices each (for a backend whose testing kit has `Kit.local_devices`: JAX), runs the same meshes over
those 4 devices and loads the 4 processes' states; the others skip its tests, saying why."""
from __future__ import annotations

import pytest

from ..harness import Runs, run_group
from ..kit import kit_of
from ..parallel_scenarios import (
    BATCH,
    DEVICES,
    DEVICES_PER_PROCESS,
    MESHES,
    par_checkpoints,
    par_checkpoints_one,
    par_devices_checkpoints,
    par_devices_resume,
    par_devices_train,
    par_resume,
    par_train,
)

pytestmark = pytest.mark.multiprocess

# (saved on, loaded on) -> why it fails today: a defect of the backend's sharding or of
# unified/checkpoint, kept visible (xfail strict: the test fails once it is fixed)
KNOWN_LOAD_DEFECTS: dict = {"torch": {}, "jax": {}}
KNOWN_MODEL_DEFECTS = {"torch": {}, "jax": {}}
# the same for the group of 2 processes holding 2 devices each: (saved on, loaded on) and mesh
KNOWN_DEVICES_LOAD_DEFECTS: dict = {"jax": {}}
KNOWN_DEVICES_MODEL_DEFECTS: dict = {"jax": {}}


@pytest.fixture(scope="module")
def group(backend, tmp_path_factory):
    folder = tmp_path_factory.mktemp("parallel")
    four = run_group(backend, 4, [par_train, par_resume, par_checkpoints], folder, deadline=400.0).ok()
    # the same meshes over 4 devices held by 2 processes (a backend whose testing kit cannot give a
    # process several devices runs none: its tests are skipped, saying why); it loads what the 4 saved
    local_devices = kit_of(backend).local_devices
    devices = run_group(backend, 2, [par_devices_train, par_devices_resume, par_devices_checkpoints], folder,
                        deadline=400.0, extra_env=local_devices(DEVICES_PER_PROCESS) if local_devices else None).ok()
    # one plain process loads what the 4 (and the 2 of 2 devices) saved (the same shared folder)
    one = run_group(backend, 1, [par_checkpoints_one], folder, deadline=120.0).ok()
    return Runs(four, devices, one)


def _place(sizes, process):
    """(dp_replicate, dp_shard, tp) coordinates of ``process`` (tp innermost), and its data rank."""
    replicate, shard, tp = sizes
    coordinates = (process // (shard * tp), process // tp % shard, process % tp)
    return coordinates, coordinates[0] * shard + coordinates[1]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_ranks_follow_the_mesh(group, mesh):
    for process, r in enumerate(group.scenario(par_train)):
        assert tuple(r[mesh]["ranks"]) == _place(MESHES[mesh], process)[0], (process, r[mesh])


@pytest.mark.parametrize("mesh", list(MESHES))
def test_batches_identical_within_a_tp_group_and_disjoint_across_data_ranks(group, mesh):
    results = group.scenario(par_train)
    by_rank = {}
    for process, r in enumerate(results):
        rank = _place(MESHES[mesh], process)[1]
        by_rank.setdefault(rank, []).append(r[mesh]["batches"])
    for rank, seen in by_rank.items():
        assert all(s == seen[0] for s in seen), (mesh, rank, seen)  # one TP group, one batch
    assert all(r[mesh]["skipped_to_second"] for r in results), mesh  # skip_first_batches counts global batches
    for step in range(len(results[0][mesh]["batches"])):
        rows = [i for seen in by_rank.values() for i in seen[0][step]]
        assert len(rows) == len(set(rows)), (mesh, step, rows)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_training_equals_one_process_on_the_global_batch(group, mesh):
    for r in group.scenario(par_train):
        assert r[mesh]["global_batch"] == BATCH * MESHES[mesh][0] * MESHES[mesh][1], r[mesh]
        assert r[mesh]["moved"] > 1e-3, r[mesh]
        assert r[mesh]["difference"] < 1e-5, r[mesh]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_mesh_has_accelerate_dimension_names(group, mesh):
    """The active dimensions in Accelerate's order (torch's DeviceMesh, with its flattened views),
    or every axis, those of size 1 included (a jax.sharding.Mesh, where annotations name them)."""
    sizes = dict(zip(("dp_replicate", "dp_shard", "tp"), MESHES[mesh]))
    active = [d for d, n in sizes.items() if n > 1]
    views = {"dp": [d for d in active if d != "tp"], "dp_shard_cp": [d for d in active if d == "dp_shard"]}
    views["dp_cp"] = views["dp"]
    r = group.scenario(par_train)[0][mesh]["mesh"]
    assert r["axes"] in (active, list(sizes)), r
    if r["views"]:
        assert r["axes"] == active and r["views"] == sorted(v for v, dims in views.items() if dims), r


def test_resume_is_exact(group):
    for r in group.scenario(par_resume):
        assert r["restored_difference"] == 0.0, r
        assert r["same_batches"], r
        assert r["resumed_difference"] == 0.0, r


def test_sharded_state_loads_on_another_mesh(group):
    for r in group.scenario(par_resume):
        assert r["other_mesh_error"] is None, r["other_mesh_error"]
        assert r["other_mesh_difference"] == 0.0, r


@pytest.mark.parametrize("mesh", list(MESHES))
def test_gather_for_metrics_counts_data_parallel_ranks(group, mesh):
    for r in group.scenario(par_train):
        assert r[mesh]["gathered"] == list(range(10)), (mesh, r[mesh]["gathered"])


def _known(request, defects, key):
    """Mark the running test xfail(strict) when ``key`` is a known defect of its backend."""
    reason = defects.get(request.node.callspec.params["backend"], {}).get(key)
    if reason is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


@pytest.mark.parametrize("source, target", [(source, target) for source in MESHES
                                            for target in [*MESHES, "one_process"] if source != target])
def test_sharded_state_loads_on_every_other_mesh_and_on_one_process(group, request, source, target):
    """Saved by every process on ``source``, loaded on ``target`` (another mesh of the 4
    processes, or one plain process): parameters and optimizer state (momentum) exactly the saved,
    and one training step on them runs (the optimizer's state placed as this run's parameters)."""
    _known(request, KNOWN_LOAD_DEFECTS, (source, target))
    results = group.scenario(par_checkpoints_one if target == "one_process" else par_checkpoints)
    for process, r in enumerate(results):
        load = r["loads"][source] if target == "one_process" else r["loads"][target][source]
        assert load["error"] is None, (process, load["error"])
        assert load["params"] == 0.0 and load["optimizer"] == 0.0, (process, load)


# -- 2 processes of 2 devices each (the backend's Kit.local_devices) ----------------------------------
def _device_places(sizes):
    """Each of the 2 processes' (dp_replicate, dp_shard, tp) coordinates (those of its first device:
    process p holds positions 2p and 2p + 1, tp innermost) and the data ranks its devices hold."""
    replicate, shard, tp = sizes
    out = []
    for process in range(2):
        positions = range(process * DEVICES_PER_PROCESS, (process + 1) * DEVICES_PER_PROCESS)
        first = positions[0]
        out.append(((first // (shard * tp), first // tp % shard, first % tp), sorted({p // tp for p in positions})))
    return out


@pytest.mark.parametrize("mesh", list(MESHES))
def test_devices_ranks_follow_the_mesh(group, mesh):
    for process, r in enumerate(group.scenario(par_devices_train)):
        assert tuple(r[mesh]["ranks"]) == _device_places(MESHES[mesh])[process][0], (process, r[mesh])


@pytest.mark.parametrize("mesh", list(MESHES))
def test_devices_each_data_rank_gets_its_own_rows(group, mesh):
    """Each device gets the rows of its data-parallel rank: a process whose devices hold two data
    ranks splits its batch over them (each rank its own rows); the devices of one tensor-parallel
    group (in one process or two) get the same rows; ranks are disjoint, and together they are the
    global batch, which is ``batch_size`` per process feeding distinct rows."""
    results = group.scenario(par_devices_train)
    places = _device_places(MESHES[mesh])
    data_size = MESHES[mesh][0] * MESHES[mesh][1]
    feeding = data_size // len(places[0][1])  # processes (or TP groups of processes) reading distinct rows
    for process, r in enumerate(results):
        assert r[mesh]["global_batch"] == BATCH * feeding, r[mesh]
        assert all(sorted(map(int, step)) == places[process][1] for step in r[mesh]["by_rank"]), (process, r[mesh])
    assert all(r[mesh]["skipped_to_second"] for r in results), mesh
    for step in range(len(results[0][mesh]["by_rank"])):
        by_rank = {}
        for r in results:
            for rank, rows in r[mesh]["by_rank"][step].items():
                by_rank.setdefault(int(rank), []).append(rows)
        assert sorted(by_rank) == list(range(data_size)), (mesh, step, by_rank)
        assert all(all(rows == seen[0] for rows in seen) for seen in by_rank.values()), (mesh, step, by_rank)
        rows = [i for seen in by_rank.values() for i in seen[0]]
        assert len(rows) == len(set(rows)) == BATCH * feeding, (mesh, step, rows)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_devices_training_equals_one_process_on_the_global_batch(group, mesh):
    for r in group.scenario(par_devices_train):
        assert r[mesh]["moved"] > 1e-3, r[mesh]
        assert r[mesh]["difference"] < 1e-5, r[mesh]
        assert r[mesh]["gathered"] == list(range(10)), (mesh, r[mesh]["gathered"])


def test_devices_resume_is_exact_and_loads_on_another_mesh(group):
    for r in group.scenario(par_devices_resume):
        assert r["restored_difference"] == 0.0, r
        assert r["same_batches"], r
        assert r["resumed_difference"] == 0.0, r
        assert r["other_mesh_error"] is None, r["other_mesh_error"]
        assert r["other_mesh_difference"] == 0.0, r


@pytest.mark.parametrize("source, target", [
    *[(f"processes/{source}", target) for source in MESHES for target in MESHES],
    *[(source, target) for source in MESHES for target in MESHES if source != target],
    *[(f"{DEVICES}/{source}", "one_process") for source in MESHES]])
def test_devices_sharded_state_loads_across_layouts(group, request, source, target):
    """The state saved on ``source`` loaded on ``target``: a mesh of the 4 processes
    (``processes/<mesh>``) or of the 2 of 2 devices (``<mesh>``) into a mesh of the 2 of 2 devices;
    one of the 2 of 2 devices (``devices/<mesh>``) into one plain process. Parameters and momentum
    exactly the saved, and one training step on them runs."""
    _known(request, KNOWN_DEVICES_LOAD_DEFECTS, (source, target))
    group.scenario(par_devices_checkpoints)  # skips where the backend's processes hold one device each
    results = group.scenario(par_checkpoints_one if target == "one_process" else par_devices_checkpoints)
    for process, r in enumerate(results):
        load = r["loads"][source] if target == "one_process" else r["loads"][target][source]
        assert load["error"] is None, (process, load["error"])
        assert load["params"] == 0.0 and load["optimizer"] == 0.0, (process, load)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_devices_save_model_writes_the_whole_parameters(group, request, mesh):
    _known(request, KNOWN_DEVICES_MODEL_DEFECTS, mesh)
    _assert_whole_model(group.scenario(par_devices_checkpoints), mesh)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_save_model_writes_the_whole_parameters(group, request, mesh):
    """``save_model`` of a sharded model on every mesh: one file of the gathered (trained)
    parameters, which are those of one process trained on the global batches."""
    _known(request, KNOWN_MODEL_DEFECTS, mesh)
    _assert_whole_model(group.scenario(par_checkpoints), mesh)


def _assert_whole_model(results, mesh):
    """Every process saved ``mesh``'s model without error; the file holds the trained parameters
    exactly, which are one process's trained on the global batches (< 1e-5)."""
    assert all(r["models"][mesh]["error"] is None for r in results), [r["models"][mesh] for r in results]
    model = results[0]["models"][mesh]
    assert model["trained"] == 0.0, model
    assert model["reference"] < 1e-5, model
