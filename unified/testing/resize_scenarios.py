"""Conformance scenarios of a restart on another number of processes (contract Part 2, "Sharded
state", last bullet), written once for every backend: a checkpoint saved by 2 processes loads
with 3 and with 1, and one saved by 3 loads with 2. Run by unified/testing/suite/test_resize.py, each
group one after another on the shared directory ``UNIFIED_TEST_SHARED``.

The data: a shuffled map-style loader and an iterable stream, 2 samples per process, whose
positions are global samples; a checkpoint after 12 samples continues exactly with global
batches of 4, 6 and 2, one after 8 samples is refused with 3 processes (global batch 6).
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings

import numpy as np

import unified
from unified import Accelerator, CheckpointError
from unified.checkpoint import codec, safetensors_io
from unified.testing.scenario import scenario

SAMPLES, BATCH = 48, 2


def _shared(*parts: str) -> str:
    return os.path.join(os.environ["UNIFIED_TEST_SHARED"], *parts)


class Indexed:
    """Map-style data whose samples are their own index."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"x": np.array([i], dtype=np.int64)}


class Stream:
    """Iterable data without state: the items 0, 1, 2, ... (a resume reads and drops the consumed ones)."""

    def __iter__(self):
        return ({"x": np.array([i], dtype=np.int64)} for i in range(SAMPLES))


def _rows(batch) -> list:
    """This process's sample ids of a batch (torch tensor, NumPy array or global jax.Array)."""
    x = batch["x"]
    if hasattr(x, "addressable_shards"):
        x = np.concatenate([np.asarray(s.data) for s in x.addressable_shards])
    return np.asarray(x).ravel().tolist()


def state_hash(acc: Accelerator) -> str:
    """Every value of the models, optimizers and registered objects (scheduler, counter) as
    `save_state` would write them: structure and array bytes."""
    backend, digest = acc._backend, hashlib.sha256()
    for entry in acc._checkpoints.entries:
        if not entry.name.startswith(("model_", "optimizer_", "custom_checkpoint_")):
            continue
        structure, arrays = codec.encode(entry.get_state(), backend.is_array, entry.name)
        digest.update(json.dumps(structure, sort_keys=True, default=str).encode())
        for name in sorted(arrays):
            value = arrays[name]
            dtype, shape, raw = (safetensors_io.export_numpy(value) if isinstance(value, np.ndarray)
                                 else backend.export_array(value))
            digest.update(f"{name}:{dtype}:{list(shape)}".encode())
            digest.update(np.ascontiguousarray(raw).tobytes())
    return digest.hexdigest()


def _setup(state: dict):
    from .training import make

    acc = Accelerator(timeout=60, seed=7)
    state["acc"] = acc
    run = make(acc)
    loader = acc.prepare(unified.DataLoader(Indexed(), batch_size=BATCH, shuffle=True, seed=5))
    stream = acc.prepare(unified.DataLoader(Stream(), batch_size=BATCH))
    return acc, run, loader, stream


def _window_setup(backend: str):
    """A training-loop setup with gradient accumulation (None on a backend without one)."""
    from unified.backend import TrainingLoop
    from unified.backend.registry import backend_spec, load_object

    from .loop_scenarios import _loader
    from .loop_scenarios import _setup as loop_setup

    if not issubclass(load_object(backend_spec(backend).backend), TrainingLoop):
        return None
    acc = Accelerator(timeout=60, seed=1, gradient_accumulation_steps=2)
    return acc, loop_setup(acc), _loader(acc, BATCH, n=SAMPLES)


def _load(acc: Accelerator, path: str) -> list:
    """`load_state`, returning the warnings it gave about random generators (not the frameworks' own)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(path)
    return [str(w.message) for w in caught if "random generator" in str(w.message)]


def _refused(acc: Accelerator, path: str) -> dict:
    """`load_state` of a checkpoint this run cannot continue: the error, and whether anything moved."""
    before = state_hash(acc)
    try:
        acc.load_state(path)
    except CheckpointError as err:
        return {"error": str(err), "untouched": state_hash(acc) == before}
    return {"error": None}


@scenario(requires=("TrainingObjects",))
def resize_save_2(state: dict) -> dict:
    """2 processes: checkpoints after 8 and 12 samples (and with an open / closed accumulation window)."""
    acc, run, loader, stream = _setup(state)
    order = loader.epoch_order(0).tolist()
    for _ in range(acc.process_index):  # every process its own Python and framework streams
        run.draws()
    np.random.seed(1234)  # NumPy's global generator alike on every process (as set_seed does)
    batches, items = iter(loader), iter(stream)
    for step in (1, 2, 3):  # global batches of 4: 4, 8, 12 samples
        run.step()
        next(batches), next(items)
        if step == 2:
            acc.save_state(_shared("at8"))
    acc.save_state(_shared("at12"))
    out = {"order": order, "hash": state_hash(acc), "draws": run.draws()}
    window = _window_setup(acc.backend)
    if window is None:
        return {**out, "window": "not run"}
    wacc, setup, wloader = window
    from .loop_scenarios import _train

    _train(wacc, setup, wloader, 3)  # 3 micro-batches (12 samples): a window is open
    out["open_step"] = wacc.gradient_state.step
    wacc.save_state(_shared("window_open"))
    _train(wacc, setup, wloader, 6, done=3)  # 6: closed, 24 samples
    wacc.save_state(_shared("window_closed"))
    out["window_order"] = wloader.epoch_order(0).tolist()
    return out


@scenario(requires=("TrainingObjects",))
def resize_load_3(state: dict) -> dict:
    """3 processes: refuse what cannot continue; load the 12-sample checkpoint twice; continue
    and save after 24 samples for the 3 -> 2 group."""
    acc, run, loader, stream = _setup(state)
    refused = _refused(acc, _shared("at8"))
    refused["positions"] = [loader.position, stream.position]
    caught = _load(acc, _shared("at12"))
    loaded, positions = state_hash(acc), [loader.position, stream.position]
    first = run.draws()
    _load(acc, _shared("at12"))
    again = run.draws()  # the same streams from the same checkpoint
    batches, items = iter(loader), iter(stream)
    next_rows, next_items = _rows(next(batches)), _rows(next(items))
    run.step()
    next(batches), next(items)  # 24 samples
    acc.save_state(_shared("from3"))
    out = {"refused": refused, "warnings": caught, "hash": loaded, "positions": positions, "draws": first,
           "draws_again": again, "next": next_rows, "next_items": next_items, "saved_hash": state_hash(acc)}
    out["saved_draws"] = run.draws()
    run.step()
    out["trained_hash"] = state_hash(acc)
    window = _window_setup(acc.backend)
    if window is None:
        return {**out, "window": "not run"}
    wacc, setup, wloader = window
    out["window_refused"] = _refused(wacc, _shared("window_open"))
    _load(wacc, _shared("window_closed"))
    out["window_step"] = wacc.gradient_state.step
    out["window_next"] = _rows(next(iter(wloader)))
    return out


def _load_and_continue(state: dict, path: str) -> dict:
    acc, run, loader, stream = _setup(state)
    caught = _load(acc, path)
    out = {"warnings": caught, "hash": state_hash(acc), "draws": run.draws()}
    batches, items = iter(loader), iter(stream)
    out["next"], out["next_items"] = _rows(next(batches)), _rows(next(items))
    run.step()
    out["trained_hash"] = state_hash(acc)
    return out


@scenario(requires=("TrainingObjects",))
def resize_load_1(state: dict) -> dict:
    """1 process: the 2-process checkpoint after 12 samples."""
    return _load_and_continue(state, _shared("at12"))


@scenario(requires=("TrainingObjects",))
def resize_load_2(state: dict) -> dict:
    """2 processes: the 3-process checkpoint after 24 samples."""
    return _load_and_continue(state, _shared("from3"))
