"""Scenario functions of the fault trials (`tests/faults/trials.py`), run by the conformance suite's
worker (`unified.testing.worker`, which imports them as ``tests.faults.scenarios``: the trials put
the repository's root on the workers' PYTHONPATH).

Same shape as `unified.testing.scenarios`: each takes the per-process ``state`` dict and
returns JSON-serialisable observations; the parent (`trials.py`) judges them. Each trial's
random choices are made by the parent and passed in ``FAULT_*`` environment variables, so a
trial is reproducible from the parent's ``--seed``. Expected failures are caught and reported
here (type, message, time); anything else reaches the worker as an unexpected error.
"""
from __future__ import annotations

import builtins
import errno
import hashlib
import json
import os
import random
import signal
import time
import traceback
import warnings
from contextlib import contextmanager

import numpy as np

import unified
from unified import Accelerator
from unified.testing.checkpoint_scenarios import _project_acc, save_until_killed
from unified.testing.data_scenarios import CountingDataset, _rows
from unified.testing.scenario import scenario


def _shared(*parts: str) -> str:
    return os.path.join(os.environ["UNIFIED_TEST_SHARED"], *parts)


def _error(err: BaseException) -> dict:
    return {"raised": type(err).__name__, "unified": isinstance(err, unified.UnifiedError),
            "checkpoint_error": isinstance(err, unified.CheckpointError),
            "message": str(err)[:2000], "error_at": time.time()}


def state_hash(acc: Accelerator, skip_loaders: bool = False) -> str:
    """Hash of everything save_state writes except RNG: every prepared/registered object's state
    (model, optimizer, scheduler, registered objects, data positions), as save_state exports it."""
    from unified.checkpoint import codec

    manager = acc._checkpoints
    digest = hashlib.sha256()
    for entry in manager.entries:
        if skip_loaders and entry.name.startswith("dataloader"):
            continue
        structure, arrays = codec.encode(entry.get_state(), manager.backend.is_array, entry.name)
        digest.update(json.dumps([entry.name, structure], sort_keys=True).encode())
        for name in sorted(arrays):
            dtype, shape, raw = manager._export(arrays[name], False, {}, name)
            digest.update(f"{name}{dtype}{list(shape)}".encode())
            digest.update(raw.tobytes())
    return digest.hexdigest()


# -- 1. a process dies in the middle of a training loop ------------------------------------------------
@scenario(requires=("TrainingObjects",))
def fault_train_kill(state: dict) -> dict:
    """Train with a sync every step (wait_for_everyone / check_trigger alternately); the victim
    SIGKILLs itself at step FAULT_KILL_STEP, either before its training step (the others are then
    inside the step's collectives) or before the sync. Survivors report what they raised."""
    from unified.testing.training import make

    timeout = float(os.environ["FAULT_TIMEOUT"])
    victim, kill_step = int(os.environ["FAULT_VICTIM"]), int(os.environ["FAULT_KILL_STEP"])
    phase, jitter = os.environ["FAULT_PHASE"], float(os.environ["FAULT_JITTER"])
    steps = int(os.environ["FAULT_STEPS"])
    acc = Accelerator(timeout=timeout, seed=7)
    state["acc"] = acc
    run = make(acc)
    run.step()  # compile / warm up before the clock matters
    acc.wait_for_everyone()
    rank = acc.process_index

    def die() -> None:
        time.sleep(jitter)
        with open(_shared("killed.json"), "w") as handle:
            json.dump({"t": time.time(), "rank": rank, "step": step, "phase": phase}, handle)
        os.kill(os.getpid(), signal.SIGKILL)

    step = -1
    try:
        for step in range(steps):
            # Before the kill a slow peer (a loaded machine) is no fault: the collectives wait up to
            # 60 s; from the kill step on, the trial's timeout applies (it is what the row measures).
            acc._collectives.timeout = timeout if step >= kill_step else max(60.0, timeout)
            if rank == victim and step == kill_step and phase == "step":
                die()
            run.step()
            if rank == victim and step == kill_step and phase == "sync":
                die()
            if step % 2:
                acc.wait_for_everyone()
            else:
                acc.check_trigger()
    except BaseException as err:  # noqa: BLE001 - the observation is what was raised
        out = _error(err)
        out.update(step=step, mro=[c.__name__ for c in type(err).__mro__],
                   where=[f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_tb(err.__traceback__)][-6:])
        return out
    return {"raised": None, "step": step, "error_at": time.time()}


# -- 2. the whole group is killed during save_state ------------------------------------------------------
@scenario(requires=("TrainingObjects",))
def fault_save_loop(state: dict) -> dict:
    """`checkpoint_scenarios.ckpt_save_loop` with the save mode fixed by FAULT_SAVE_MODE (sync / async)."""
    asynchronous = os.environ["FAULT_SAVE_MODE"] == "async"
    return save_until_killed(_project_acc(state, total_limit=3), lambda i: asynchronous)


# -- 3/4. damaged and hostile checkpoints -------------------------------------------------------------------
@scenario(requires=("TrainingObjects",))
def fault_save_pristine(state: dict) -> dict:
    """Two good checkpoints of the same run, one step apart (sources of damage and of swapped files)."""
    from unified.testing.training import make

    acc = Accelerator(timeout=60, seed=3)
    state["acc"] = acc
    run = make(acc)
    run.step()
    acc.save_state(_shared("pristine"))
    pristine = state_hash(acc)
    run.step()
    acc.save_state(_shared("other"))
    return {"pristine_hash": pristine}


class _OpenWatch:
    """Record every successful open (os.open, open) of a file whose inode is in ``watched``."""

    def __init__(self, watched_paths) -> None:
        self.inodes = set()
        for path in watched_paths:
            st = os.stat(path)
            self.inodes.add((st.st_dev, st.st_ino))
        self.hits: list = []

    def _check(self, fd: int, path) -> None:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in self.inodes:
            self.hits.append(str(path))

    @contextmanager
    def active(self):
        real_os_open, real_open = os.open, builtins.open

        def os_open(path, flags, *args, **kwargs):
            fd = real_os_open(path, flags, *args, **kwargs)
            self._check(fd, path)
            return fd

        def open_(file, *args, **kwargs):
            handle = real_open(file, *args, **kwargs)
            if not isinstance(file, int):
                try:
                    self._check(handle.fileno(), file)
                except (OSError, ValueError):
                    pass
            return handle

        os.open, builtins.open = os_open, open_
        try:
            yield
        finally:
            os.open, builtins.open = real_os_open, real_open


@scenario(requires=("TrainingObjects",))
def fault_load_cases(state: dict) -> dict:
    """Load every case directory under FAULT_CASES (one group, one load per case) and report.

    Per case: what was raised, its message and how long it took, whether the state was left
    untouched, and any successful open of a file under ``outside/`` (hostile cases point there).
    """
    from unified.testing.training import make

    acc = Accelerator(timeout=float(os.environ.get("FAULT_TIMEOUT", "20")), seed=3)
    state["acc"] = acc
    state["run"] = make(acc)  # its objects stay alive beside acc
    root = _shared(os.environ["FAULT_CASES"])
    outside_dir = _shared("outside")
    outside = [os.path.join(outside_dir, n) for n in os.listdir(outside_dir)] if os.path.isdir(outside_dir) else []
    watch = _OpenWatch(outside)
    outcome = {}
    for case in sorted(os.listdir(root)):
        before = state_hash(acc)
        watch.hits = []
        start = time.monotonic()
        try:
            with watch.active():
                acc.load_state(os.path.join(root, case))
            result = {"raised": None, "state_hash": state_hash(acc)}
        except BaseException as err:  # noqa: BLE001
            result = _error(err)
        result["elapsed"] = time.monotonic() - start
        result["untouched"] = state_hash(acc) == before
        result["outside_reads"] = list(watch.hits)
        outcome[case] = result
        if result["raised"] not in (None, "CheckpointError"):
            outcome["__stopped_after__"] = case  # the group may be broken: do not go on
            break
    outcome["__pwned__"] = os.path.exists(_shared("PWNED"))
    return outcome


# -- 5. resume with another number of processes ------------------------------------------------------------
DATA_SAMPLES, DATA_SEEN = 24, 6  # 6 samples: a whole number of global batches for 2 and 3 processes


def _count_setup(state: dict):
    from unified.testing.training import make

    acc = Accelerator(timeout=60, seed=3)
    state["acc"] = acc
    run = make(acc)
    loader = acc.prepare(unified.DataLoader(CountingDataset(DATA_SAMPLES), batch_size=1, shuffle=True, seed=11))
    return acc, run, loader


@scenario
def fault_count_save(state: dict) -> dict:
    acc, run, loader = _count_setup(state)
    for _ in range(2):
        run.step()
    for _ in range(acc.process_index):  # give every process its own generator states
        run.draws()
    batches = iter(loader)
    for _ in range(DATA_SEEN // acc.num_processes):
        next(batches)
    acc.save_state(_shared(os.environ["FAULT_COUNT_SAVE_DIR"]))
    return {"state_hash": state_hash(acc, skip_loaders=True), "order": loader.epoch_order(0).tolist(),
            "num_processes": acc.num_processes, "draws_after": run.draws()}


@scenario
def fault_count_load(state: dict) -> dict:
    acc, run, loader = _count_setup(state)
    directory = _shared(os.environ["FAULT_COUNT_LOAD_DIR"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            acc.load_state(directory)
        except BaseException as err:  # noqa: BLE001
            return _error(err)
    rng_warnings = [str(w.message) for w in caught if "random generator" in str(w.message)]
    loaded_hash = state_hash(acc, skip_loaders=True)
    draws = run.draws()
    # The documented rule (docs/checkpoints.md): a process below the saving count continues its
    # own streams (the judge compares them with the saving process's draws); a new one seeds each
    # generator that differed between the saving processes (here: all of them) with
    # derived_rng_seed(generator, index, saving count, saved state of process index mod count).
    expected_draws = None
    saved = json.load(open(os.path.join(directory, "manifest.json")))["num_processes"]
    rank = acc.process_index
    if rank >= saved:
        from unified.checkpoint import codec
        from unified.checkpoint.manifest import read_manifest
        from unified.checkpoint.rng_state import derived_rng_seed

        manifest = read_manifest(directory)
        name = f"rng_{rank % saved}"
        template = codec.decode(manifest["structures"][name],
                                acc._checkpoints._read_file(directory, manifest, f"{name}.safetensors"), lambda a: a)
        random.seed(derived_rng_seed("python", rank, saved, template["host"]["python"]))
        np.random.seed(derived_rng_seed("numpy", rank, saved, template["host"]["numpy"]))
        (generator, value), = template["framework"].items()  # one framework generator on CPU
        acc._backend.seed(derived_rng_seed(generator, rank, saved, value))
        expected_draws = run.draws()
    rows = [_rows(b) for b in loader]  # the rest of the epoch, this process's share
    return {"raised": None, "state_hash": loaded_hash, "rng_warnings": rng_warnings, "draws": draws,
            "expected_draws": expected_draws, "rows": rows, "num_processes": acc.num_processes}


# -- 6. full disk during save ----------------------------------------------------------------------------------
@scenario(requires=("TrainingObjects",))
def fault_enospc(state: dict) -> dict:
    """For each case "mode:victim" in FAULT_ENOSPC: save A, step, then save B while
    safetensors_io.write raises ENOSPC (after writing a few bytes) on process ``victim`` once.
    Then: B must not exist, load_state() must load A with A's state."""
    from unified.checkpoint import safetensors_io
    from unified.testing.training import make

    acc = _project_acc(state)
    run = make(acc)
    rank = acc.process_index
    real_write = safetensors_io.write
    out = {}
    for case in os.environ["FAULT_ENOSPC"].split(","):
        mode, victim = case.split(":")
        run.step()
        saved_a = acc.save_state()
        hash_a = state_hash(acc)
        run.step()
        calls = {"n": 0}

        def full_disk(path, arrays, metadata=(), *, _calls=calls, **options):
            _calls["n"] += 1
            if _calls["n"] > 1:
                return real_write(path, arrays, metadata, **options)
            with open(path, "wb") as handle:  # a partly written file, as a full disk leaves
                handle.write(b"\0" * 16)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        if rank == int(victim):
            safetensors_io.write = full_disk
        start = time.monotonic()
        result: dict = {"raised": None}
        target = None
        try:
            target = acc.save_state(async_save=mode == "async")
            if mode == "async":
                acc.wait_for_checkpoint()
        except BaseException as err:  # noqa: BLE001
            result = _error(err)
        finally:
            safetensors_io.write = real_write
        result["elapsed"] = time.monotonic() - start
        folder = os.path.dirname(saved_a)
        acc.wait_for_everyone()
        result["listing"] = sorted(os.listdir(folder))
        result["saved_a"] = os.path.basename(saved_a)
        result["target"] = None if target is None else os.path.basename(target)
        try:
            loaded = acc.load_state()
            result["loaded"] = os.path.basename(loaded)
            result["loaded_ok"] = state_hash(acc) == hash_a
        except BaseException as err:  # noqa: BLE001
            result["load_error"] = _error(err)
            result["loaded_ok"] = False
        out[case] = result
    return out


# -- 12. an object store out of reach on one process -----------------------------------------------------
@scenario(requires=("TrainingObjects",))
def fault_store_unreachable(state: dict) -> dict:
    """One round per case of FAULT_STORE_CASES (``[[victim, kind], ...]``, JSON) on the S3 server
    named by UNIFIED_TEST_STORE: a good save to ``good_r``, a step, then a save to ``bad_r``
    while the victim's requests go through a proxy that fails every upload (``drop``: the
    connection closed without an answer; ``500``: InternalError; ``503``: SlowDown), with the
    client's retries at 2 attempts; then ``good_r`` is loaded. Reports what each save raised and
    after how long, whether ``bad_r`` was committed, and the parameters before and after."""
    from unified.checkpoint.store import ObjectStore
    from unified.errors import CheckpointError
    from unified.testing.object_store import FaultyEndpoint, requests_through
    from unified.testing.storage_scenarios import STORE_VARIABLE
    from unified.testing.training import make

    root, endpoint = os.environ[STORE_VARIABLE], os.environ["AWS_ENDPOINT_URL"]
    acc = state["acc"] = Accelerator(timeout=60, seed=7)
    run = make(acc)
    answers = {"drop": (None, ""), "500": (500, "InternalError"), "503": (503, "SlowDown")}
    rounds = []
    for r, (victim, kind) in enumerate(json.loads(os.environ["FAULT_STORE_CASES"])):
        run.step()
        good, bad = f"{root}/good_{r}", f"{root}/bad_{r}"
        acc.save_state(good)
        expected = run.param_hash()
        run.step()
        status, code = answers[kind]
        with FaultyEndpoint(endpoint) as faulty, \
                requests_through(faulty.endpoint if acc.process_index == victim else endpoint, max_attempts=2):
            faulty.fail(None, status=status, code=code, method="PUT")
            started = time.monotonic()
            try:
                acc.save_state(bad)
                error = None
            except CheckpointError as err:
                error = str(err)
            elapsed = time.monotonic() - started
        committed = ObjectStore(bad).has_manifest(bad) if acc.is_main_process else None
        acc.load_state(good)
        rounds.append({"error": error, "seconds": elapsed, "committed": committed, "expected": expected,
                       "loaded": run.param_hash()})
    acc.end_training()
    return {"rounds": rounds}


# -- 13. the group SIGKILLed while it saves to an object store ---------------------------------------------
def _store_project_acc(state: dict) -> Accelerator:
    from unified.testing.storage_scenarios import STORE_VARIABLE

    acc = Accelerator(timeout=60, seed=7, project_config=unified.ProjectConfiguration(
        f"{os.environ[STORE_VARIABLE]}/project", automatic_checkpoint_naming=True, total_limit=3))
    state["acc"] = acc
    return acc


@scenario(requires=("TrainingObjects",))
def fault_store_save_loop(state: dict) -> dict:
    """Save to the store after every step until the parent kills the group; the main process
    appends each save's iteration and parameter hash to expected.jsonl before the save."""
    return save_until_killed(_store_project_acc(state), lambda i: False)


@scenario(requires=("TrainingObjects",))
def fault_store_load_newest(state: dict) -> dict:
    """After the crash, as the same job restarted (the same UNIFIED_RUN_ID): load the newest
    committed checkpoint, save once more, and report what is left on the store: prefixes without
    a manifest below the new one, and unfinished multipart uploads."""
    from unified.checkpoint.store import ObjectStore
    from unified.testing.training import make

    acc = _store_project_acc(state)
    run = make(acc)
    path = acc.load_state()
    loaded = run.param_hash()
    newest = acc.save_state()
    result = {"path": path, "hash": loaded, "iteration": int(path.rstrip("/").rsplit("_", 1)[1])}
    if acc.is_main_process:
        folder = newest.rstrip("/").rsplit("/", 1)[0]
        store = ObjectStore(folder)
        names = store._names(folder)
        result["uncommitted"] = [n for n in names
                                 if n.startswith("checkpoint_") and not store.has_manifest(f"{folder}/{n}")]
        bucket = store._path(folder).split("/", 1)[0]
        uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
        result["unfinished_uploads"] = [u["Key"] for u in uploads]
    acc.end_training()
    return result
