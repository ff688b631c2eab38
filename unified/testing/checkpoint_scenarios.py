"""Checkpoint scenarios of the conformance suite (save, load, resume, damage, async saves,
sharded state), written once for every backend. Same rules as `scenarios.py`."""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Callable

import numpy as np

import unified
from unified import Accelerator
from unified.testing.scenario import scenario

from .scenarios import _shared


def _project_acc(state: dict, **config) -> Accelerator:
    acc = Accelerator(timeout=60, seed=7,
                      project_config=unified.ProjectConfiguration(_shared("project"), automatic_checkpoint_naming=True,
                                                                  **config))
    state["acc"] = acc
    return acc


RESUME_AT, RESUME_END = 4, 9


@scenario(requires=("TrainingObjects",))
def ckpt_first_run(state: dict) -> dict:
    """Train RESUME_AT steps, save, record the draws right after, then train on to RESUME_END."""
    from .training import make

    acc = _project_acc(state, total_limit=2)
    run = make(acc)
    for _ in range(acc.process_index):  # give every process its own generator states
        run.draws()
    hashes = {}
    for step in range(1, RESUME_END + 1):
        run.step()
        if step == RESUME_AT:
            saved = acc.save_state()
            if acc.is_main_process:  # keep a copy: retention below deletes checkpoint_0
                shutil.copytree(saved, _shared("resume_from"))
            acc.wait_for_everyone()
            after_save = run.draws()
            hashes["at_save"] = run.param_hash()
    final = run.param_hash()
    # naming, retention and collision checks on top of the run's own checkpoint
    more = [acc.save_state() for _ in range(3)]
    # when a synchronous save_state returns, retention has run (the checkpoint is durable first)
    listing = sorted(os.listdir(_shared("project", "checkpoints")))
    project = sorted(os.listdir(_shared("project")))  # nothing of ours beside what Accelerate writes
    acc.end_training()
    return {"saved": saved, "after_save_draws": after_save, "final_hash": final, "hashes": hashes,
            "more": more, "listing": listing, "project": project, "iteration": acc.project_configuration.iteration}


@scenario(requires=("TrainingObjects",))
def ckpt_resume_run(state: dict) -> dict:
    """A new group: load the run's checkpoint, check the draws, train to RESUME_END."""
    from .training import make

    acc = _project_acc(state, total_limit=2)
    run = make(acc)
    path = _shared("resume_from")
    loaded_newest_iteration = None
    acc.load_state(path)
    after_load_iteration = acc.project_configuration.iteration
    draws = run.draws()
    hash_at_load = run.param_hash()
    for _ in range(RESUME_AT + 1, RESUME_END + 1):
        run.step()
    final = run.param_hash()
    next_save = acc.save_state()
    acc.load_state()  # the newest: the one just written
    loaded_newest_iteration = acc.project_configuration.iteration
    acc.end_training()
    return {"draws": draws, "hash_at_load": hash_at_load, "final_hash": final, "next_save": next_save,
            "iteration_after_load": after_load_iteration, "iteration_after_newest": loaded_newest_iteration,
            "steps": run.counter.steps}


@scenario(requires=("TrainingObjects",))
def ckpt_explicit_dir(state: dict) -> dict:
    """Without automatic naming: save twice into one directory (replaced whole), load it back."""
    from .training import make

    acc = Accelerator(timeout=60, seed=3)
    state["acc"] = acc
    run = make(acc)
    target = _shared("explicit")
    run.step()
    acc.save_state(target)
    run.step()
    seen = {}

    def save_hook(models, weights, output_dir):  # Accelerate's hook: writes into the checkpoint
        seen["save"] = [len(models), len(weights)]
        if acc.is_main_process:
            with open(os.path.join(output_dir, "hook.json"), "w") as handle:
                json.dump({"models": len(models)}, handle)

    def load_hook(models, input_dir):
        with open(os.path.join(input_dir, "hook.json")) as handle:
            seen["load"] = json.load(handle)["models"]

    handles = [acc.register_save_state_pre_hook(save_hook), acc.register_load_state_pre_hook(load_hook)]
    acc.save_state(target)
    second = run.param_hash()
    run.step()
    acc.load_state(target)
    for handle in handles:
        handle.remove()
    siblings = sorted(os.listdir(os.path.dirname(target)))
    return {"hash_second": second, "hash_loaded": run.param_hash(), "siblings": siblings,
            "files": sorted(os.listdir(target)), "hooks": seen}


class _UnsaveableOnMain:
    """A registered object whose state cannot be stored (without pickle) on the main process only."""

    def __init__(self, acc: Accelerator) -> None:
        self.acc = acc

    def state_dict(self) -> dict:
        return {"handle": object() if self.acc.is_main_process else 0}

    def load_state_dict(self, state: dict) -> None:
        pass


@scenario
def ckpt_snapshot_failure(state: dict) -> dict:
    """save_state fails while taking the main process's snapshot: every process raises
    CheckpointError, the others with the main process's reason, and nothing is written."""
    acc = Accelerator(timeout=60)
    acc.register_for_checkpointing(_UnsaveableOnMain(acc))
    target = _shared(f"snapshot_failure_{acc.num_processes}")
    try:
        acc.save_state(target)
        outcome = {"raised": None}
    except unified.CheckpointError as err:
        outcome = {"raised": "CheckpointError", "message": str(err)}
    acc.wait_for_everyone()
    outcome["written"] = os.path.exists(target) or any(n.startswith(os.path.basename(target))
                                                       for n in os.listdir(os.path.dirname(target)))
    return outcome


@scenario(requires=("TrainingObjects",))
def ckpt_save_loop(state: dict) -> dict:
    """Save over and over (sync and async alternately) until the parent SIGKILLs the group.

    Before each save the main process appends the parameter hash that checkpoint will hold.
    """
    return save_until_killed(_project_acc(state, total_limit=3), lambda i: bool(i % 2))


def save_until_killed(acc: Accelerator, async_save: Callable[[int], bool]) -> dict:
    """A training step and a save (``async_save(i)``: the i-th one asynchronous?) over and over
    until the parent SIGKILLs the group. Before each save the main process appends the iteration
    and the parameter hash that checkpoint will hold to ``expected.jsonl``; once the first
    checkpoint is committed it leaves ``ready`` in the shared folder (the parent kills from then on)."""
    from .training import make

    run = make(acc)
    expected = _shared("expected.jsonl")
    for i in range(100_000):
        run.step()
        if acc.is_main_process:
            with open(expected, "a") as handle:
                handle.write(json.dumps({"iteration": acc.project_configuration.iteration,
                                         "hash": run.param_hash()}) + "\n")
        asynchronous = async_save(i)
        acc.save_state(async_save=asynchronous)
        if i == 0:
            if asynchronous:
                acc.wait_for_checkpoint()
            if acc.is_main_process:
                open(_shared("ready"), "w").close()
    return {"never": "reached"}


@scenario(requires=("TrainingObjects",))
def ckpt_load_newest(state: dict) -> dict:
    """After a crash: load the newest complete checkpoint and report what it holds."""
    from .training import make

    acc = _project_acc(state, total_limit=3)
    run = make(acc)
    path = acc.load_state()
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    loaded_hash = run.param_hash()
    acc.save_state()  # a new save after a crash cleans up the crashed save's temporaries
    leftovers = [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".")]
    return {"path": path, "iteration": manifest["iteration"], "hash": loaded_hash, "leftovers": leftovers}


@scenario(requires=("TrainingObjects",))
def ckpt_damaged(state: dict) -> dict:
    """Load deliberately damaged copies of a checkpoint (prepared by the parent) and report errors."""
    from .training import make

    acc = Accelerator(timeout=60, seed=3)
    state["acc"] = acc
    run = make(acc)
    outcome = {}
    root = _shared("damaged")
    for case in sorted(os.listdir(root)):
        for verify_first in (False, True):  # one pass (the default), then the old order
            before = run.param_hash()
            try:
                acc.load_state(os.path.join(root, case), verify_first=verify_first)
                result = {"raised": None}
            except unified.CheckpointError as err:
                result = {"raised": "CheckpointError", "message": str(err)}
            except Exception as err:  # noqa: BLE001 - the test wants to see anything else
                result = {"raised": type(err).__name__, "message": str(err)}
            result["untouched"] = run.param_hash() == before
            if verify_first:
                outcome[case]["verify_first"] = result
            else:
                outcome[case] = result
    # after a load that failed while placing, a load of an intact checkpoint restores everything
    acc.load_state(_shared("pristine"))
    intact = run.param_hash()
    run.step()
    try:
        acc.load_state(os.path.join(root, "flipped_byte"))
    except unified.CheckpointError:
        pass
    acc.load_state(_shared("pristine"))
    outcome["__restored_whole__"] = run.param_hash() == intact
    outcome["__pwned__"] = os.path.exists(_shared("PWNED"))
    outcome["__fallback__"] = _damaged_newest()
    return outcome


def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0xFF]))


def _damaged_newest() -> dict:
    """Automatic naming with a damaged newest checkpoint (issue 46): ``load_state()`` goes on to
    the newest one that verifies, every process alike, although only process 1 verifies the
    damaged file (its own RNG file); the main process alone warns; the damaged one is set aside
    as ``checkpoint_1.damaged`` and its number never reused. A newest checkpoint whose model
    file is found damaged while it is read into place (issue 48: one pass) is skipped the same
    way, and the next newest restores everything. Then every checkpoint damaged:
    ``load_state(if_exists=True, verify_first=True)`` raises on every process naming each, and
    restores nothing."""
    import warnings

    from .training import make

    acc = Accelerator(timeout=60, seed=3, project_config=unified.ProjectConfiguration(
        _shared("fallback"), automatic_checkpoint_naming=True, total_limit=3))
    run = make(acc)
    checkpoints = _shared("fallback", "checkpoints")
    hashes = []
    for _ in range(2):
        run.step()
        acc.save_state()
        hashes.append(run.param_hash())
    if acc.is_main_process:
        _flip_last_byte(os.path.join(checkpoints, "checkpoint_1", f"rng_{acc.num_processes - 1}.safetensors"))
    acc.wait_for_everyone()
    run.step()
    out: dict = {}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out["loaded"] = os.path.basename(acc.load_state())
        out["restored"] = run.param_hash() == hashes[0]
        out["next"] = os.path.basename(acc.save_state())
        out["listing"] = sorted(os.listdir(checkpoints))
        saved_in_next = run.param_hash()
        run.step()
        newest = acc.save_state()
        if acc.is_main_process:  # found only while its arrays are read into place
            _flip_last_byte(os.path.join(newest, "model_0.safetensors"))
        acc.wait_for_everyone()
        run.step()
        out["past_placed"] = os.path.basename(acc.load_state())
        out["past_placed_restored"] = run.param_hash() == saved_in_next
        if acc.is_main_process:  # now every checkpoint that is left is damaged
            for name in os.listdir(checkpoints):
                if "." not in name:
                    _flip_last_byte(os.path.join(checkpoints, name, "model_0.safetensors"))
        acc.wait_for_everyone()
        run.step()
        before = run.param_hash()
        try:
            acc.load_state(if_exists=True, verify_first=True)
            out["none_verifies"] = None
        except unified.CheckpointError as err:
            out["none_verifies"] = str(err)
        out["untouched"] = run.param_hash() == before
        out["listing_after"] = sorted(os.listdir(checkpoints))
    out["warned"] = [str(w.message) for w in said if "damaged" in str(w.message)]
    return out


@scenario(requires=("TrainingObjects",))
def ckpt_save_for_damage(state: dict) -> dict:
    from .training import make

    acc = Accelerator(timeout=60, seed=3)
    state["acc"] = acc
    run = make(acc)
    run.step()
    return {"path": acc.save_state(_shared("pristine"))}


@scenario(requires=("ShardedArrays",), kit=("sharded_table",))
def ckpt_sharded(state: dict) -> dict:
    """An array sharded across processes goes through the backend's sharded format and comes
    back in place; damaged copies of it are refused."""
    from .kit import kit_of

    ShardedTable = kit_of(state["acc"].backend).sharded_table
    fresh = Accelerator(timeout=60)
    table = ShardedTable(fresh, 1.0)
    fresh.register_for_checkpointing(table)
    path = fresh.save_state(_shared("sharded_ckpt"))
    table.table = ShardedTable(fresh, 50.0).table  # changed after the save
    fresh.load_state(path)
    mine = table.mine()
    # Damaged copies (issue 11, finding 11): the sharded reader must never open a file the
    # manifest does not list.
    folder = f"sharded.{fresh._backend.sharded_format}"
    damaged = _shared("sharded_damaged")
    if fresh.is_main_process:
        _damage_sharded(path, damaged, folder)
    fresh.wait_for_everyone()
    refused = {}
    for case in sorted(os.listdir(damaged)):
        try:
            fresh.load_state(os.path.join(damaged, case))
            refused[case] = None
        except unified.CheckpointError as err:
            refused[case] = str(err)
    out = {"mine": mine, "sharding_kept": table.same_layout(), "listing": sorted(os.listdir(path)),
           "refused": refused, "verified_before_reading": not getattr(fresh._backend, "hashes_while_reading", False)}
    if not out["verified_before_reading"]:
        return out  # its reader hashes what it reads: a file changed after a check cannot exist
    # Issue 11, finding 4: the sharded reader opens the files after they were verified; one that
    # changes meanwhile (here rewritten with its own bytes, which moves its change time) is refused
    # on every process, with nothing restored.
    from unified.checkpoint import manager as manager_module

    real_verify = manager_module.CheckpointManager._verify_sharded_tree

    def verify_then_rewrite(self, directory, manifest):
        verified = real_verify(self, directory, manifest)
        time.sleep(0.05)  # past the file system's clock tick
        if fresh.is_main_process:
            victim = sorted(verified)[-1]
            with open(victim, "rb") as handle:
                data = handle.read()
            with open(victim, "r+b") as handle:
                handle.write(data)
        return verified

    table.table = ShardedTable(fresh, 70.0).table
    before = table.mine()
    manager_module.CheckpointManager._verify_sharded_tree = verify_then_rewrite
    try:
        fresh.load_state(path)
        changed = None
    except unified.CheckpointError as err:
        changed = str(err)
    finally:
        manager_module.CheckpointManager._verify_sharded_tree = real_verify
    return {**out, "changed": changed, "untouched": table.mine() == before}


def _damage_sharded(pristine: str, root: str, folder: str) -> None:
    """Copies of a sharded checkpoint: an unlisted file and a link inside ``folder`` (its
    sharded files), and a re-signed manifest that names sharded arrays but lists none of their
    files."""
    from unified.checkpoint.manifest import _digest

    def copy(case: str) -> str:
        shutil.copytree(pristine, os.path.join(root, case), symlinks=True)
        return os.path.join(root, case)

    extra = copy("unlisted_file")
    with open(os.path.join(extra, folder, "_EXTRA_METADATA"), "w") as handle:
        handle.write("{}")
    linked = copy("link_inside")
    listed = sorted(os.path.join(where, name) for where, _, names in os.walk(os.path.join(linked, folder))
                    for name in names)
    victim = listed[-1]
    os.replace(victim, victim + ".real")
    os.symlink(victim + ".real", victim)
    unlisted = copy("files_not_listed")
    manifest_path = os.path.join(unlisted, "manifest.json")
    doc = json.load(open(manifest_path))
    doc.pop("manifest_xxh3")
    doc["files"] = {k: v for k, v in doc["files"].items() if not k.startswith(f"{folder}/")}
    doc["manifest_xxh3"] = _digest(doc)
    with open(manifest_path, "w") as handle:
        json.dump(doc, handle)


# -- async saves and in-place edits (issue 11, finding 1) -------------------------------------------
class LiveArray:
    """A registered object whose ``state_dict`` hands out its live NumPy array (no copy)."""

    def __init__(self) -> None:
        self.values = np.arange(8, dtype=np.float64)

    def state_dict(self) -> dict:
        return {"values": self.values}

    def load_state_dict(self, state: dict) -> None:
        self.values[...] = state["values"]


def _hold_writer(where: str):
    """Make the next write of a background save stop at ``where`` ("file": before a file is
    written, "chunk": after its first bytes were hashed, before they are written) until the
    returned ``release()``; ``wait_reached()`` says whether the writer got there."""
    import threading

    from unified.checkpoint import safetensors_io, safetensors_write

    reached, go = threading.Event(), threading.Event()
    # the stores write through `safetensors_io.write`; its chunks go through the writer's own `_pwrite_all`
    module, name = {"file": (safetensors_io, "write"), "chunk": (safetensors_write, "_pwrite_all")}[where]
    original = getattr(module, name)

    def held(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread() and not reached.is_set():
            reached.set()
            go.wait(60)
        return original(*args, **kwargs)

    setattr(module, name, held)

    def release() -> None:
        go.set()
        setattr(module, name, original)

    return (lambda: reached.wait(30)), release


@scenario(requires=("TrainingObjects",))
def ckpt_async_edits(state: dict) -> dict:
    """Edit saved state in place while an async save writes it (total_limit=1): every committed
    checkpoint must load and hold the state of the save_state call; a save that cannot hold it
    fails loudly and keeps the previous checkpoint."""
    from .training import make

    acc = Accelerator(timeout=60, seed=7, project_config=unified.ProjectConfiguration(
        _shared("async_edits"), automatic_checkpoint_naming=True, total_limit=1))
    state["acc"] = acc
    run, live = make(acc), LiveArray()
    acc.register_for_checkpointing(live)
    run.step()
    acc.save_state()
    outcome = {}
    previous = (run.param_hash(), live.values.tolist())

    def which(observed, at_call, edited, part):
        names = {"at_call": at_call[part], "previous": previous[part], "edited": edited[part]}
        return next((name for name, value in names.items() if value == observed), "other")

    for case, where, tracked in (("tracked_edit_before_write", "file", True),
                                 ("untracked_edit_between_hash_and_write", "chunk", False)):
        run.step()
        live.values[0] += 1.0  # the registered object changes with every step too
        at_call = (run.param_hash(), live.values.tolist())
        reached, release = _hold_writer(where)
        acc.save_state(async_save=True)
        held = reached()
        run.edit_in_place(1.0, tracked=tracked)
        live.values += 100.0
        edited = (run.param_hash(), live.values.tolist())
        release()
        try:
            acc.wait_for_checkpoint()
            raised = None
        except unified.CheckpointError as err:
            raised = str(err)
        result = {"held": held, "raised": raised, "load_error": None}
        try:
            acc.load_state()
            loaded = (run.param_hash(), live.values.tolist())
            result.update(params=which(loaded[0], at_call, edited, 0), live=which(loaded[1], at_call, edited, 1))
        except unified.CheckpointError as err:
            result["load_error"] = str(err)
        outcome[case] = result
        previous = at_call if raised is None else previous
        acc.wait_for_everyone()
    return outcome


@scenario(requires=("TrainingObjects",))
def ckpt_mismatch(state: dict) -> dict:
    """Load a checkpoint into a model that differs from the saving run's (issue 11, finding 15):
    a bias of another dtype on every process, or a weight of another shape on the last process
    only. Every process raises CheckpointError naming the tensor, promptly, with nothing restored."""
    from .training import make

    acc = Accelerator(timeout=60, seed=3)
    state["acc"] = acc
    make(acc).step()
    path = acc.save_state(_shared("mismatch_source"))
    outcome = {}
    for change, everywhere in (("dtype", True), ("shape", False)):
        fresh = Accelerator(timeout=60, seed=3)
        run = make(fresh)
        if everywhere or fresh.is_last_process:
            run.change_first_layer(change)
        before, start = run.param_hash(), time.monotonic()
        try:
            fresh.load_state(path)
            result = {"raised": None}
        except unified.CheckpointError as err:
            result = {"raised": "CheckpointError", "message": str(err)}
        result.update(untouched=run.param_hash() == before, elapsed=time.monotonic() - start)
        outcome[change] = result
    return outcome


@scenario(requires=("TrainingObjects",))
def ckpt_commit_failures(state: dict) -> dict:
    """Issue 11, findings 16 and 7: a checkpoint that a save interrupted between its two renames
    set aside is put back by one process while the others wait (for `load_state()` on a plain
    project_dir and for an explicit directory); a commit that fails on the main process (full
    disk while writing the manifest) reaches every process at once and leaves nothing behind."""
    import errno

    from .training import make

    target = _shared("interrupted")
    acc = Accelerator(timeout=60, seed=3, project_dir=target)
    state["acc"] = acc
    run = make(acc)
    run.step()
    acc.save_state()  # without automatic naming: project_dir itself is the checkpoint
    saved = run.param_hash()
    outcome = {}
    for case, argument in (("project_dir", None), ("explicit", target)):
        acc.wait_for_everyone()
        if acc.is_main_process:  # a crash between commit's two renames, as `layout.commit` leaves it
            parent, name = os.path.split(target)
            os.rename(target, os.path.join(
                parent, f".{name}.old-{'a1b2c3d4e5f6' if case == 'explicit' else '0123456789ab'}"))
        acc.wait_for_everyone()
        run.step()
        try:
            acc.load_state(argument)
            outcome[case] = {"raised": None, "restored": run.param_hash() == saved}
        except Exception as err:  # noqa: BLE001 - the test wants to see what it was
            outcome[case] = {"raised": type(err).__name__, "message": str(err)}
    from unified.checkpoint import store as store_module  # the folder's commit writes the manifest

    real_write = store_module.write_manifest

    def full_disk(directory, body):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), directory)

    if acc.is_main_process:
        store_module.write_manifest = full_disk
    start = time.monotonic()
    try:
        acc.save_state(_shared("commit_fails"))
        outcome["commit"] = {"raised": None}
    except Exception as err:  # noqa: BLE001
        outcome["commit"] = {"raised": type(err).__name__, "message": str(err)}
    finally:
        store_module.write_manifest = real_write
    outcome["commit"]["elapsed"] = time.monotonic() - start
    acc.wait_for_everyone()
    outcome["commit"]["left"] = sorted(n for n in os.listdir(_shared()) if "commit_fails" in n)
    return outcome


@scenario(requires=("TrainingObjects", "HealthChannel",))
def ckpt_async_part_failures(state: dict) -> dict:
    """An async save whose last process cannot write its part reaches every process at once (as a
    failed synchronous commit does), and leaves nothing behind: a full disk there (its files and
    its part marker fail), or only the marker failing. The main process learns it through the
    group's health channel, not from the marker file it would otherwise wait for until the timeout."""
    import errno

    from unified.checkpoint import safetensors_io
    from unified.checkpoint import store as store_module

    from .training import make

    acc = Accelerator(timeout=60, seed=3)
    state["acc"] = acc
    run = make(acc)
    run.step()
    real_write, real_marker = safetensors_io.write, store_module.Folder.post_report

    def full_disk(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    outcome = {"applies": True}
    for case in ("full_disk", "marker"):
        if acc.is_last_process:
            store_module.Folder.post_report = lambda self, path, report: full_disk(path)
            if case == "full_disk":
                safetensors_io.write = full_disk
        start = time.monotonic()
        try:
            acc.save_state(_shared(f"async_part_{case}"), async_save=True)
            acc.wait_for_checkpoint()
            result = {"raised": None}
        except Exception as err:  # noqa: BLE001 - the test wants to see what it was
            result = {"raised": type(err).__name__, "message": str(err)}
        finally:
            safetensors_io.write, store_module.Folder.post_report = real_write, real_marker
        result["elapsed"] = time.monotonic() - start
        acc.wait_for_everyone()
        result["left"] = sorted(n for n in os.listdir(_shared()) if f"async_part_{case}" in n)
        outcome[case] = result
    run.step()  # the group still works
    acc.save_state(_shared("async_part_after"), async_save=True)
    acc.wait_for_checkpoint()
    outcome["saved_after"] = os.path.isfile(_shared("async_part_after", "manifest.json"))
    return outcome
