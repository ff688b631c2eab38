"""Conformance: checkpoints in object storage (an S3-compatible server the test starts on
loopback), in real groups of 2 and 3 processes: every process writes its own files to the
store, the manifest written last commits, retention has run when save_state returns, the
newest checkpoint loads back exactly, and a URL that holds a checkpoint is never overwritten."""
from __future__ import annotations

import pytest

from ..harness import run_group
from ..object_store import missing_store_packages, s3_server
from ..storage_scenarios import STORE_VARIABLE, store_checkpoints

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=[2, 3], ids=["2-processes", "3-processes"])
def stored(request, backend, tmp_path_factory):
    missing = missing_store_packages()
    if missing:
        pytest.skip(missing)
    with s3_server() as server:
        return run_group(backend, request.param, [store_checkpoints], tmp_path_factory.mktemp(f"store-{backend}"),
                         extra_env={STORE_VARIABLE: server.bucket()})


def test_checkpoints_in_object_storage_save_retain_and_load_exactly(stored):
    rows = stored.scenario(store_checkpoints)
    main = rows[0]
    assert main["listing"] == ["checkpoint_1", "checkpoint_2"]  # total_limit=2, applied before save_state returned
    for r in rows:
        assert r["saved"] == main["saved"] and r["saved"][-1].endswith("/run/checkpoints/checkpoint_2")
        assert r["loaded"] == r["saved"][-1]
        assert r["hash_loaded"] == r["hashes"][-1] == main["hashes"][-1]  # replicated state, as saved
        assert r["draws_after_load"] == r["draws_after_save"]  # every generator of every process
        assert r["iteration"] == 3
        assert r["hash_explicit_loaded"] == r["hash_explicit"]


def test_a_url_that_holds_a_checkpoint_is_refused_on_every_process_and_stays_loadable(stored):
    for r in stored.scenario(store_checkpoints):
        assert r["refused"] is not None and "cannot replace one atomically" in r["refused"]
        assert r["hash_after_refusal"] == r["hash_explicit"]


def test_a_store_out_of_reach_on_one_process_fails_the_save_on_every_process_and_commits_nothing(stored):
    rows = stored.scenario(store_checkpoints)
    last = len(rows) - 1
    assert rows[0]["unreachable_committed"] is False
    for rank, r in enumerate(rows):
        # every process raised (none waited for the failing one), naming that process's object
        assert r["unreachable_error"] is not None and "failed and was not committed" in r["unreachable_error"]
        assert f"process {last}" in r["unreachable_error"] and "out-of-reach/" in r["unreachable_error"]
        assert "after the storage client's retries" in r["unreachable_error"]
        if rank != last:
            assert r["unreachable_injected"] == 0  # its requests went straight to the store
        assert r["hash_after_unreachable"] == r["hash_before_unreachable"] == r["hash_explicit"]
    assert rows[last]["unreachable_injected"] >= 2  # the client retried before it gave up


def test_an_async_save_to_a_store_commits_the_state_of_the_save(stored):
    for r in stored.scenario(store_checkpoints):
        assert r["async_hash_stepped"] != r["async_hash_saved"]  # the step during the upload changed the state
        assert r["async_hash_loaded"] == r["async_hash_saved"]


def test_save_state_hook_files_go_to_the_store_and_come_back_verified_to_the_load_hooks(stored):
    rows = stored.scenario(store_checkpoints)
    assert rows[0]["hook_manifests"] == [["hook.json", "sub/extra.bin"]] * 2
    for r in rows:
        hooks = r["hooks"]
        assert hooks["saves"] == 2 and hooks["save_dirs_local"] == [True, True]  # a local folder to open() into
        assert [load["hook"] for load in hooks["loads"]] == [{"saves": 1}, {"saves": 2}]  # the main process's files
        assert all(load["extra"] == 1 << 20 and load["local"] for load in hooks["loads"])
        assert all(hooks["load_folders_removed"])
        # changed on the store after the commit: refused on every process before any hook ran
        assert r["changed_hook_error"] is not None and "hook.json" in r["changed_hook_error"]
        assert r["hooks_after_change"] == 0
