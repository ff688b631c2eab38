"""Conformance scenarios of sharded state (``Accelerator(fsdp_plugin=...)``, contract Part 2,
"Sharded state"), written once for every backend with `unified.backend.ShardedTraining`. Every
line of framework code is in the backend's kit: its ``sharded`` setup (`ShardedSetup` says what
it offers). Run by ``suite/test_sharding.py``.

A tiny model trains on a fixed global batch whose rows are split over the processes; the same
model under a second Accelerator without the plugin, on the same rows, is the replicated run. A
saving group writes what it saved (full values) into the shared folder (``UNIFIED_TEST_SHARED``)
with ``np.savez``; groups of another size load its checkpoint and compare. No pickle anywhere.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import zipfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

import unified
from unified import Accelerator, FullyShardedDataParallelPlugin
from unified.testing.scenario import scenario

from .held_writes import hold_sharded_writes

ROWS = 12  # the global batch: divisible by 1, 2 and 3 processes, and in two halves by 2
FEATURES = 6
STEPS = 3
CLIP = 0.5
# Accelerator options of the training-loop cases, each against the replicated run with the same options
LOOP_CASES = {"bf16": {"mixed_precision": "bf16"}, "accumulation": {"gradient_accumulation_steps": 2},
              "bf16_accumulation": {"mixed_precision": "bf16", "gradient_accumulation_steps": 2}}
OPTIMIZER_FIRST = "UNIFIED_TEST_OPTIMIZER_FIRST"  # "1": the saving group prepares (optimizer, model)
NEEDS = dict(requires=("ShardedTraining",), kit=("sharded",))


class ShardedSetup:
    """What a backend's ``Kit.sharded`` offers (a class; this one only describes it).

    ``Setup(acc, optimizer_first=False)`` builds the tiny model (the same initial values on every
    process and in every instance) and an AdamW optimizer, and prepares them with ``acc``, in the
    order ``(optimizer, model)`` when ``optimizer_first``.

    Attributes:
        plugin_options: keyword arguments of the `FullyShardedDataParallelPlugin` the scenarios
            shard with (e.g. torch's wrap policy).
        export_metadata: the ``__metadata__`` that ``save_model``'s safetensors file must carry.
        writes_wait_for_result: whether the backend's ``begin_sharded_save`` leaves every file
            write to the `unified.backend.ShardedWrite` it returns (then nothing of the shards is
            on disk when an async ``save_state`` returns while that write is held).
        model: the prepared model (for ``acc.accumulate`` and ``acc.save_model``).
    """

    plugin_options: Dict[str, Any] = {}
    export_metadata: Optional[Dict[str, str]] = None
    writes_wait_for_result: bool = False
    model: Any = None

    def step(self, local_rows: np.ndarray, max_norm: float) -> Optional[float]:
        """One micro-step on this process's rows (float32, ``(rows, FEATURES)``) of the global
        batch: forward, backward, ``acc.clip_grad_norm_`` to ``max_norm`` where the backend
        clips, optimizer step. Returns the global gradient norm before clipping (``None`` on a
        micro-step that does not close an accumulation window, where the backend clips only there)."""
        raise NotImplementedError

    def full_params(self) -> Dict[str, np.ndarray]:
        """name -> the whole parameter (gathered where it is split; a collective)."""
        raise NotImplementedError

    def full_optimizer(self) -> Dict[str, np.ndarray]:
        """name -> the whole optimizer state array (a collective)."""
        raise NotImplementedError

    def edit_in_place(self, delta: float) -> None:
        """Add ``delta`` to every parameter, in place where the framework has in-place updates."""
        raise NotImplementedError

    def layout(self) -> Dict[str, Any]:
        """``{"placements": {parameter: [placement, fully replicated?]}, "wrapped": [...]}``:
        how each parameter is split over the processes, and the modules sharded as units of
        their own (torch's wrap policy; ``[]`` where arrays are split one by one)."""
        raise NotImplementedError

    @staticmethod
    def expected_layout(num_processes: int) -> Dict[str, Any]:
        """The `layout` this model must have on ``num_processes`` processes."""
        raise NotImplementedError

    @staticmethod
    def shard_file_process(relative: str) -> Optional[int]:
        """The process whose own shards the file ``relative`` (a path inside the checkpoint's
        ``sharded.<format>/`` folder) holds; ``None`` for a file of the format's shared metadata."""
        raise NotImplementedError

    @staticmethod
    def export_names(full: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """`full_params` keyed by the names ``save_model`` writes."""
        raise NotImplementedError

    @staticmethod
    def unpicklers() -> List[Tuple[Any, str]]:
        """``(module, attribute)`` slots holding the Unpickler class the framework's own
        collectives unpickle with (counted, besides `pickle`'s, while a checkpoint loads)."""
        return []


# -- helpers -----------------------------------------------------------------------------------------------
def _shared(*parts: str) -> str:
    return os.path.join(os.environ["UNIFIED_TEST_SHARED"], *parts)


def _setup_class() -> Any:
    from unified.backend.registry import resolve_backend_name

    from .kit import kit_of

    backend = resolve_backend_name()
    setup = kit_of(backend).sharded
    if setup is None:
        raise LookupError(f"the {backend!r} backend has ShardedTraining but its testing kit has no sharded setup "
                          "(Kit.sharded)")
    return setup


def _start(sharded: bool = True, optimizer_first: bool = False, **options: Any) -> Tuple[Accelerator, Any]:
    """An Accelerator (sharded, or replicated) and the kit's setup prepared with it."""
    Setup = _setup_class()
    plugin = FullyShardedDataParallelPlugin(**Setup.plugin_options) if sharded else None
    acc = Accelerator(timeout=60, fsdp_plugin=plugin, **options)
    return acc, Setup(acc, optimizer_first=optimizer_first)


def global_batch(step: int) -> np.ndarray:
    return np.random.default_rng(100 + step).normal(size=(ROWS, FEATURES)).astype(np.float32)


def _local_rows(acc: Accelerator, batch: np.ndarray) -> np.ndarray:
    per = ROWS // acc.num_processes
    return batch[acc.process_index * per:(acc.process_index + 1) * per]


def _train(setup: Any, acc: Accelerator, steps: int, first: int = 0, micro: int = 1) -> Tuple[List[float], int]:
    """``steps`` optimizer steps, each on ``micro`` micro-batches of the step's global batch
    (under ``acc.accumulate``); the gradient norms of the steps, and how many micro-steps closed
    an accumulation window."""
    norms, syncs = [], 0
    for step in range(first, first + steps):
        rows = _local_rows(acc, global_batch(step))
        for part in np.array_split(rows, micro):
            with acc.accumulate(setup.model):
                norm = setup.step(part, CLIP)
                if acc.sync_gradients:
                    syncs += 1
                    norms.append(float(norm))
    return norms, syncs


def _max_diff(a: dict, b: dict) -> float:
    if sorted(a) != sorted(b):
        return float("inf")
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) if a[k].size else 0.0
               for k in a)


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def _finite(values: dict) -> bool:
    return all(np.isfinite(v.astype(np.float64)).all() for v in values.values())


def _files(folder: str) -> List[str]:
    """Every file under ``folder`` (relative paths, sorted); ``[]`` when there is no folder."""
    return sorted(os.path.relpath(os.path.join(root, n), folder) for root, _, names in os.walk(folder) for n in names)


def _sharded_dir(checkpoint: str) -> str:
    return next(d for d in sorted(os.listdir(checkpoint)) if d.startswith("sharded."))


def _is_pickle(path: str) -> bool:
    """A pickle (protocol 2 to 5), or a zip holding one (``torch.save``'s format)."""
    with open(path, "rb") as handle:
        head = handle.read(2)
    if len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return True
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith(".pkl") for name in archive.namelist())
    return False


def _shard_files(Setup: Any, checkpoint: str) -> Dict[str, Optional[int]]:
    """``sharded.<format>/relative path`` -> the process that wrote it (`shard_file_process`)."""
    folder = _sharded_dir(checkpoint)
    return {f"{folder}/{rel}": Setup.shard_file_process(rel) for rel in _files(os.path.join(checkpoint, folder))}


@contextlib.contextmanager
def _counting_unpickles(seen: list, slots: List[Tuple[Any, str]]):
    """Count every unpickling while the body runs (appended to ``seen``): `pickle`'s and the
    framework's own (``slots``: where its collectives keep their Unpickler class)."""
    import pickle

    class Counting(pickle.Unpickler):
        def load(self):
            seen.append("Unpickler.load")
            return super().load()

    def counted(name, function):
        def wrapper(*args, **kwargs):
            seen.append(name)
            return function(*args, **kwargs)
        return wrapper

    saved = (pickle.Unpickler, pickle.loads, pickle.load)
    framework = [(module, name, getattr(module, name)) for module, name in slots if hasattr(module, name)]
    pickle.Unpickler = Counting
    pickle.loads, pickle.load = counted("pickle.loads", pickle.loads), counted("pickle.load", pickle.load)
    for module, name, _ in framework:
        setattr(module, name, Counting)
    try:
        yield
    finally:
        pickle.Unpickler, pickle.loads, pickle.load = saved
        for module, name, value in framework:
            setattr(module, name, value)


def _write_expected(acc: Accelerator, path: str, params: dict, optimizer: dict, after_next_step: dict,
                    optimizer_first: bool) -> None:
    """What a checkpoint holds, in full, the parameters one step later, and the order of prepare
    (a loading run prepares in the same order), written by the main process."""
    if acc.is_main_process:
        np.savez(path, optimizer_first=np.asarray(optimizer_first),
                 **{f"p/{k}": v for k, v in params.items()}, **{f"o/{k}": v for k, v in optimizer.items()},
                 **{f"n/{k}": v for k, v in after_next_step.items()})


def _expected(path: str) -> Dict[str, Any]:
    with np.load(path, allow_pickle=False) as data:
        values = {k: data[k] for k in data.files}
    out: Dict[str, Any] = {"optimizer_first": bool(values.pop("optimizer_first"))}
    for prefix in ("p", "o", "n"):
        out[prefix] = {k[2:]: v for k, v in values.items() if k.startswith(prefix + "/")}
    return out


# -- training and saving --------------------------------------------------------------------------------
@scenario(processes=(2, 3), **NEEDS)
def shard_train_and_save(_: dict) -> dict:
    """Parameters split as the setup says, training equal to the replicated run (parameters,
    optimizer state, gradient norms), the sharded checkpoint ``sharded_<n>`` (its files: each
    process's own, listed in the manifest, no pickle; the model's own file holds no split
    array), a second one a step later (``other_<n>``), and a consolidated ``save_model``.
    The group prepares (optimizer, model) when ``UNIFIED_TEST_OPTIMIZER_FIRST=1``."""
    optimizer_first = os.environ.get(OPTIMIZER_FIRST) == "1"
    acc, sharded = _start(optimizer_first=optimizer_first)
    n, Setup = acc.num_processes, type(sharded)
    result: Dict[str, Any] = {"layout": sharded.layout(), "expected_layout": Setup.expected_layout(n)}
    replicated_acc, replicated = _start(sharded=False, optimizer_first=optimizer_first)
    result["initial_equal"] = _equal(sharded.full_params(), replicated.full_params())
    norms, _ = _train(sharded, acc, STEPS)
    ref_norms, _ = _train(replicated, replicated_acc, STEPS)
    result.update(layout_after_training=sharded.layout(),
                  params_vs_replicated=_max_diff(sharded.full_params(), replicated.full_params()),
                  optimizer_vs_replicated=_max_diff(sharded.full_optimizer(), replicated.full_optimizer()),
                  norms_vs_replicated=max(abs(a - b) for a, b in zip(norms, ref_norms)), norms=len(norms))
    path = acc.save_state(_shared(f"sharded_{n}"))
    params, optimizer = sharded.full_params(), sharded.full_optimizer()
    _train(sharded, acc, 1, first=STEPS)
    _write_expected(acc, _shared(f"expected_{n}.npz"), params, optimizer, sharded.full_params(), optimizer_first)
    acc.save_state(_shared(f"other_{n}"))  # the same run a step later: a source of "another checkpoint's shards"
    exported = acc.save_model(sharded.model, _shared(f"export_{n}"))  # every process calls it
    full = sharded.full_params()  # a collective: every process
    if acc.is_main_process:
        import json

        from safetensors import safe_open
        from safetensors.numpy import load_file

        written, names = load_file(exported), Setup.export_names(full)
        with safe_open(exported, "np") as handle:
            metadata = handle.metadata()
        result["export"] = {"files": sorted(os.listdir(os.path.dirname(exported))), "metadata": metadata,
                            "expected_metadata": Setup.export_metadata,
                            "equal": sorted(written) == sorted(names) and all(
                                written[k].dtype == v.dtype and np.array_equal(written[k], v)
                                for k, v in names.items())}
        with open(os.path.join(path, "manifest.json")) as handle:
            manifest_files = sorted(json.load(handle)["files"])
        model_file = os.path.join(path, "model_0.safetensors")
        result["checkpoint"] = {
            "shard_files": _shard_files(Setup, path), "manifest_files": manifest_files,
            "pickles": [rel for rel in _files(path) if _is_pickle(os.path.join(path, rel))],
            "model_file_tensors": sorted(load_file(model_file)) if os.path.exists(model_file) else []}
    acc.wait_for_everyone()
    return result


@scenario(requires=("ShardedTraining", "TrainingLoop"), kit=("sharded",))
def shard_mixed_precision_and_accumulation(_: dict) -> dict:
    """bf16, gradient accumulation (2 micro-batches per step) and both on sharded state, each
    against the replicated run with the same options: the same parameters (up to bf16
    rounding), the same gradient norms, one optimizer step per window, parameters that stay
    float32 and split."""
    out = {}
    for case, options in LOOP_CASES.items():
        micro = options.get("gradient_accumulation_steps", 1)
        runs = {}
        for name in ("sharded", "replicated"):
            acc, setup = _start(sharded=name == "sharded", **options)
            initial = setup.full_params()
            norms, syncs = _train(setup, acc, STEPS, micro=micro)
            runs[name] = (setup, initial, norms, syncs)
        (sharded, initial, norms, syncs), (replicated, _, ref_norms, _) = runs["sharded"], runs["replicated"]
        params = sharded.full_params()
        out[case] = {"bf16": "mixed_precision" in options, "params": _max_diff(params, replicated.full_params()),
                     "norms": max(abs(a - b) for a, b in zip(norms, ref_norms)) if norms else None,
                     "steps": syncs, "moved": _max_diff(params, initial),
                     "dtypes": sorted({str(v.dtype) for v in params.values()}),
                     "layout": sharded.layout()}
    return out


# -- async saves ------------------------------------------------------------------------------------------
@scenario(**NEEDS)
def shard_async_save(_: dict) -> dict:
    """``save_state(async_save=True)`` of sharded state: it returns before the checkpoint is
    committed (the background write is held until the scenario lets it go); parameters changed
    in place and a training step right after the call do not reach the checkpoint (and the step
    does not wait for the held write); a load after ``wait_for_checkpoint`` restores the values
    of the call. Then a write that fails on process 1 only: ``wait_for_checkpoint`` fails on
    every process and nothing is committed."""
    acc, setup = _start()
    Setup, n = type(setup), acc.num_processes
    _train(setup, acc, 1)
    params, optimizer = setup.full_params(), setup.full_optimizer()
    gate, seen = threading.Event(), {}
    undo = hold_sharded_writes(acc, gate, seen)
    final = _shared(f"async_{n}")
    start = time.monotonic()
    acc.save_state(final, async_save=True)
    returned_in = time.monotonic() - start
    at_return = {"committed": os.path.exists(final), "write_returned": "gate_opened" in seen}
    files_at_return = _files(seen["directory"])
    setup.edit_in_place(1.0)  # into the very arrays the save took
    _train(setup, acc, 1, first=STEPS)  # the optimizer updates the sharded state right away
    edited_params, edited_optimizer = setup.full_params(), setup.full_optimizer()
    gate.set()
    acc.wait_for_checkpoint()
    undo()
    committed = os.path.exists(os.path.join(final, "manifest.json"))
    shard_files = _shard_files(Setup, final) if committed else {}
    with _counting_deferred_makes(acc) as counts:
        acc.load_state(final)
    changing = _load_while_sharded_files_change(acc, final)
    result = {"deferred": counts, "changing": changing, "returned_in": returned_in, "at_return": at_return,
              "files_at_return": files_at_return,
              "writes_wait_for_result": Setup.writes_wait_for_result, "write_thread": seen.get("thread"),
              "gate_opened": seen.get("gate_opened"), "committed": committed, "shard_files": shard_files,
              "edit_moved": _max_diff(edited_params, params),
              "step_moved_optimizer": _max_diff(edited_optimizer, optimizer),
              "params_equal": _equal(setup.full_params(), params),
              "optimizer_equal": _equal(setup.full_optimizer(), optimizer)}
    # a background write that fails on process 1 only (after the backend's own write, so that no
    # process waits for it inside the backend)
    gate, failed_seen = threading.Event(), {}
    gate.set()
    undo = hold_sharded_writes(acc, gate, failed_seen, fail=acc.process_index == 1)
    failing = _shared(f"async_failed_{n}")
    acc.save_state(failing, async_save=True)
    try:
        acc.wait_for_checkpoint()
        result["failure"] = None
    except unified.CheckpointError as err:
        result["failure"] = str(err)
    undo()
    result["failure_leftovers"] = sorted(name for name in os.listdir(os.path.dirname(failing))
                                         if os.path.basename(failing) in name)
    result["untouched_by_failure"] = _equal(setup.full_params(), params)
    return result


# -- a save killed mid-write ------------------------------------------------------------------------------
def _killed_project_run() -> Tuple[Accelerator, Any]:
    """The sharded run of the kill scenarios: automatic naming in a shared project folder."""
    return _start(project_config=unified.ProjectConfiguration(_shared("killed_project"),
                                                              automatic_checkpoint_naming=True))


@scenario(processes=(2,), **NEEDS)
def shard_killed_mid_save(_: dict) -> dict:
    """checkpoint_0 is committed, then the group hangs inside the next save's sharded write (its
    shard files written, nothing committed) until the parent kills it (``kill_now``). Goes last."""
    return _hang_mid_save(*_killed_project_run(), "killed_expected.npz", "kill_now")


def _hang_mid_save(acc: Accelerator, setup: Any, expected: str, kill_file: str) -> dict:
    _train(setup, acc, 1)
    acc.save_state()
    params, optimizer = setup.full_params(), setup.full_optimizer()
    _write_expected(acc, _shared(expected), params, optimizer, {}, False)
    real = acc._backend.save_sharded

    def write_then_hang(directory, arrays):
        real(directory, arrays)
        if acc.is_main_process:
            open(_shared(kill_file), "w").close()
        time.sleep(600)

    acc._backend.save_sharded = write_then_hang
    _train(setup, acc, 1, first=1)
    acc.save_state()
    return {"never": "reached"}


def _killed_store_run() -> Tuple[Accelerator, Any]:
    """The sharded run of the store's kill scenarios: automatic naming under the store's
    ``killed_project`` (the same ``UNIFIED_RUN_ID`` in both groups: a restart takes its lease over)."""
    return _start(project_config=unified.ProjectConfiguration(f"{_store_root()}/killed_project",
                                                              automatic_checkpoint_naming=True))


@scenario(processes=(2,), **NEEDS)
def shard_store_killed_mid_save(_: dict) -> dict:
    """`shard_killed_mid_save` on the object store (``UNIFIED_TEST_STORE``; none: nothing runs):
    checkpoint_0 committed there, then the group hangs after every process uploaded its shard
    objects of the next save (no manifest) until the parent kills it (``store_kill_now``)."""
    if _store_root() is None:
        return {"ran": False}
    return _hang_mid_save(*_killed_store_run(), "store_killed_expected.npz", "store_kill_now")


@scenario(**NEEDS)
def shard_store_resume_after_kill(_: dict) -> dict:
    """After that kill, the job restarted (on any number of processes): ``load_state()`` loads
    checkpoint_0 exactly (the killed save's objects, without a manifest, are no checkpoint), and
    the next save commits and removes them."""
    from unified.checkpoint.store import ObjectStore

    if _store_root() is None or not os.path.exists(_shared("store_killed_expected.npz")):
        return {"ran": False}
    acc, setup = _killed_store_run()
    folder = f"{_store_root()}/killed_project/checkpoints"
    store = ObjectStore(folder)
    before = sorted(store._names(folder))
    loaded = acc.load_state()
    expected = _expected(_shared("store_killed_expected.npz"))
    out = {"ran": True, "before": before, "loaded": loaded.rstrip("/").rsplit("/", 1)[1],
           "params_equal": _equal(setup.full_params(), expected["p"]),
           "optimizer_equal": _equal(setup.full_optimizer(), expected["o"])}
    saved = acc.save_state()
    out["saved"] = saved.rstrip("/").rsplit("/", 1)[1]
    out["after"] = sorted(store._names(folder))
    out["committed"] = [name for name in out["after"] if store.has_manifest(f"{folder}/{name}")]
    return out


@scenario(processes=(2,), **NEEDS)
def shard_resume_after_kill(_: dict) -> dict:
    acc, setup = _killed_project_run()
    loaded = acc.load_state()
    expected = _expected(_shared("killed_expected.npz"))
    return {"loaded": os.path.basename(loaded), "params_equal": _equal(setup.full_params(), expected["p"]),
            "optimizer_equal": _equal(setup.full_optimizer(), expected["o"]),
            "listing": sorted(os.listdir(_shared("killed_project", "checkpoints")))}


# -- loading on another number of processes ---------------------------------------------------------------
def _load_and_continue(saved_by: int, checkpoint: Optional[str] = None, expected_file: Optional[str] = None,
                       then: Optional[Any] = None) -> dict:
    expected = _expected(expected_file or _shared(f"expected_{saved_by}.npz"))
    acc, setup = _start(optimizer_first=expected["optimizer_first"])  # in the saving run's order of prepare
    _train(setup, acc, 1, first=50)  # different from what was saved
    before = setup.full_params()
    unpickled: list = []
    with _counting_unpickles(unpickled, setup.unpicklers()):
        acc.load_state(checkpoint or _shared(f"sharded_{saved_by}"))
    params, optimizer = setup.full_params(), setup.full_optimizer()
    result = {"layout": setup.layout(), "expected_layout": type(setup).expected_layout(acc.num_processes),
              "changed_by_load": not _equal(before, params), "unpickled": unpickled,
              "params_equal": _equal(params, expected["p"]), "optimizer_equal": _equal(optimizer, expected["o"])}
    _train(setup, acc, 1, first=STEPS)  # training goes on as it would have in the saving run
    after = setup.full_params()
    result.update(next_step=_max_diff(after, expected["n"]), finite=_finite(after))
    if then is not None:
        result["damaged"] = then(acc, setup)
    return result


@scenario(**NEEDS)
def shard_load_from_2(_: dict) -> dict:
    return _load_and_continue(2)


@scenario(**NEEDS)
def shard_load_from_3(_: dict) -> dict:
    return _load_and_continue(3)


# -- helpers of the store and deferred-read scenarios (also used above) ----------------------------
def _store_root() -> Optional[str]:
    from .storage_scenarios import STORE_VARIABLE

    return os.environ.get(STORE_VARIABLE) or None


@contextlib.contextmanager
def _counting_deferred_makes(acc: Accelerator, before_make: Callable[[int], None] = lambda made: None):
    """Within the block, the arrays the backend's sharded readers defer (`DeferredArray`: from a
    store or a folder) count the times they are made: ``{"returned": n, "made": [times per array]}``;
    ``before_make(arrays made so far)`` runs before each."""
    from unified.backend import DeferredArray

    backend, counts = acc._backend, {"returned": 0, "made": []}
    reader = backend.load_sharded

    class Counted(DeferredArray):
        def __init__(self, inner: DeferredArray) -> None:
            self.inner, self.shape, self.dtype, self.index = inner, inner.shape, inner.dtype, len(counts["made"])
            counts["made"].append(0)

        def make(self) -> Any:
            before_make(sum(counts["made"]))
            counts["made"][self.index] += 1
            return self.inner.make()

    def counting(directory, like, options):
        read = reader(directory, like, options)
        counts["returned"] += sum(isinstance(v, DeferredArray) for v in read.arrays.values())
        return dataclasses.replace(read, arrays={k: Counted(v) if isinstance(v, DeferredArray) else v
                                                 for k, v in read.arrays.items()})

    backend.load_sharded = counting
    try:
        yield counts
    finally:
        backend.__dict__.pop("load_sharded", None)


def _load_while_sharded_files_change(acc: Accelerator, directory: str) -> Dict[str, Any]:
    """A load of ``directory`` (a folder) that verifies first (``verify_first=True``) whose sharded
    files change (their times set 2 s later) once its reader made the first array it deferred,
    after every check passed: ``error`` is what it raised (None if it did not), and
    ``reloaded``: whether loading again worked."""
    from unified.checkpoint.store import location_of

    sharded = os.path.join(directory, _sharded_dir_name(location_of(directory).read_manifest(directory)))
    files = [os.path.join(root, name) for root, _, names in os.walk(sharded) for name in names]

    def change(made: int) -> None:
        if made == 1:  # the second array: the reader has begun putting arrays in place
            later = time.time_ns() + 2_000_000_000
            for path in files:
                os.utime(path, ns=(later, later))

    out: Dict[str, Any] = {"error": None, "made": None}
    with _counting_deferred_makes(acc, change) as counts:
        try:
            acc.load_state(directory, verify_first=True)
        except unified.CheckpointError as err:
            out["error"] = str(err)
    out["made"] = sum(counts["made"])
    acc.load_state(directory)  # the bytes never changed: loading again is the way out
    out["reloaded"] = True
    return out


def _sharded_dir_name(manifest: Dict[str, Any]) -> str:
    return next(name.split("/", 1)[0] for name in manifest["files"] if "/" in name) + "/"
