"""Scenarios of checkpoints in object storage (issue 29): the test starts an S3-compatible server
on loopback (`unified.testing.object_store`) and names a fresh bucket in ``UNIFIED_TEST_STORE``;
every process of the group writes its own files straight to it."""
from __future__ import annotations

import json
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
    result.update(_async_saves_and_hooks(acc, run, root))
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
    return {"unreachable_error": error, "unreachable_committed": committed,
            "unreachable_injected": len(faulty.injected),
            "hash_before_unreachable": before, "hash_after_unreachable": run.param_hash()}


def _async_saves_and_hooks(acc: Accelerator, run, root: str) -> dict:
    """An async save to the store, with a training step while it uploads: the checkpoint holds
    the state of the save; save-state hooks' files (written with ``open()`` into the folder the
    hook is given) committed with a synchronous and an async save, verified and handed to the
    load-state hooks in a local folder; a hook file changed on the store refused on every
    process before any hook runs."""
    from unified.checkpoint.store import ObjectStore

    out: dict = {}
    run.step()
    target = f"{root}/async"
    acc.save_state(target, async_save=True)
    out["async_hash_saved"] = run.param_hash()
    run.step()  # while the background uploads (torch holds the step until the files are written)
    acc.wait_for_checkpoint()
    out["async_hash_stepped"] = run.param_hash()
    acc.load_state(target)
    out["async_hash_loaded"] = run.param_hash()

    seen: dict = {"saves": 0, "loads": [], "save_dirs_local": []}

    def save_hook(models, weights, output_dir):
        seen["saves"] += 1
        seen["save_dirs_local"].append(os.path.isdir(output_dir))
        if acc.is_main_process:
            os.makedirs(os.path.join(output_dir, "sub"), exist_ok=True)
            with open(os.path.join(output_dir, "hook.json"), "w") as handle:
                json.dump({"saves": seen["saves"]}, handle)
            with open(os.path.join(output_dir, "sub", "extra.bin"), "wb") as handle:
                handle.write(bytes(range(256)) * 4096)

    def load_hook(models, input_dir):
        with open(os.path.join(input_dir, "hook.json")) as handle:
            loaded = json.load(handle)
        seen["loads"].append({"hook": loaded, "extra": os.path.getsize(os.path.join(input_dir, "sub", "extra.bin")),
                              "local": os.path.isdir(input_dir), "folder": input_dir})

    handles = [acc.register_save_state_pre_hook(save_hook), acc.register_load_state_pre_hook(load_hook)]
    hooked = [f"{root}/hooked", f"{root}/hooked-async"]
    acc.save_state(hooked[0])
    acc.save_state(hooked[1], async_save=True)
    acc.wait_for_checkpoint()
    for target in hooked:
        acc.load_state(target)
    out["hook_manifests"] = ([ObjectStore(t).read_manifest(t).get("hook_files") for t in hooked]
                             if acc.is_main_process else None)
    acc.wait_for_everyone()
    if acc.is_main_process:  # a hook file changed on the store after the commit
        store = ObjectStore(hooked[0])
        store.fs.pipe_file(store._path(f"{hooked[0]}/hook.json"), b'{"saves": 99}')
    acc.wait_for_everyone()
    loads_before = len(seen["loads"])
    try:
        acc.load_state(hooked[0])
        out["changed_hook_error"] = None
    except CheckpointError as err:
        out["changed_hook_error"] = str(err)
    out["hooks_after_change"] = len(seen["loads"]) - loads_before
    for handle in handles:
        handle.remove()
    out["hooks"] = {"saves": seen["saves"], "save_dirs_local": seen["save_dirs_local"],
                    "loads": [{k: v for k, v in load.items() if k != "folder"} for load in seen["loads"]],
                    "load_folders_removed": [not os.path.exists(load["folder"]) for load in seen["loads"]]}
    return out
