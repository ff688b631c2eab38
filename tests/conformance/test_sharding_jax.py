"""Conformance: sharded state (Accelerator(fsdp_plugin=...)): parameters and optimizer state really
split over the processes, training equal to the replicated run, a checkpoint written by every
process that loads on another number of processes (2 -> 3, 2 -> 1, 3 -> 2), damaged shard
files refused with nothing restored, a consolidated save_model, and async sharded saves (written
in the background, failing on every process when one fails). Backends take part through
their profile's ``sharded_setup``."""
from __future__ import annotations

import pytest

from ..conftest import BACKENDS
from .harness import run_group
from .profiles import profile

pytestmark = pytest.mark.multiprocess
SHARDED_BACKENDS = [b for b in BACKENDS if profile(b).sharded_setup]


def _group(backend, size, scenarios, shared):
    result = run_group(backend, size, scenarios, shared, deadline=300.0,
                       extra_env={"UNIFIED_TEST_SHARED": str(shared), "UNIFIED_TEST_SCENARIOS": "sharding_jax_scenarios"})
    assert all(rc == 0 for rc in result.returncodes), result.show_logs()
    return result


@pytest.fixture(scope="module", params=SHARDED_BACKENDS)
def runs(request, tmp_path_factory):
    """Save on 2; load on 3 (then save there) and on 1; load the 3-process checkpoint on 2."""
    backend = request.param
    shared = tmp_path_factory.mktemp(f"sharded-{backend}")
    saved = _group(backend, 2, ["shard_train_and_save", "shard_async_save"], shared)
    on_three = _group(backend, 3, ["shard_load_from_2", "shard_damaged", "shard_save_here"], shared)
    on_one = _group(backend, 1, ["shard_load_from_2"], shared)
    back_on_two = _group(backend, 2, ["shard_load_from_3"], shared)
    return {"saved": saved.scenario("shard_train_and_save"), "async": saved.scenario("shard_async_save"),
            "three": on_three.scenario("shard_load_from_2"),
            "damaged": on_three.scenario("shard_damaged"), "one": on_one.scenario("shard_load_from_2"),
            "three_to_two": back_on_two.scenario("shard_load_from_3")}


def _split(placements):
    return {name for name, (_, replicated) in placements.items() if not replicated}


def test_parameters_are_split_over_the_processes(runs):
    for r in runs["saved"]:
        split = _split(r["placements"])
        # every kernel and the biases a process count divides; the 5-wide bias stays whole
        assert split == {"first/kernel", "first/bias", "middle/kernel", "middle/bias", "last/kernel"}, r["placements"]
        assert r["placements"]["last/bias"][1] is True
        # the unannotated 6 x 12 kernel along its largest dimension; the 12 x 6 kernel annotated
        # (None, "model") along its annotated dimension, not its largest
        assert r["placements"]["first/kernel"][0] == "P(None, 'data')", r["placements"]
        assert r["placements"]["middle/kernel"][0] == "P(None, 'data')", r["placements"]
        assert r["placements"]["last/kernel"][0] == "P('data',)", r["placements"]
        assert r["placements_after_training"] == r["placements"]  # the jitted step keeps the placement
    for r in runs["three"] + runs["three_to_two"]:
        assert _split(r["placements"]) >= {"first/kernel", "middle/kernel", "last/kernel"}, r["placements"]


def test_sharded_training_matches_the_replicated_run(runs):
    for r in runs["saved"]:
        assert r["initial_equal"]
        assert r["params_vs_replicated"] < 1e-5, r
        assert r["optimizer_vs_replicated"] < 1e-5, r
        for case in ("bf16", "accumulation"):
            loop = r["loop"][case]
            assert loop["moved"] > 1e-3, (case, loop)  # the steps changed the parameters
            assert loop["params"] < (2e-2 if case == "bf16" else 1e-5), (case, loop)
            assert _split(loop["still_sharded"]), (case, loop)


@pytest.mark.parametrize("case", ["three", "one", "three_to_two"])
def test_a_sharded_checkpoint_loads_on_another_number_of_processes(runs, case):
    for rank, r in enumerate(runs[case]):
        assert r["params_equal"], (case, rank)
        assert r["optimizer_equal"], (case, rank)
        assert r["next_step"] < 1e-5, (case, rank, r["next_step"])  # training continues as it would have


def test_every_process_writes_its_own_shards_listed_in_the_manifest(runs):
    main = runs["saved"][0]
    shard_files = [f for f in main["on_disk"] if f.startswith("sharded.")]
    assert shard_files and set(shard_files) <= set(main["manifest_files"]), main
    # Orbax: each process writes its own folder of shard data
    for process in (0, 1):
        assert any(f"ocdbt.process_{process}/" in f for f in shard_files), shard_files
    # no process wrote the split arrays whole: the main process's model file holds only the unsplit bias
    assert main["model_file_tensors"] == ["model_0/last/bias"], main["model_file_tensors"]


def test_an_async_sharded_save_returns_before_its_commit_and_keeps_the_values_of_the_call(runs):
    for rank, r in enumerate(runs["async"]):
        # it returned with nothing committed: the write (held until the test let it go) was not waited for
        assert r["at_return"] == {"committed": False, "write_returned": False}, (rank, r)
        assert r["gate_opened"] is True and r["write_thread"] != "MainThread", (rank, r)
        assert r["returned_in"] < 20 and r["committed"], (rank, r)
        # a training step right after the call did not reach the checkpoint
        assert r["moved"] > 1e-3, (rank, r)
        assert r["params_equal"] and r["optimizer_equal"], (rank, r)


def test_an_async_sharded_save_failing_on_one_process_fails_everywhere_and_commits_nothing(runs):
    for rank, r in enumerate(runs["async"]):
        assert r["failure"] and "injected" in r["failure"] and "process 1" in r["failure"], (rank, r)
        assert r["failure_leftovers"] == [], (rank, r)  # neither the checkpoint nor its temporary folder
        assert r["untouched_by_failure"], (rank, r)


def test_damaged_shard_files_are_refused_with_nothing_restored(runs):
    for rank, outcome in enumerate(runs["damaged"]):
        assert set(outcome) == {"flipped_byte", "missing_shard", "other_checkpoint"}, outcome
        for case, r in outcome.items():
            assert r["raised"] == "CheckpointError", (rank, case, r)
            assert r["untouched"], (rank, case)
            assert r["culprit"] in r["message"], (rank, case, r["message"])


def test_save_model_writes_one_consolidated_file(runs):
    main = runs["saved"][0]
    assert main["exported"].endswith("model.safetensors")
    assert main["export_equal"] is True
