"""The checkpoint scenario of processes that each save to a folder of their own (issue 50: machines
without a shared file system), written once for every backend. Same rules as `scenarios.py`; run
by unified/testing/suite/test_checkpoint.py in its ``resumed`` group."""
from __future__ import annotations

import json
import os
import shutil

import unified
from unified import Accelerator
from unified.testing.scenario import scenario

from .checkpoint_scenarios import RESUME_AT, RESUME_END, _flip_last_byte
from .scenarios import _shared


@scenario(requires=("TrainingObjects",))
def ckpt_own_folders(state: dict) -> dict:
    """Issue 50: every process names a folder of its own (``tempfile.mkdtemp()``, as on machines
    without a shared file system). Each folder is committed, verified and retained on its own,
    and a resume from them is exact: parameters, optimizer, data position and every generator
    continue as in the uninterrupted run. A damaged file in another process's folder is refused
    on every process, and so are folders of two different saves."""
    import tempfile

    from .data_scenarios import _loader, _rows
    from .training import make

    def training(acc: Accelerator):
        run = make(acc)
        _, loader = _loader(acc, n=24, batch_size=2)

        def batches():
            while True:
                for batch in loader:
                    yield _rows(batch)

        return run, batches()

    acc = Accelerator(timeout=60, seed=5)
    state["acc"] = acc
    rank = acc.process_index
    mine = tempfile.mkdtemp(prefix=f"own-{rank}-", dir=_shared())
    run, batches = training(acc)
    rows_after, out = [], {}
    for step in range(1, RESUME_END + 1):
        rows = next(batches)
        run.step()
        if step == RESUME_AT:
            out["saved"] = acc.save_state(mine)
            out["after_save_draws"] = run.draws()
            out["hash_at_save"] = run.param_hash()
        elif step > RESUME_AT:
            rows_after.append(rows)
    out.update(final_hash=run.param_hash(), rows_after=rows_after, listing=sorted(os.listdir(mine)),
               siblings=sorted(n for n in os.listdir(os.path.dirname(mine)) if n.startswith(".")))
    with open(os.path.join(mine, "manifest.json")) as handle:
        manifest = json.load(handle)
    out["manifest"] = {"files": sorted(manifest["files"]), "num_processes": manifest["num_processes"]}

    # a new Accelerator resumes from its own folder
    again = Accelerator(timeout=60, seed=5)
    run2, batches2 = training(again)
    out["loaded"] = again.load_state(mine)
    out["resumed_draws"] = run2.draws()
    out["hash_at_load"] = run2.param_hash()
    resumed_rows = []
    for _ in range(RESUME_AT + 1, RESUME_END + 1):
        resumed_rows.append(next(batches2))
        run2.step()
    out.update(resumed_rows=resumed_rows, resumed_final_hash=run2.param_hash())

    def refused(folder: str) -> dict:
        before = run2.param_hash()
        try:
            again.load_state(folder)
        except unified.CheckpointError as err:
            return {"raised": "CheckpointError", "message": str(err), "untouched": run2.param_hash() == before}
        return {"raised": None, "untouched": run2.param_hash() == before}

    # a damaged file in process 1's folder: refused on every process before anything is restored
    damaged = shutil.copytree(mine, mine + "-damaged")
    if rank == 1:
        _flip_last_byte(os.path.join(damaged, "rng_1.safetensors"))
    again.wait_for_everyone()
    out["damaged"] = refused(damaged)
    # the folders of two different saves: process 0 names the first, the others the second
    first = tempfile.mkdtemp(prefix=f"own-first-{rank}-", dir=_shared())
    second = tempfile.mkdtemp(prefix=f"own-second-{rank}-", dir=_shared())
    again.save_state(first)
    run2.step()
    again.save_state(second)
    out["mixed"] = refused(first if rank == 0 else second)

    # automatic naming with a project folder of its own per process: numbering, retention and
    # the newest checkpoint per folder, the same N in every folder; an asynchronous save too
    auto = Accelerator(timeout=60, seed=5, project_config=unified.ProjectConfiguration(
        _shared(f"own_project_{rank}"), automatic_checkpoint_naming=True, total_limit=2))
    run3, _ = training(auto)
    saves = []
    for _ in range(3):
        run3.step()
        saves.append(os.path.basename(auto.save_state()))
    hash_newest = run3.param_hash()
    checkpoints = _shared(f"own_project_{rank}", "checkpoints")
    listing = sorted(os.listdir(checkpoints))
    run3.step()
    newest = os.path.basename(auto.load_state())
    out["automatic"] = {"saves": saves, "listing": listing, "newest": newest,
                        "restored": run3.param_hash() == hash_newest,
                        "iteration": auto.project_configuration.iteration}
    run3.step()
    asynchronous = os.path.basename(auto.save_state(async_save=True))
    auto.wait_for_checkpoint()
    out["automatic"].update(asynchronous=asynchronous, listing_after_async=sorted(os.listdir(checkpoints)))
    auto.end_training()
    return out
