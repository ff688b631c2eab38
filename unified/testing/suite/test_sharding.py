"""Conformance: sharded state (``Accelerator(fsdp_plugin=...)``) in real process groups, on every
backend with ShardedTraining, through its kit's ``sharded`` setup: parameters really split over
the processes, training equal to the replicated run (also with bf16 and gradient accumulation),
each process writing only its own shards and no pickle written or loaded, a checkpoint written by
N processes loading on M (2 -> 3, 2 -> 1, 3 -> 2), damaged shards refused with nothing restored, a
consolidated save_model, an async sharded save written in the background that fails on every
process when one process fails, a save killed mid-write leaving the previous checkpoint, and
sharded state on an object store (moto's S3 server on loopback, when installed), a save there
killed before its manifest included."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from ...runtime.environment import RUN_VARIABLE
from ..harness import run_group
from ..object_store import missing_store_packages, s3_server
from ..scenario import missing_requirements
from ..sharded_store_scenarios import shard_damaged, shard_store_load_from_2, shard_store_round_trip
from ..sharding_scenarios import (
    OPTIMIZER_FIRST,
    shard_async_save,
    shard_killed_mid_save,
    shard_load_from_2,
    shard_load_from_3,
    shard_mixed_precision_and_accumulation,
    shard_resume_after_kill,
    shard_store_killed_mid_save,
    shard_store_resume_after_kill,
    shard_train_and_save,
)
from ..storage_scenarios import STORE_VARIABLE

pytestmark = pytest.mark.multiprocess
DEADLINE = 300.0


@pytest.fixture(scope="module")
def runs(backend, tmp_path_factory):
    """Four groups (five with an object store). ``first`` (2): train and save, bf16 and
    accumulation, async saves, then a save killed mid-write (the parent kills the group); with a
    store, a second group of 2 whose save to the store is killed the same way. ``three`` (3,
    preparing the optimizer first): train and save, load 2 -> 3, damaged copies of the 2-process
    checkpoint, the store's killed job restarted. ``one``: load 2 -> 1.
    ``back`` (2): resume after the kill, load 3 -> 2, damaged copies again (each process reading
    its own files whole)."""
    lacking = missing_requirements(backend, [shard_train_and_save])
    if lacking:  # every group starts from the checkpoints this one saves: start none
        pytest.skip(lacking["shard_train_and_save"])
    shared = tmp_path_factory.mktemp(f"sharded-{backend}")
    with contextlib.ExitStack() as stack:  # the object store, where its packages are installed
        store = {} if missing_store_packages() else {STORE_VARIABLE: stack.enter_context(s3_server()).bucket()}
        first = run_group(backend, 2, [shard_train_and_save, shard_mixed_precision_and_accumulation, shard_async_save,
                                       shard_store_round_trip, shard_killed_mid_save], shared, deadline=DEADLINE,
                          kill_when=shared / "kill_now", kill_delay=0.2, extra_env=store)
        first.scenario(shard_train_and_save)  # the later groups load its checkpoints: its logs if it failed
        if store:  # a sharded save to the store killed before its manifest; the job restarted as ``three``
            store[RUN_VARIABLE] = f"sharded-store-kill-{backend}"  # the restart takes the killed run's lease over
            run_group(backend, 2, [shard_store_killed_mid_save], shared, deadline=DEADLINE,
                      kill_when=shared / "store_kill_now", kill_delay=0.2, extra_env=store)
        three = run_group(backend, 3, [shard_train_and_save, shard_load_from_2, shard_damaged, shard_store_load_from_2,
                                       shard_store_resume_after_kill],
                          shared, deadline=DEADLINE, extra_env={OPTIMIZER_FIRST: "1", **store}).ok()
    one = run_group(backend, 1, [shard_load_from_2], shared, deadline=DEADLINE).ok()
    back = run_group(backend, 2, [shard_resume_after_kill, shard_load_from_3, shard_damaged], shared,
                     deadline=DEADLINE).ok()
    return SimpleNamespace(first=first, three=three, one=one, back=back)


# what the tests read, by case: (group, scenario)
SAVES = {"on_2": ("first", shard_train_and_save), "on_3": ("three", shard_train_and_save)}
LOADS = {"2to3": ("three", shard_load_from_2), "2to1": ("one", shard_load_from_2), "3to2": ("back", shard_load_from_3)}
DAMAGED = {"on_2": ("back", shard_damaged), "on_3": ("three", shard_damaged)}


def _read(runs, where):
    group, function = where
    return getattr(runs, group).scenario(function)


def _split(layout):
    return {name for name, (_, replicated) in layout["placements"].items() if not replicated}


def test_parameters_are_split_over_the_processes(runs):
    for case, where in SAVES.items():
        for r in _read(runs, where):
            # the placements (and units of sharding) the backend's setup expects of its model
            assert r["layout"] == r["expected_layout"], (case, r["layout"])
            assert _split(r["layout"]), (case, r["layout"])  # something is really split
            assert r["layout_after_training"] == r["layout"], case  # training keeps the placement
    for case in ("2to3", "3to2"):
        for r in _read(runs, LOADS[case]):
            assert r["layout"] == r["expected_layout"] and _split(r["layout"]), (case, r["layout"])


def test_sharded_training_matches_the_replicated_run(runs):
    for case, where in SAVES.items():
        for r in _read(runs, where):
            assert r["initial_equal"], case
            assert r["params_vs_replicated"] < 1e-5 and r["optimizer_vs_replicated"] < 1e-5, (case, r)
            assert r["norms"] == 3 and r["norms_vs_replicated"] < 1e-5, (case, r)  # clip_grad_norm_: the global norm


@pytest.mark.parametrize("case", ["bf16", "accumulation", "bf16_accumulation"])
def test_bf16_and_gradient_accumulation_on_sharded_state(runs, case):
    for r in runs.first.scenario(shard_mixed_precision_and_accumulation):
        loop = r[case]
        assert loop["steps"] == 3, loop  # one optimizer step per window of micro-batches
        assert loop["moved"] > 1e-3, loop  # the steps changed the parameters
        assert loop["params"] < (2e-2 if loop["bf16"] else 1e-5), loop
        assert loop["norms"] < (5e-2 if loop["bf16"] else 1e-4), loop
        assert loop["dtypes"] == ["float32"], loop  # parameters stay float32
        assert _split(loop["layout"]), loop


def test_every_process_writes_only_its_own_shards_and_no_pickle(runs):
    for (case, where), n in zip(SAVES.items(), (2, 3)):
        main = _read(runs, where)[0]
        files = main["checkpoint"]
        owners = files["shard_files"]
        # every process wrote files of its own shards, every one listed in the manifest
        assert {owner for owner in owners.values() if owner is not None} == set(range(n)), (case, owners)
        assert set(owners) <= set(files["manifest_files"]), (case, owners, files["manifest_files"])
        assert files["pickles"] == [], (case, files)  # nothing in the checkpoint is a pickle
        # no process wrote the split arrays whole: the model's own file holds only the unsplit parameters
        whole = {f"model_0/{name}" for name, (_, replicated) in main["layout"]["placements"].items() if replicated}
        assert set(files["model_file_tensors"]) == whole, (case, files["model_file_tensors"])


def test_save_model_writes_one_consolidated_safetensors_file(runs):
    for case, where in SAVES.items():
        export = _read(runs, where)[0]["export"]
        assert export["files"] == ["model.safetensors"], (case, export)
        assert export["equal"] is True, (case, export)
        assert export["metadata"] == export["expected_metadata"], (case, export)  # e.g. transformers' {"format": "pt"}


@pytest.mark.parametrize("case", sorted(LOADS))
def test_a_sharded_checkpoint_loads_on_another_number_of_processes(runs, case):
    for rank, r in enumerate(_read(runs, LOADS[case])):
        assert r["changed_by_load"], (case, rank)
        assert r["params_equal"] and r["optimizer_equal"], (case, rank)
        assert r["next_step"] < 1e-5 and r["finite"], (case, rank, r["next_step"])  # training goes on as it would have


@pytest.mark.parametrize("case", sorted(LOADS) + [f"damaged_{case}" for case in sorted(DAMAGED)])
def test_loading_sharded_state_never_unpickles_not_even_between_processes(runs, case):
    """No pickle on the load path, the framework's own collectives included (the setup names
    where they keep their Unpickler): every load, good or refused, counted none on any process."""
    for r in _read(runs, LOADS[case] if case in LOADS else DAMAGED[case[len("damaged_"):]]):
        assert r["unpickled"] == [], r["unpickled"][:5]


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_shards_are_refused_and_nothing_is_restored_when_verified_first(runs, case):
    for rank, outcome in enumerate(_read(runs, DAMAGED[case])):
        cases = outcome["cases"]
        assert set(cases) == {"flipped_byte", "missing_shard", "foreign_shard", "other_checkpoint"}, cases
        for name, r in cases.items():
            for tried in (r, r["verify_first"]):
                assert tried["raised"] == "CheckpointError", (rank, name, tried)
                assert tried["culprit"] in tried["message"], (rank, name, tried["message"])
            assert r["verify_first"]["untouched"], (rank, name, "verify_first restored part of a damaged checkpoint")
            # one pass: only damage in the bytes read into place is found once objects changed
            assert r["untouched"] or "was read into place" in r["message"], (rank, name, r["message"])
            if "was read into place" in r["message"]:  # (a shard of another checkpoint whose header fits, too)
                assert "#damaged-while-placed" in r["message"], (rank, name, r["message"])
        assert "checksum" in cases["flipped_byte"]["message"] or "xxh3" in cases["flipped_byte"]["message"], cases
        if outcome["read_apart"]:  # a read that failed on the last process only reached every process at once
            assert outcome["one_failed"] and "injected read failure" in outcome["one_failed"], (rank, outcome)
            assert outcome["one_failed_s"] < 30 and outcome["untouched_by_one_failed"], (rank, outcome)


def test_an_async_sharded_save_writes_in_the_background_and_keeps_the_values_of_the_call(runs):
    for rank, r in enumerate(runs.first.scenario(shard_async_save)):
        # it returned with nothing committed: the write (held until the scenario let it go) was not waited for
        assert r["at_return"] == {"committed": False, "write_returned": False}, (rank, r)
        if r["writes_wait_for_result"]:  # the backend writes no shard file before the held write runs
            assert r["files_at_return"] == [], (rank, r)
        assert r["gate_opened"] is True and r["write_thread"] != "MainThread", (rank, r)
        assert r["returned_in"] < 20 and r["committed"], (rank, r)
        assert {owner for owner in r["shard_files"].values() if owner is not None} == {0, 1}, (rank, r)
        # parameters changed in place and a training step right after the call (which did not wait
        # for the held write: the gate was opened after it) did not reach the checkpoint
        assert r["edit_moved"] > 0.9 and r["step_moved_optimizer"] > 0, (rank, r)
        assert r["params_equal"] and r["optimizer_equal"], (rank, r)
        # a folder's load too: an array the reader deferred is made once, when put in place
        assert r["deferred"]["made"] == [1] * r["deferred"]["returned"], (rank, r["deferred"])
        # its files changed while the arrays were put in place (after every check passed): every
        # process says the objects hold part of the checkpoint, and a load again is the way out
        changing = r["changing"]
        assert changing["made"] >= 1 and changing["reloaded"], (rank, changing)
        assert changing["error"] and "#changed-while-placed" in changing["error"], (rank, changing)
    # the process that changed them had put an array in place already (another may see it sooner)
    assert max(r["changing"]["made"] for r in runs.first.scenario(shard_async_save)) >= 2


def test_an_async_sharded_save_failing_on_one_process_fails_everywhere_and_commits_nothing(runs):
    for rank, r in enumerate(runs.first.scenario(shard_async_save)):
        assert r["failure"] and "injected" in r["failure"] and "process 1" in r["failure"], (rank, r)
        assert r["failure_leftovers"] == [], (rank, r)  # neither the checkpoint nor its temporary folder
        assert r["untouched_by_failure"], (rank, r)


def test_a_save_killed_while_writing_shards_leaves_the_previous_checkpoint(runs):
    killed = runs.first
    assert killed.result(0, shard_killed_mid_save) is None, killed.show_logs()  # it never finished
    assert all(rc == -9 for rc in killed.returncodes), killed.show_logs()
    for r in runs.back.scenario(shard_resume_after_kill):
        assert r["loaded"] == "checkpoint_0", r
        assert r["params_equal"] and r["optimizer_equal"], r
        # the killed save never became a checkpoint (its temporary folder goes at the next save)
        assert [name for name in r["listing"] if not name.startswith(".")] == ["checkpoint_0"], r


def test_sharded_state_on_an_object_store_saves_every_process_s_own_objects_and_loads_exactly(runs):
    rows = runs.first.scenario(shard_store_round_trip)
    if not rows[0]["ran"]:
        pytest.skip(missing_store_packages())
    for r in rows:
        if not r["supported"]:  # a backend without sharded_to_store: refused everywhere, nothing written
            assert "to a folder only" in r["refused"] and "#object-storage-limits" in r["refused"]
            assert not r["left"]
            continue
        assert r["sync_params"] and r["sync_optimizer"]
        assert r["async_params"] and r["async_optimizer"]  # the state of the call, not of the step after it
        # an array the reader deferred is made once, when the load puts it in place (made for every
        # object it was: a second copy of the process's shard at the peak)
        assert r["deferred"]["made"] == [1] * r["deferred"]["returned"]
        _assert_refused(r["damaged"])  # a shard object read whole (the same process count)
    main = rows[0]
    if main["supported"]:
        assert main["owners"] == [0, 1]  # every process wrote its own shard objects
        # every object listed, nothing else
        assert main["objects"] == sorted(main["manifest_files"] + ["manifest.json"])


def test_a_sharded_checkpoint_on_a_store_loads_on_another_number_of_processes(runs):
    rows = runs.three.scenario(shard_store_load_from_2)
    if not rows[0]["ran"]:
        pytest.skip("no sharded checkpoint on the store (no object store, or the backend saves sharded state to "
                    "folders)")
    for r in rows:
        assert r["params_equal"] and r["optimizer_equal"] and r["changed_by_load"]
        assert r["unpickled"] == []
        assert r["next_step"] < 1e-6 and r["finite"]
        _assert_refused(r["damaged"])  # read in slices by some processes, hashed after the read


def test_a_sharded_save_to_a_store_killed_before_its_manifest_is_no_checkpoint_and_the_next_save_removes_it(runs):
    rows = runs.three.scenario(shard_store_resume_after_kill)
    if not rows[0]["ran"]:
        pytest.skip("no object store, or the backend saves sharded state to folders")
    for r in rows:  # the restarted job, on 3 processes
        assert "checkpoint_1" in r["before"], r  # the killed save had uploaded objects...
        assert r["loaded"] == "checkpoint_0", r  # ...but without its manifest it is no checkpoint
        assert r["params_equal"] and r["optimizer_equal"], r
    main = rows[0]
    assert main["saved"] in main["committed"] and main["after"] == main["committed"], main  # nothing uncommitted left


def _assert_refused(damaged):
    """A shard object with a flipped byte: every process raised naming it; verified first, with
    nothing restored; in one pass, with nothing restored or saying the objects hold part of it."""
    for tried in (damaged, damaged["verify_first"]):
        assert tried["message"] is not None and tried["object"] in tried["message"], tried
        assert "checksum mismatch" in tried["message"], tried
    assert damaged["verify_first"]["untouched"], damaged
    assert damaged["untouched"] or "#damaged-while-placed" in damaged["message"], damaged
