"""Scenarios of sharded training (``Accelerator(fsdp_plugin=...)``), run through `worker.py` with
``UNIFIED_TEST_SCENARIOS=sharding_scenarios,scenarios``. torch only until the JAX side lands (the
profile's ``sharded_training`` says which backends run them).

A tiny model (two ``Block`` layers, wrapped one by one) trains on a fixed global batch whose rows
are split over the processes; a whole copy trains in the same process on the whole batch as the
replicated reference. Full values (gathered DTensors) are compared as JSON lists.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

import numpy as np

import unified
from unified import Accelerator, FullyShardedDataParallelPlugin

ROWS, STEPS, LR, CLIP = 12, 3, 0.05, 0.5


def _shared(*parts: str) -> str:
    return os.path.join(os.environ["UNIFIED_TEST_SHARED"], *parts)


@contextlib.contextmanager
def _counting_unpickles(seen: list):
    """Count every unpickling while the body runs (appended to ``seen``), the process group's own
    included: torch.distributed's object collectives (``broadcast_object_list``, ``all_gather_object``,
    ``scatter_object_list``) unpickle what peers send through ``distributed_c10d._unpickler``."""
    import pickle

    import torch.distributed.distributed_c10d as c10d

    class Counting(pickle.Unpickler):
        def load(self):
            seen.append("Unpickler.load")
            return super().load()

    def counted(name, function):
        def wrapper(*args, **kwargs):
            seen.append(name)
            return function(*args, **kwargs)
        return wrapper

    saved = (pickle.Unpickler, pickle.loads, pickle.load, getattr(c10d, "_unpickler", None))
    pickle.Unpickler, c10d._unpickler = Counting, Counting
    pickle.loads, pickle.load = counted("pickle.loads", pickle.loads), counted("pickle.load", pickle.load)
    try:
        yield
    finally:
        pickle.Unpickler, pickle.loads, pickle.load = saved[:3]
        if saved[3] is not None:
            c10d._unpickler = saved[3]


def _build():
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)

        def forward(self, x):
            return torch.tanh(self.lin(x))

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), Block(), Block(), torch.nn.Linear(6, 3))


def _batch(step: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 3, generator=g)


def _mine(acc, tensor):
    per = ROWS // acc.num_processes
    return tensor[acc.process_index * per:(acc.process_index + 1) * per]


def _setup(state: dict, optimizer_first: bool = False, **options):
    import torch

    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"],
                                            state_dict_type=options.pop("state_dict_type", "SHARDED_STATE_DICT"))
    acc = Accelerator(timeout=60, seed=7, fsdp_plugin=plugin, **options)
    state["acc"] = acc
    model = _build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    if optimizer_first:
        optimizer, model = acc.prepare(optimizer, model)
    else:
        model, optimizer = acc.prepare(model, optimizer)
    return acc, model, optimizer


def _full(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float()


def _values(acc, model, optimizer) -> dict:
    """Full parameters and optimizer moments (a collective: every process gathers)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    params = {n: _full(p).tolist() for n, p in model.named_parameters()}
    inner = getattr(optimizer, "optimizer", optimizer)
    moments = get_optimizer_state_dict(model, inner)["state"]
    return {"params": params,
            "optimizer": {f"{k}/{m}": _full(v).tolist() for k, s in moments.items() for m, v in s.items()}}


def _diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) if np.size(a[k]) else 0.0 for k in a)


def _train(acc, model, optimizer, steps, start=0) -> list:
    norms = []
    for step in range(start, start + steps):
        x, y = _batch(step)
        loss = ((model(_mine(acc, x)) - _mine(acc, y)) ** 2).mean()
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def _reference(steps: int, accumulation: int = 1, bf16: bool = False):
    """The replicated run: the whole model on the whole batch, in this process."""
    import torch

    model = _build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for step in range(steps):
        x, y = _batch(step)
        for part in range(accumulation):
            rows = slice(part * ROWS // accumulation, (part + 1) * ROWS // accumulation)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x[rows]).float()
            (((out - y[rows]) ** 2).mean() / accumulation).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return model, norms


def fsdp_train_save(state: dict) -> dict:
    """Shard, train as the replicated run does, save (sharded) twice, export one file."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    acc, model, optimizer = _setup(state, optimizer_first=os.environ.get("FSDP_OPTIMIZER_FIRST") == "1")
    n = acc.num_processes
    sharded = all(isinstance(p, DTensor) and any(isinstance(q, Shard) for q in p.placements)
                  for p in model.parameters())
    wrapped = sorted(name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule))
    norms = _train(acc, model, optimizer, STEPS)
    reference, ref_norms = _reference(STEPS)
    ref_params = {k: v.detach().tolist() for k, v in reference.named_parameters()}
    values = _values(acc, model, optimizer)
    path = acc.save_state(_shared(f"fsdp_{n}"))
    if acc.is_main_process:
        with open(_shared(f"fsdp_{n}.json"), "w") as handle:
            json.dump(values, handle)
    listing = sorted(os.listdir(os.path.join(path, "sharded.dcp")))
    exported = acc.save_model(model, _shared(f"export_{n}"))
    export_diff = export_metadata = None
    if acc.is_main_process:
        from safetensors import safe_open
        from safetensors.numpy import load_file

        export_diff = _diff({k: v.tolist() for k, v in load_file(exported).items()}, values["params"])
        with safe_open(exported, "np") as handle:  # transformers' loaders check {"format": "pt"}
            export_metadata = handle.metadata()
    _train(acc, model, optimizer, 1, start=STEPS)
    acc.save_state(_shared(f"fsdp_{n}_later"))  # a source of "a shard from another checkpoint"
    return {"sharded": sharded, "wrapped": wrapped, "param_diff": _diff(values["params"], ref_params),
            "norm_diff": max(abs(a - b) for a, b in zip(norms, ref_norms)), "listing": listing,
            "export_diff": export_diff, "export_metadata": export_metadata, "export_files": sorted(os.listdir(os.path.dirname(exported))),
            "dtype": str(next(model.parameters()).dtype), "torch": torch.__version__}


def fsdp_load(state: dict) -> dict:
    """Load ``FSDP_SOURCE`` (saved by another number of processes, maybe) and compare full values."""
    source = os.environ["FSDP_SOURCE"]
    # prepare in the order the saving run did (the manifest lists its objects in that order)
    acc, model, optimizer = _setup(state, optimizer_first=os.environ.get("FSDP_SOURCE_OPTIMIZER_FIRST") == "1")
    before = _values(acc, model, optimizer)
    unpickled: list = []
    with _counting_unpickles(unpickled):
        acc.load_state(_shared(source))
    loaded = _values(acc, model, optimizer)
    with open(_shared(f"{source}.json")) as handle:
        saved = json.load(handle)
    _train(acc, model, optimizer, 1, start=STEPS)  # training goes on
    after = _values(acc, model, optimizer)
    return {"param_diff": _diff(loaded["params"], saved["params"]),
            "optimizer_diff": _diff(loaded["optimizer"], saved["optimizer"]),
            "changed_by_load": _diff(before["params"], loaded["params"]) > 0, "unpickled": unpickled,
            "trained_on": _diff(after["params"], loaded["params"]) > 0
            and all(np.isfinite(np.asarray(v)).all() for v in after["params"].values())}


def fsdp_damaged(state: dict) -> dict:
    """Damaged copies of ``fsdp_2``: a flipped byte in a shard, a missing shard, a shard from
    another checkpoint. Every load is a CheckpointError and restores nothing. On 2 processes each
    reads its own file whole (checked in the pass that reads it); on 3 (other optimizer order)
    each reads slices of the files (checked by a pass of its own after the read)."""
    acc, model, optimizer = _setup(state)  # in fsdp_2's order of prepare
    pristine = _shared("fsdp_2")
    shards = sorted(os.listdir(os.path.join(pristine, "sharded.dcp")))
    root = _shared(f"fsdp_damaged_{acc.num_processes}")
    if acc.is_main_process:
        def copy(case: str) -> str:
            shutil.copytree(pristine, os.path.join(root, case))
            return os.path.join(root, case, "sharded.dcp")

        flipped = os.path.join(copy("flipped_byte"), shards[-1])
        with open(flipped, "r+b") as handle:
            handle.seek(os.path.getsize(flipped) - 3)
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 0x10]))
        os.remove(os.path.join(copy("missing_shard"), shards[0]))
        shutil.copyfile(os.path.join(_shared("fsdp_2_later"), "sharded.dcp", shards[-1]),
                        os.path.join(copy("foreign_shard"), shards[-1]))
    acc.wait_for_everyone()
    before = _values(acc, model, optimizer)
    refused, unpickled = {}, []
    for case in sorted(os.listdir(root)):
        try:
            with _counting_unpickles(unpickled):
                acc.load_state(os.path.join(root, case))
            refused[case] = None
        except unified.CheckpointError as err:
            refused[case] = str(err)
    # the sharded read fails on the last process only (it is not a collective): every process
    # raises, none waits for the others' checksums until the timeout
    backend = acc._collectives.backend
    if acc.process_index == acc.num_processes - 1:
        def failing(directory, like):
            raise unified.CheckpointError(f"{directory}: injected read failure")
        backend.load_sharded_hashed = failing
    started = time.monotonic()
    try:
        acc.load_state(pristine)
        one_failed = None
    except unified.CheckpointError as err:
        one_failed = str(err)
    finally:
        backend.__dict__.pop("load_sharded_hashed", None)
    untouched = _diff(_values(acc, model, optimizer)["params"], before["params"]) == 0.0
    return {"refused": refused, "untouched": untouched, "unpickled": unpickled, "one_failed": one_failed,
            "one_failed_s": time.monotonic() - started}


def fsdp_bf16_accumulate(state: dict) -> dict:
    """bf16 and gradient accumulation (2 micro-batches per step) on the sharded model, against
    the replicated run under autocast; parameters stay float32."""
    acc, model, optimizer = _setup(state, mixed_precision="bf16", gradient_accumulation_steps=2)
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        xs, ys = _mine(acc, x), _mine(acc, y)
        half = len(xs) // 2
        for rows in (slice(0, half), slice(half, len(xs))):
            with acc.accumulate(model):
                loss = ((model(xs[rows]) - ys[rows]) ** 2).mean()
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
                optimizer.step()
                optimizer.zero_grad()
    values = _values(acc, model, optimizer)
    # the same total gradient as the whole batch in two micro-batches (up to bf16 rounding)
    reference, ref_norms = _reference(STEPS, accumulation=2, bf16=True)
    ref_params = {k: v.detach().tolist() for k, v in reference.named_parameters()}
    return {"dtype": str(next(model.parameters()).dtype), "steps": len(norms),
            "param_diff": _diff(values["params"], ref_params),
            "norm_diff": max(abs(a - b) for a, b in zip(norms, ref_norms))}


def _killed_project_run(state: dict):
    """The sharded run of the kill scenarios (automatic naming in a shared project), prepared."""
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])
    acc = Accelerator(timeout=60, seed=7, fsdp_plugin=plugin, project_config=unified.ProjectConfiguration(
        _shared("killed_project"), automatic_checkpoint_naming=True))
    state["acc"] = acc
    import torch

    model = _build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = acc.prepare(model, optimizer)
    return acc, model, optimizer


def fsdp_kill_setup(state: dict) -> dict:
    """Automatic naming: checkpoint_0 is committed, then the group hangs inside the next save's
    sharded write (its shard files written, nothing committed) until the parent kills it."""
    acc, model, optimizer = _killed_project_run(state)
    _train(acc, model, optimizer, 1)
    acc.save_state()
    values = _values(acc, model, optimizer)
    if acc.is_main_process:
        with open(_shared("killed_expected.json"), "w") as handle:
            json.dump(values, handle)
    real = acc._backend.save_sharded

    def write_then_hang(directory, arrays):
        real(directory, arrays)
        if acc.is_main_process:
            open(_shared("kill_now"), "w").close()
        time.sleep(600)

    acc._backend.save_sharded = write_then_hang
    _train(acc, model, optimizer, 1, start=1)
    acc.save_state()
    return {"never": "reached"}


def fsdp_kill_resume(state: dict) -> dict:
    acc, model, optimizer = _killed_project_run(state)
    loaded = acc.load_state()
    values = _values(acc, model, optimizer)
    with open(_shared("killed_expected.json")) as handle:
        saved = json.load(handle)
    leftovers = sorted(os.listdir(_shared("killed_project", "checkpoints")))
    return {"loaded": os.path.basename(loaded), "param_diff": _diff(values["params"], saved["params"]),
            "optimizer_diff": _diff(values["optimizer"], saved["optimizer"]), "listing": leftovers}


def _hold_sharded_writes(acc, gate, seen: dict, fail: bool = False):
    from held_writes import hold_sharded_writes  # the worker's folder is on sys.path

    return hold_sharded_writes(acc, gate, seen, fail)


def fsdp_async_save(state: dict) -> dict:
    """``save_state(async_save=True)`` of sharded state: it returns before any shard is written
    (the background write is held until the test lets it go), parameters changed in place and a
    training step right after the call do not reach the checkpoint (and the step does not wait
    for the shards), a load after ``wait_for_checkpoint`` restores the values of the call. Then a
    write that fails on process 1 only: ``wait_for_checkpoint`` fails on every process and
    nothing is committed."""
    import threading

    import torch

    acc, model, optimizer = _setup(state)
    n = acc.num_processes
    _train(acc, model, optimizer, 1)
    saved = _values(acc, model, optimizer)
    gate, seen = threading.Event(), {}
    undo = _hold_sharded_writes(acc, gate, seen)
    final = _shared(f"fsdp_async_{n}")
    start = time.monotonic()
    acc.save_state(final, async_save=True)
    returned_in = time.monotonic() - start
    at_return = {"committed": os.path.exists(final), "write_returned": "gate_opened" in seen,
                 "shard_files": sorted(os.listdir(seen["directory"])) if os.path.isdir(seen["directory"]) else []}
    with torch.no_grad():  # in place, into the very shards the save took
        for p in model.parameters():
            p.add_(1.0)
    # a training step (forward, optimizer step) while the shards are not written yet: it waits only
    # for the files written whole (had it waited for the whole save, the gate would have timed out)
    _train(acc, model, optimizer, 1, start=STEPS)
    edited = _values(acc, model, optimizer)
    gate.set()
    acc.wait_for_checkpoint()
    undo()
    committed = os.path.exists(os.path.join(final, "manifest.json"))
    acc.load_state(final)
    loaded = _values(acc, model, optimizer)
    shard_listing = sorted(os.listdir(os.path.join(final, "sharded.dcp")))

    # a background write that fails on process 1 only
    gate, failed_seen = threading.Event(), {}
    gate.set()
    undo = _hold_sharded_writes(acc, gate, failed_seen, fail=acc.process_index == 1)
    failing = _shared(f"fsdp_async_failed_{n}")
    acc.save_state(failing, async_save=True)
    try:
        acc.wait_for_checkpoint()
        error = None
    except unified.CheckpointError as err:
        error = str(err)
    undo()
    leftovers = sorted(name for name in os.listdir(os.path.dirname(failing))
                       if os.path.basename(failing) in name)
    after_failure = _values(acc, model, optimizer)
    return {"returned_in": returned_in, "at_return": at_return, "write_thread": seen.get("thread"),
            "gate_opened": seen.get("gate_opened"), "committed": committed, "shard_listing": shard_listing,
            "edit_moved": _diff(edited["params"], saved["params"]),
            "step_moved_optimizer": _diff(edited["optimizer"], saved["optimizer"]),
            "param_diff": _diff(loaded["params"], saved["params"]),
            "optimizer_diff": _diff(loaded["optimizer"], saved["optimizer"]),
            "failure": error, "failure_leftovers": leftovers,
            "untouched_by_failure": _diff(after_failure["params"], saved["params"]) == 0.0}
