"""Conformance: save_state / load_state on every backend, in real 2-process groups."""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil

import pytest

from ..checkpoint_scenarios import (
    ckpt_async_edits,
    ckpt_async_part_failures,
    ckpt_commit_failures,
    ckpt_damaged,
    ckpt_explicit_dir,
    ckpt_first_run,
    ckpt_load_newest,
    ckpt_mismatch,
    ckpt_resume_run,
    ckpt_save_for_damage,
    ckpt_save_loop,
    ckpt_sharded,
    ckpt_snapshot_failure,
)
from ..harness import Runs, run_group
from ..kit import backend_class
from ..own_folder_scenarios import ckpt_own_folders
from ..scenarios import start

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def resumed(backend, tmp_path_factory):
    """First group trains and saves; a brand-new group loads and finishes the run."""
    shared = tmp_path_factory.mktemp(f"resume-{backend}")
    first = run_group(backend, 2, [ckpt_first_run], shared).ok()
    second = run_group(backend, 2, [ckpt_resume_run], shared).ok()
    explicit = run_group(backend, 2, [ckpt_explicit_dir, ckpt_snapshot_failure, ckpt_async_edits,
                                          ckpt_mismatch, ckpt_commit_failures, ckpt_async_part_failures,
                                          ckpt_own_folders],
                             shared).ok()
    return Runs(first, second, explicit)


def test_resume_is_bit_identical_to_an_uninterrupted_run(resumed):
    first, second = resumed.scenario(ckpt_first_run), resumed.scenario(ckpt_resume_run)
    for a, b in zip(first, second):
        assert b["hash_at_load"] == a["hashes"]["at_save"]
        assert b["final_hash"] == a["final_hash"]
    assert len({r["final_hash"] for r in second}) == 1  # replicated state agrees across processes


def test_every_rng_resumes_where_it_was_saved(resumed):
    first, second = resumed.scenario(ckpt_first_run), resumed.scenario(ckpt_resume_run)
    for rank, (a, b) in enumerate(zip(first, second)):
        assert b["draws"] == a["after_save_draws"], f"process {rank}"
    assert first[0]["after_save_draws"] != first[1]["after_save_draws"]  # per-process streams differ


def test_automatic_naming_retention_and_iteration(resumed):
    first, second = resumed.scenario(ckpt_first_run), resumed.scenario(ckpt_resume_run)
    main = first[0]
    assert main["saved"].endswith(os.path.join("checkpoints", "checkpoint_0"))
    assert [os.path.basename(p) for p in main["more"]] == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert main["listing"] == ["checkpoint_2", "checkpoint_3"]  # total_limit=2, applied when save_state returned
    assert main["project"] == ["checkpoints"]  # no lock file or other entry of ours
    assert main["iteration"] == 4
    # Loading checkpoint_0 explicitly still puts the counter past the newest in the folder.
    resumed_main = second[0]
    assert resumed_main["iteration_after_load"] == 4
    assert os.path.basename(resumed_main["next_save"]) == "checkpoint_4"
    assert resumed_main["iteration_after_newest"] == 5
    assert resumed_main["steps"] == 9


def test_saving_into_an_existing_directory_replaces_it_whole(resumed):
    explicit = resumed.scenario(ckpt_explicit_dir)
    for r in explicit:
        assert r["hash_loaded"] == r["hash_second"]
        assert [s for s in r["siblings"] if s.startswith(".")] == []  # no temporaries left behind
        assert "manifest.json" in r["files"]
        # Accelerate's save/load-state hooks: the save hook's file is committed with the checkpoint
        assert "hook.json" in r["files"] and r["hooks"]["save"][0] == r["hooks"]["save"][1] >= 1
        assert r["hooks"]["load"] == r["hooks"]["save"][0]


def test_a_failed_snapshot_fails_save_state_everywhere_with_the_reason(resumed):
    main, other = resumed.scenario(ckpt_snapshot_failure)
    assert main["raised"] == "CheckpointError" and "cannot save custom_checkpoint_0" in main["message"], main
    assert other["raised"] == "CheckpointError", other
    assert other["message"].startswith("save_state failed on another process before writing anything"), other
    assert "process 0: " in other["message"] and "cannot save custom_checkpoint_0" in other["message"], other
    assert not main["written"] and not other["written"]


def test_async_save_commits_the_state_of_the_call_or_fails_loudly(resumed):
    """In-place edits while an async save writes (total_limit=1): a committed checkpoint always
    loads and holds the state at save_state(); a save that could not hold it raises at
    wait_for_checkpoint with nothing committed, and the previous checkpoint loads."""
    for rank, outcome in enumerate(resumed.scenario(ckpt_async_edits)):
        for case, r in outcome.items():
            assert r["held"], (rank, case, "the writer was not held: the edit did not race the write")
            assert r["load_error"] is None, (rank, case, r["load_error"])
            expected = "previous" if r["raised"] else "at_call"
            assert r["live"] == expected, (rank, case, r)  # NumPy arrays of registered objects are copied
            if case == "tracked_edit_before_write":  # version-tracked edits are detected
                assert r["params"] == expected, (rank, case, r)
                if r["raised"]:
                    assert "changed in place" in r["raised"] and "not committed" in r["raised"], r["raised"]
            # An edit through .data is invisible to torch's version counters: the checkpoint may
            # hold some of it (documented), but its checksums match its bytes, so it loads.


def test_a_model_of_another_dtype_or_shape_is_refused_before_anything_is_restored(resumed):
    outcomes = resumed.scenario(ckpt_mismatch)
    for rank, outcome in enumerate(outcomes):
        for change, r in outcome.items():
            assert r["raised"] == "CheckpointError", (rank, change, r)
            assert r["untouched"], (rank, change, "the model changed although the load failed")
            assert "model_0.safetensors" in r["message"] and "tensor" in r["message"], r["message"]
            assert r["elapsed"] < 30, (rank, change, r["elapsed"])  # promptly, not after the 60 s timeout
        assert "in the checkpoint; this run's model_0 has" in outcome["dtype"]["message"]
        if rank == len(outcomes) - 1:  # the process whose model differs names both shapes
            assert "in the checkpoint; this run's model_0 has" in outcome["shape"]["message"]
        else:  # the others learn it from that process
            assert "process 1" in outcome["shape"]["message"], outcome["shape"]["message"]


def test_an_interrupted_commit_is_repaired_once_and_a_failed_commit_reaches_everyone(resumed):
    for rank, outcome in enumerate(resumed.scenario(ckpt_commit_failures)):
        for case in ("project_dir", "explicit"):  # the set-aside checkpoint is put back and loads
            assert outcome[case] == {"raised": None, "restored": True}, (rank, case, outcome[case])
        commit = outcome["commit"]
        assert commit["raised"] == "CheckpointError", (rank, commit)
        assert "failed while committing" in commit["message"] and "No space left" in commit["message"], commit
        assert commit["elapsed"] < 30, (rank, commit)  # at once, not after the 60 s timeout
        assert commit["left"] == [], (rank, commit)  # no temporary directory, no checkpoint


def test_an_async_save_that_a_process_cannot_write_fails_everywhere_at_once(resumed):
    outcomes = resumed.scenario(ckpt_async_part_failures)  # needs a health channel to tell the main process
    last = len(outcomes) - 1
    for rank, outcome in enumerate(outcomes):
        for case in ("full_disk", "marker"):
            r = outcome[case]
            assert r["raised"] == "CheckpointError", (rank, case, r)
            assert "No space left" in r["message"] and f"process {last}" in r["message"], (rank, case, r["message"])
            assert r["elapsed"] < 30, (rank, case, r)  # at once, not after the 60 s timeout
            assert r["left"] == [], (rank, case, r)  # no temporary directory, no checkpoint
        assert "part marker" in outcome["marker"]["message"], outcome["marker"]["message"]
        assert outcome["saved_after"], rank


def test_processes_that_save_to_folders_of_their_own_resume_exactly(resumed):
    """Issue 50: each process names a folder of its own (machines without a shared file system).
    Each folder is committed with a manifest of its own and holds what its process resumes from;
    the resume is exact; damage in another process's folder and folders of two saves are refused
    everywhere; automatic naming numbers, retains and loads every folder alike (async saves too)."""
    outcomes = resumed.scenario(ckpt_own_folders)
    assert outcomes[0]["final_hash"] == outcomes[1]["final_hash"]  # replicated state agrees across processes
    assert outcomes[0]["rows_after"] != outcomes[1]["rows_after"]  # each process resumes its own share of the data
    for rank, r in enumerate(outcomes):
        assert os.path.basename(r["saved"]).startswith(f"own-{rank}-") and r["loaded"] == r["saved"], r
        assert r["hash_at_load"] == r["hash_at_save"] and r["resumed_final_hash"] == r["final_hash"], rank
        assert r["resumed_draws"] == r["after_save_draws"], rank  # every generator of this process
        assert r["resumed_rows"] == r["rows_after"], rank  # the data position
        listing = r["listing"]
        assert [n for n in listing if n.startswith("rng_")] == [f"rng_{rank}.safetensors"], listing
        assert {"manifest.json", "model_0.safetensors", "optimizer_0.safetensors", "dataloader_0.safetensors"} \
            <= set(listing), listing
        assert r["manifest"] == {"files": [n for n in listing if n != "manifest.json"], "num_processes": 2}, r
        assert r["siblings"] == [], r  # no temporary directory left beside the folder
        damaged = r["damaged"]
        assert damaged["raised"] == "CheckpointError" and damaged["untouched"], (rank, damaged)
        assert "rng_1.safetensors: checksum mismatch" in damaged["message"], damaged["message"]
        mixed = r["mixed"]
        assert mixed["raised"] == "CheckpointError" and mixed["untouched"], (rank, mixed)
        assert "hold different saves" in mixed["message"], mixed["message"]
        assert r["automatic"] == {
            "saves": ["checkpoint_0", "checkpoint_1", "checkpoint_2"], "listing": ["checkpoint_1", "checkpoint_2"],
            "newest": "checkpoint_2", "restored": True, "iteration": 3, "asynchronous": "checkpoint_3",
            "listing_after_async": ["checkpoint_2", "checkpoint_3"]}, (rank, r["automatic"])


def test_crash_during_save_never_leaves_a_loadable_partial_checkpoint(backend, tmp_path):
    rng = random.Random(f"{backend}-1234")
    for trial in range(1):  # a random kill moment, another per backend; `python -m tests.faults` runs 20 trials
        shared = tmp_path / f"trial{trial}"
        shared.mkdir()
        crashed = run_group(backend, 2, [start, ckpt_save_loop], shared,
                            kill_when=shared / "ready", kill_delay=rng.uniform(1.5, 4.0), deadline=90)
        assert all(rc == -9 for rc in crashed.returncodes), crashed.show_logs()
        expected = {}
        for line in (shared / "expected.jsonl").read_text().splitlines():
            if line.strip().endswith("}"):
                row = json.loads(line)
                expected[row["iteration"]] = row["hash"]
        loaded = run_group(backend, 2, [ckpt_load_newest], shared).ok()
        rows = loaded.scenario(ckpt_load_newest)
        assert rows[0]["hash"] == expected[rows[0]["iteration"]], (
            f"trial {trial}: loaded state differs from what was saved")
        assert rows[0]["hash"] == rows[1]["hash"]
        assert rows[0]["leftovers"] == [], "temporaries of the crashed save must not remain after a new save"


class Payload:
    def __reduce__(self):
        return (open, (os.environ.get("UNIFIED_TEST_SHARED", "/tmp") + "/PWNED", "w"))


def _rewrite_manifest(directory, edit):
    """Apply ``edit`` to the manifest and re-sign it, as an attacker who knows the format could."""
    from unified.checkpoint.manifest import _digest

    path = directory / "manifest.json"
    doc = json.loads(path.read_text())
    doc.pop("manifest_xxh3")
    edit(doc)
    doc["manifest_xxh3"] = _digest(doc)
    path.write_text(json.dumps(doc))


def _damage(pristine, root):
    """Copies of a good checkpoint, each damaged one way: case -> (directory, file to be named)."""
    cases = {}

    def copy(name, culprit):
        target = root / name
        shutil.copytree(pristine, target)
        cases[name] = culprit
        return target

    for case, victim, at in (("flipped_byte", "model_0.safetensors", -1),  # in the last array's bytes
                             ("flipped_header", "model_0.safetensors", 20),  # inside the header (which is read first)
                             ("flipped_rng", "rng_1.safetensors", None)):
        f = copy(case, victim) / victim
        data = bytearray(f.read_bytes())
        data[len(data) // 2 if at is None else at] ^= 0xFF
        f.write_bytes(bytes(data))
    f = copy("truncated", "optimizer_0.safetensors") / "optimizer_0.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    (copy("deleted_file", "model_0.safetensors") / "model_0.safetensors").unlink()
    (copy("no_manifest", "manifest.json") / "manifest.json").unlink()
    m = copy("edited_manifest", "manifest.json") / "manifest.json"
    doc = json.loads(m.read_text())
    doc["iteration"] = 99
    m.write_text(json.dumps(doc))
    _rewrite_manifest(copy("wrong_backend", "manifest.json"),
                      lambda d: d.update(backend="jax" if d["backend"] == "torch" else "torch"))
    # A file from another checkpoint: same name, other content.
    other = copy("swapped_file", "model_0.safetensors")
    (other / "model_0.safetensors").write_bytes((pristine / "optimizer_0.safetensors").read_bytes())
    # Hostile: a symlink to a file outside, a path escaping the directory, a huge declared size.
    d = copy("symlink_outside", "model_0.safetensors")
    secret = root / "outside.bin"
    secret.write_bytes((pristine / "model_0.safetensors").read_bytes())
    (d / "model_0.safetensors").unlink()
    (d / "model_0.safetensors").symlink_to(secret)

    def escape(doc):
        doc["files"]["../outside.bin"] = doc["files"].pop("model_0.safetensors")
    _rewrite_manifest(copy("dotdot_path", "../outside.bin"), escape)
    _rewrite_manifest(copy("huge_size", "model_0.safetensors"),
                      lambda doc: doc["files"]["model_0.safetensors"].update(size=10**15))
    # Accelerate's file names with pickle payloads, beside a valid manifest: never read.
    d = copy("pickle_payloads", None)
    for name in ("optimizer.bin", "random_states_0.pkl", "scheduler.bin", "pytorch_model.bin"):
        (d / name).write_bytes(pickle.dumps(Payload()))
    # The same payloads with no manifest at all (an Accelerate checkpoint): refused.
    d = root / "accelerate_style"
    d.mkdir()
    for name in ("optimizer.bin", "random_states_0.pkl", "model.safetensors"):
        (d / name).write_bytes(pickle.dumps(Payload()))
    cases["accelerate_style"] = "manifest.json"
    return cases


def test_damaged_or_hostile_checkpoints_raise_checkpoint_error(backend, tmp_path):
    run_group(backend, 2, [ckpt_save_for_damage], tmp_path).ok()
    cases = _damage(tmp_path / "pristine", tmp_path / "damaged")
    group = run_group(backend, 2, [ckpt_damaged], tmp_path).ok()
    for rank, outcome in enumerate(group.scenario(ckpt_damaged)):
        assert outcome.pop("__pwned__") is False, "a pickle payload was executed"
        _assert_fell_back(rank, outcome.pop("__fallback__"))
        assert outcome["pickle_payloads"]["raised"] is None  # valid checkpoint; the extra files are ignored
        assert outcome.pop("__restored_whole__"), (rank, "a load after one that failed while placing restored part")
        for case, culprit in cases.items():
            if culprit is None:
                continue
            result, verified_first = outcome[case], outcome[case]["verify_first"]
            for r in (result, verified_first):
                assert r["raised"] == "CheckpointError", (rank, case, r)
                assert culprit in r["message"], (rank, case, r["message"])
            assert verified_first["untouched"], (rank, case, "verify_first restored something from a damaged one")
            # one pass: only damage in the bytes of an array read into place (where the backend reads
            # arrays into place: torch, JAX) is found once objects changed, and then says so
            found_while_placed = "was read into place" in result["message"]
            assert not found_while_placed or case == "flipped_byte", (rank, case, result["message"])
            assert result["untouched"] or found_while_placed, (rank, case)
        if "was read into place" in outcome["flipped_byte"]["message"]:
            assert "found while model_0 was read into place" in outcome["flipped_byte"]["message"]
            assert "#damaged-while-placed" in outcome["flipped_byte"]["message"]
        assert "checksum" in outcome["flipped_byte"]["message"]
        assert "checksum" in outcome["flipped_header"]["message"]  # damage, not an invalid file
        assert "checksum" in outcome["flipped_rng"]["message"]  # process 0 learns process 1's error
        assert "truncated" in outcome["truncated"]["message"]
        assert "modified" in outcome["edited_manifest"]["message"]
        assert "refusing file name" in outcome["dotdot_path"]["message"]
    assert not (tmp_path / "PWNED").exists()


def _assert_fell_back(rank, r):
    """Automatic naming with a damaged newest checkpoint (issue 46; scenarios._damaged_newest):
    only process 1 verified the damaged file, and every process went on to checkpoint_0 alike;
    the main process alone warned; then, every checkpoint damaged, every process raised."""
    assert r["loaded"] == "checkpoint_0" and r["restored"], (rank, r)
    assert r["next"] == "checkpoint_2", (rank, r)  # the damaged one's number is never reused
    assert r["listing"] == ["checkpoint_0", "checkpoint_1.damaged", "checkpoint_2"], (rank, r)
    assert r["past_placed"] == "checkpoint_2" and r["past_placed_restored"], (rank, r)
    assert r["listing_after"] == ["checkpoint_0.damaged", "checkpoint_1.damaged", "checkpoint_2.damaged",
                                  "checkpoint_3.damaged"], (rank, r)
    message = r["none_verifies"]
    assert message is not None and r["untouched"], (rank, r)
    assert all(f"checkpoint_{n}" in message for n in range(4)) and "#no-checkpoint-verifies" in message, message
    if rank == 0:
        first, placed, *others = r["warned"]
        assert "checkpoint_1" in first and "process 1:" in first and "rng_1.safetensors" in first, first
        assert "checksum mismatch" in first and "checkpoint_1.damaged" in first, first
        assert "checkpoint_3.damaged" in placed and "model_0.safetensors: checksum mismatch" in placed, placed
        assert len(others) == 2 and "checkpoint_2.damaged" in others[0] and "checkpoint_0.damaged" in others[1], others
    else:
        assert r["warned"] == [], (rank, r["warned"])


def test_arrays_sharded_across_processes_round_trip(backend, tmp_path):
    group = run_group(backend, 2, [start, ckpt_sharded], tmp_path).ok()
    for rank, r in enumerate(group.scenario(ckpt_sharded)):
        assert r["mine"] == [[[1.0 + rank] * 3] * 2], r  # this process's rows, as saved
        assert r["sharding_kept"]
        assert f"sharded.{backend_class(backend).sharded_format}" in r["listing"] and "manifest.json" in r["listing"]
        refused = r["refused"]
        assert set(refused) == {"unlisted_file", "link_inside", "files_not_listed"}, refused
        assert "_EXTRA_METADATA: not listed in the manifest" in refused["unlisted_file"], refused
        assert "not a regular file" in refused["link_inside"] or "not listed" in refused["link_inside"], refused
        assert "lists no file" in refused["files_not_listed"], refused
        if r["verified_before_reading"]:  # a file that changed after its verification: refused everywhere
            assert r["changed"] and "changed after it was verified" in r["changed"], r["changed"]
            assert r["untouched"], r
