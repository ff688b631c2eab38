"""Sharded-state scenarios on an object store (save and load through a store, a load while the
store's files change, deferred reads), written once for every backend; the setup and helpers are
`sharding_scenarios`'s."""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Dict, Optional

import unified
from unified import Accelerator
from unified.testing.scenario import scenario

from .sharding_scenarios import (
    NEEDS,
    STEPS,
    _counting_deferred_makes,
    _counting_unpickles,
    _equal,
    _expected,
    _load_and_continue,
    _shard_files,
    _sharded_dir,
    _sharded_dir_name,
    _shared,
    _start,
    _store_root,
    _train,
    _write_expected,
)

# -- on an object store ------------------------------------------------------------------------------------


@scenario(**NEEDS)
def shard_store_round_trip(_: dict) -> dict:
    """Sharded state saved to the object store (``UNIFIED_TEST_STORE``; none: nothing runs),
    synchronously and asynchronously (training goes on during the upload), each loaded back
    exactly; every process's own shard objects listed in the manifest. A backend without
    ``sharded_to_store`` must refuse the save on every process with nothing written."""
    root = _store_root()
    if root is None:
        return {"ran": False}
    from unified.checkpoint.store import ObjectStore

    acc, setup = _start()
    n = acc.num_processes
    out: Dict[str, Any] = {"ran": True, "supported": bool(getattr(acc._backend, "sharded_to_store", False))}
    _train(setup, acc, STEPS)
    target = f"{root}/sharded_{n}"
    params, optimizer = setup.full_params(), setup.full_optimizer()
    try:
        acc.save_state(target)
    except unified.CheckpointError as err:
        out["refused"] = str(err)
        out["left"] = ObjectStore(root).files(root) if acc.is_main_process else []
        return out
    _train(setup, acc, 1, first=STEPS)
    _write_expected(acc, _shared(f"store_expected_{n}.npz"), params, optimizer, setup.full_params(), False)
    later_params, later_optimizer = setup.full_params(), setup.full_optimizer()
    acc.save_state(f"{target}_async", async_save=True)
    _train(setup, acc, 1, first=STEPS + 1)  # while the background uploads
    acc.wait_for_checkpoint()
    with _counting_deferred_makes(acc) as counts:
        acc.load_state(target)
    out["deferred"] = counts
    out.update(sync_params=_equal(setup.full_params(), params),
               sync_optimizer=_equal(setup.full_optimizer(), optimizer))
    acc.load_state(f"{target}_async")
    out.update(async_params=_equal(setup.full_params(), later_params),
               async_optimizer=_equal(setup.full_optimizer(), later_optimizer))
    out["damaged"] = _load_damaged_store_shard(acc, setup, f"{target}_async")  # sharded_2 is loaded by 3 processes next
    if acc.is_main_process:
        store = ObjectStore(target)
        manifest = store.read_manifest(target)
        out["objects"] = store.files(target)
        out["manifest_files"] = sorted(manifest["files"])
        out["owners"] = sorted({type(setup).shard_file_process(name.split("/", 1)[1])
                                for name in out["objects"] if name.startswith(_sharded_dir_name(manifest))})
    acc.wait_for_everyone()
    return out








@scenario(**NEEDS)
def shard_store_load_from_2(_: dict) -> dict:
    """The 2-process sharded checkpoint on the store, loaded by this group (another process
    count: every process reads slices of the others' objects); then one of its shard objects
    damaged on the store and the load refused."""
    root = _store_root()
    expected = _shared("store_expected_2.npz")
    if root is None or not os.path.exists(expected):
        return {"ran": False}
    target = f"{root}/sharded_2"
    return {"ran": True, **_load_and_continue(2, target, expected,
                                              then=lambda acc, setup: _load_damaged_store_shard(acc, setup, target))}


def _load_damaged_store_shard(acc: Accelerator, setup: Any, target: str) -> Dict[str, Any]:
    """The main process flips a byte near the end of the largest shard object of ``target`` on
    the store; the load must fail on every process naming it: with nothing restored when it
    verifies first (``verify_first``), and in one pass (the default) with nothing restored or
    saying that the objects hold part of the checkpoint."""
    from unified.checkpoint.store import ObjectStore

    damaged = None
    if acc.is_main_process:
        store = ObjectStore(target)
        shards = [name for name in store.files(target) if "/" in name]
        damaged = max(shards, key=lambda name: store.size_of(f"{target}/{name}"))
        data = bytearray(store.read_range(f"{target}/{damaged}", 0, store.size_of(f"{target}/{damaged}")))
        data[-3] ^= 0x10
        store.fs.pipe_file(store._path(f"{target}/{damaged}"), bytes(data))
    damaged = acc._collectives.broadcast_json(damaged)
    _train(setup, acc, 1, first=60)
    tried: Dict[str, Any] = {}
    for verify_first in (False, True):  # one pass (the default), then the old order
        before_p, before_o = setup.full_params(), setup.full_optimizer()
        try:
            acc.load_state(target, verify_first=verify_first)
            message = None
        except unified.CheckpointError as err:
            message = str(err)
        tried["verify_first" if verify_first else "one_pass"] = {
            "object": damaged, "message": message,
            "untouched": _equal(before_p, setup.full_params()) and _equal(before_o, setup.full_optimizer())}
    return {**tried["one_pass"], "verify_first": tried["verify_first"]}


# -- damaged checkpoints ----------------------------------------------------------------------------------
def _largest(folder: str, files: Dict[str, Optional[int]], process: int) -> str:
    """The largest file of ``process``'s own shards."""
    mine = [rel for rel, owner in files.items() if owner == process]
    return max(mine, key=lambda rel: os.path.getsize(os.path.join(folder, rel)))


def _damaged_copies(Setup: Any, pristine: str, other: str, root: str) -> Dict[str, str]:
    """case -> what the error must name: a flipped byte in the last process's shard file, a
    missing shard file of process 0, a shard file of another checkpoint of the same run (one
    step later), and that checkpoint's whole shard folder."""
    files, other_files = _shard_files(Setup, pristine), _shard_files(Setup, other)
    last = max(owner for owner in files.values() if owner is not None)
    cases = {}

    def copy(case: str) -> str:
        shutil.copytree(pristine, os.path.join(root, case))
        return os.path.join(root, case)

    flipped = _largest(pristine, files, last)
    path = os.path.join(copy("flipped_byte"), flipped)
    with open(path, "r+b") as handle:  # in the last array's bytes (the file's header is the format's)
        handle.seek(os.path.getsize(path) - 3)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))
    cases["flipped_byte"] = flipped
    missing = _largest(pristine, files, 0)
    os.remove(os.path.join(copy("missing_shard"), missing))
    cases["missing_shard"] = missing
    foreign = flipped
    source = foreign if foreign in other_files else _largest(other, other_files, last)
    shutil.copyfile(os.path.join(other, source), os.path.join(copy("foreign_shard"), foreign))
    cases["foreign_shard"] = foreign
    folder = _sharded_dir(pristine)
    target = copy("other_checkpoint")
    shutil.rmtree(os.path.join(target, folder))
    shutil.copytree(os.path.join(other, folder), os.path.join(target, folder))
    cases["other_checkpoint"] = folder
    return cases


@scenario(**NEEDS)
def shard_damaged(_: dict) -> dict:
    """Damaged copies of the 2-process checkpoint, loaded by this group: each a CheckpointError
    naming the file, with nothing restored and nothing unpickled. Then a sharded read that fails
    on the last process only, where each process reads its shards apart from the others (a
    backend with ``hashes_while_reading``): every process raises at once, none waits for the
    others until the timeout."""
    expected = _expected(_shared("expected_2.npz"))
    acc, setup = _start(optimizer_first=expected["optimizer_first"])
    Setup = type(setup)
    _train(setup, acc, 1, first=50)
    root = _shared(f"damaged_{acc.num_processes}")
    cases = _damaged_copies(Setup, _shared("sharded_2"), _shared("other_2"), root) if acc.is_main_process else None
    cases = acc._collectives.broadcast_json(cases)
    out: Dict[str, Any] = {"cases": {}, "unpickled": []}
    for case, culprit in sorted(cases.items()):
        for verify_first in (False, True):  # one pass (the default), then the old order
            before_p, before_o = setup.full_params(), setup.full_optimizer()
            try:
                with _counting_unpickles(out["unpickled"], setup.unpicklers()):
                    acc.load_state(os.path.join(root, case), verify_first=verify_first)
                result: Dict[str, Any] = {"raised": None}
            except unified.CheckpointError as err:
                result = {"raised": "CheckpointError", "message": str(err), "culprit": culprit}
            result["untouched"] = _equal(before_p, setup.full_params()) and _equal(before_o, setup.full_optimizer())
            if verify_first:
                out["cases"][case]["verify_first"] = result
            else:
                out["cases"][case] = result
    before_p = setup.full_params()
    backend = acc._backend
    out["read_apart"] = bool(getattr(backend, "hashes_while_reading", False))
    if out["read_apart"]:
        if acc.process_index == acc.num_processes - 1:
            def failing(directory, like, options):
                raise unified.CheckpointError(f"{directory}: injected read failure")
            backend.load_sharded = failing
        started = time.monotonic()
        try:
            acc.load_state(_shared("sharded_2"))
            out["one_failed"] = None
        except unified.CheckpointError as err:
            out["one_failed"] = str(err)
        finally:
            backend.__dict__.pop("load_sharded", None)
        out["one_failed_s"] = time.monotonic() - started
        out["untouched_by_one_failed"] = _equal(before_p, setup.full_params())
    return out
