"""Scenarios of checkpoints in object storage (issue 29): the test starts an S3-compatible server
on loopback (`unified.testing.object_store`) and names a fresh bucket in ``UNIFIED_TEST_STORE``;
every process of the group writes its own files straight to it."""
from __future__ import annotations

import os

import unified
from unified import Accelerator
from unified.errors import CheckpointError
from unified.testing.scenario import scenario

STORE_VARIABLE = "UNIFIED_TEST_STORE"  # s3://BUCKET, empty, on the test's loopback server


@scenario(requires=("TrainingObjects",))
def store_checkpoints(state: dict) -> dict:
    """Three automatically named saves to ``s3://.../run`` with ``total_limit=2``; the newest
    loaded back (parameters and every generator as saved); an explicit URL saved and loaded;
    a second save to that URL refused on every process, the first still loadable."""
    from .training import make

    root = os.environ[STORE_VARIABLE]
    acc = Accelerator(timeout=60, seed=7, project_config=unified.ProjectConfiguration(
        f"{root}/run", automatic_checkpoint_naming=True, total_limit=2))
    state["acc"] = acc
    run = make(acc)
    for _ in range(acc.process_index):  # every process its own generator states
        run.draws()
    saved, hashes = [], []
    for _ in range(3):
        run.step()
        saved.append(acc.save_state())
        hashes.append(run.param_hash())
    listing = None
    if acc.is_main_process:  # when save_state returned, retention had run
        from unified.checkpoint.store import ObjectStore

        listing = sorted(name for _, name in ((n, p.rsplit("/", 1)[-1]) for n, p in
                                               ObjectStore(root).numbered(f"{root}/run/checkpoints")))
    acc.wait_for_everyone()
    draws_after_save = run.draws()
    run.step()
    loaded = acc.load_state()
    result = {"saved": saved, "hashes": hashes, "listing": listing, "loaded": loaded,
              "hash_loaded": run.param_hash(), "draws_after_save": draws_after_save,
              "draws_after_load": run.draws(), "iteration": acc.project_configuration.iteration}
    acc = Accelerator(timeout=60, seed=7)  # no automatic naming: save_state takes a URL
    state["acc"] = acc
    run = make(acc)
    run.step()
    explicit = f"{root}/explicit"
    acc.save_state(explicit)
    result["hash_explicit"] = run.param_hash()
    run.step()
    acc.load_state(explicit)
    result["hash_explicit_loaded"] = run.param_hash()
    try:
        acc.save_state(explicit)
        result["refused"] = None
    except CheckpointError as err:
        result["refused"] = str(err)
    acc.load_state(explicit)
    result["hash_after_refusal"] = run.param_hash()
    result.update(_store_out_of_reach_on_one_process(acc, run, root, explicit))
    acc.end_training()
    return result


def _store_out_of_reach_on_one_process(acc: Accelerator, run, root: str, previous: str) -> dict:
    """The last process's requests go through a proxy that drops the connection of every upload
    (retried by the client, then given up): the save raises `CheckpointError` on every process
    (none is left waiting), nothing is committed, and ``previous`` still loads exactly."""
    from .object_store import FaultyEndpoint, requests_through

    before = run.param_hash()
    run.step()
    target = f"{root}/out-of-reach"
    failing = acc.process_index == acc.num_processes - 1
    with FaultyEndpoint(os.environ["AWS_ENDPOINT_URL"]) as faulty, \
            requests_through(faulty.endpoint if failing else os.environ["AWS_ENDPOINT_URL"], max_attempts=2):
        faulty.fail(None, status=None, method="PUT")
        try:
            acc.save_state(target)
            error = None
        except CheckpointError as err:
            error = str(err)
    committed = None
    if acc.is_main_process:
        from unified.checkpoint.store import ObjectStore

        committed = ObjectStore(target).has_manifest(target)
    acc.load_state(previous)
    return {"unreachable_error": error, "unreachable_committed": committed, "unreachable_injected": len(faulty.injected),
            "hash_before_unreachable": before, "hash_after_unreachable": run.param_hash()}
